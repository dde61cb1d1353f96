#!/usr/bin/env bash
# One-shot check of the speedrun and hackathon recipes on ONE GPU, offline, in under 8 minutes: compile health,
# where a step's time goes, tokens/s, MFU, memory, bf16 attention and loader correctness, loss sanity; a verdict
# line per finding, as a table and as JSON (scripts/gpu_check.py says what each check does).
#   bash scripts/gpu_check.sh --json $OUT/gpu_check.json            # add --record to keep it in records/gpu_check/
#   bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json     # rehearsal: tiny sizes, no GPU
# Needs torch and numpy in $PYTHON (default python3), and tiktoken and tqdm for the text check (data.prepare).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The Python body plans its parts to end by its 450-s deadline; this bound covers everything else (a hung import,
# NFS). After the TERM at 462 s the body stops the check in flight (SIGTERM, then SIGKILL 10 s later) and exits;
# the KILL at 474 s comes after that, and before 8 minutes.
exec timeout --kill-after=12 462 "${PYTHON:-python3}" -m scripts.gpu_check "$@"
