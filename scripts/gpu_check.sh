#!/usr/bin/env bash
# One-shot check of the speedrun and hackathon recipes on ONE GPU, offline, within 540 s from a cold compile cache
# (one device call of 600 s at most): compile health, where a step's time goes, tokens/s, MFU, memory, bf16
# attention and loader correctness, loss sanity; a verdict line per finding, as a table and as JSON
# (scripts/gpu_check/runner.py says what each check does and what each of its timeouts assumes).
#   bash scripts/gpu_check.sh --json $OUT/gpu_check.json            # add --record to keep it in records/gpu_check/
#   bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json     # rehearsal: tiny sizes, no GPU
# It runs on the node's own Python ($PYTHON, default python3) when that has torch, numpy, tiktoken, tomli_w and
# tqdm; else on a venv that run.sh sets up from a wheel folder (bash run.sh wheels, README "Offline nodes"), before
# the 540 s start.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/../run.sh" gpu-check "$@"
