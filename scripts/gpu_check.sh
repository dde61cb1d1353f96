#!/usr/bin/env bash
# One-shot check of the speedrun and hackathon recipes on ONE GPU, offline, in under 8 minutes:
# compile time, tokens/s, MFU, loader wait, peak memory and val loss, as a table and as JSON.
#   bash scripts/gpu_check.sh --json $OUT/gpu_check.json
#   bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json     # rehearsal: tiny sizes, no GPU
# Needs torch and numpy in $PYTHON (default python3), and tiktoken and tqdm for the text check (data.prepare).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The Python body stops its own checks by 450 s; this bound covers everything else (a hung import, NFS). The
# kill comes 30 s after the TERM: longer than the 15 s the script gives a check in flight to stop and save.
exec timeout --kill-after=30 470 "${PYTHON:-python3}" -m scripts.gpu_check "$@"
