#!/usr/bin/env bash
# One-shot check of the speedrun and hackathon recipes on ONE GPU, offline, within 540 s from a cold compile cache
# (one device call of 600 s at most): compile health, where a step's time goes, tokens/s, MFU, memory, bf16
# attention and loader correctness, loss sanity; a verdict line per finding, as a table and as JSON
# (scripts/gpu_check.py says what each check does and what each of its timeouts assumes).
#   bash scripts/gpu_check.sh --json $OUT/gpu_check.json            # add --record to keep it in records/gpu_check/
#   bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json     # rehearsal: tiny sizes, no GPU
# Needs torch and numpy in $PYTHON (default python3), and tiktoken and tqdm for the text check (data.prepare).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The Python body plans its parts to end by its 525-s deadline, counted from its start; this bound covers
# everything else (a hung import, NFS). After the TERM at 528 s the body stops the check in flight (SIGTERM, then
# SIGKILL 5 s later) and exits; the KILL at 536 s comes after that, and within the 540 s the check may take.
exec timeout --kill-after=8 528 "${PYTHON:-python3}" -m scripts.gpu_check "$@"
