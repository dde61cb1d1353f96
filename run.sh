#!/usr/bin/env bash
# shardrun: one command from a fresh machine to a trained GPT.
#   bash run.sh            the main job for this machine (see `bash run.sh help`)
#   bash run.sh test       the whole test suite
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$(pwd)
VENV=${SHARDRUN_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

usage() {
  cat <<'USAGE'
usage: bash run.sh [COMMAND] [ARGS...]

  (none)                 the main job: the CPU track on a machine without a GPU (offline: prepare the
                         Python stdlib corpus, train configs/cpu.toml, print the summary and a sample);
                         the speedrun track with GPUs (fetch FineWeb shards, train the speedrun config)
  test [PYTEST ARGS]     the whole test suite (pytest); e.g. `bash run.sh test -m "not slow"`
  prepare [ARGS]         python -m data.prepare ARGS         (corpus -> token shards)
  train CONFIG [ARGS]    train.py --config CONFIG ARGS, under torchrun when NPROC or NNODES > 1 (torchrun's
                         own log and failure report go to the run folder's torchrun.log)
  bench [loader|recipe|memory] [ARGS]
                         the benchmarks in scripts/ (default: loader)
  leaderboard [DIRS]     python -m scripts.leaderboard (default: runs/ records/)
  plot RUN_DIR [...]     python -m scripts.plot: loss curves as a PNG (-o FILE, --x time|tokens|steps, --logy)
  sample CHECKPOINT [ARGS]
                         python -m scripts.sample: text from a checkpoint
  help                   this text

environment:
  BUDGET                 training budget in seconds (overrides train.budget_s)
  CONFIG                 config of the main job (default configs/cpu.toml, or the speedrun config on GPUs)
  NPROC                  processes per node (default: number of GPUs, else 1; CPU track: number of cores)
  NNODES NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ID
                         multi-node: torchrun --rdzv-backend=c10d at MASTER_ADDR:MASTER_PORT
                         (MASTER_PORT default 29517: 29500 is often taken on shared nodes); RDZV_ID: a new
                         id per job, the same on every node: it names the run folder, so reusing an id
                         resumes that run
  FINEWEB_SHARDS         FineWeb train shards to fetch on GPUs (default 9, 100M tokens each)
  SHARDRUN_VENV          virtualenv to create/reuse (default .venv); PYTHON: the interpreter to build it
USAGE
}

# Create or reuse the virtualenv and install requirements once (again only when they change).
# A machine whose Python already has torch >= 2.6 (a GPU node with CUDA torch) keeps that torch.
setup_env() {
  local base=${PYTHON:-python3} req=requirements.txt keep_torch want
  "$base" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "shardrun needs Python 3.11+")'
  # Only a base interpreter's torch: a venv made from another venv's python does not see that venv's packages.
  keep_torch=$("$base" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); print(int(v >= (2, 6) and sys.prefix == sys.base_prefix))' 2>/dev/null || echo 0)
  if [ ! -x "$PY" ]; then
    if [ "$keep_torch" = 1 ]; then "$base" -m venv --system-site-packages "$VENV"; else "$base" -m venv "$VENV"; fi
  fi
  want=$(sha256sum "$req" | cut -d' ' -f1)-$keep_torch
  if [ "$(cat "$VENV/.requirements.sha" 2>/dev/null)" != "$want" ]; then
    echo "[run.sh] installing requirements into $VENV (once) ..."
    "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip -q >/dev/null 2>&1 || {
      echo "run.sh: $VENV has no pip (its creation failed or was interrupted; on Debian/Ubuntu install" \
        "python3-venv); delete $VENV and run again" >&2; exit 1; }
    if [ "$keep_torch" = 1 ]; then
      grep -v '^torch[=<>~ ]' "$req" > "$VENV/requirements.notorch.txt"
      req=$VENV/requirements.notorch.txt
    fi
    "$PY" -m pip install -q --disable-pip-version-check -r "$req"
    echo "$want" > "$VENV/.requirements.sha"
  fi
}

num_gpus() { "$PY" -c 'import torch; print(torch.cuda.device_count())'; }

# train.py, in one process or under torchrun (multi-node through c10d rendezvous); trainer/torchrun.py keeps
# torchrun's own log lines and failure report in the run folder's torchrun.log, so a failure reads as one message.
launch() {
  local nproc=${NPROC:-$(num_gpus)} nnodes=${NNODES:-1}
  [ "$nproc" -gt 0 ] || nproc=1  # no GPU: one process
  [ -n "${BUDGET:-}" ] && set -- "$@" --train.budget_s="$BUDGET"
  if [ "$nproc" = 1 ] && [ "$nnodes" = 1 ]; then
    "$PY" train.py "$@"
  elif [ "$nnodes" = 1 ]; then
    "$PY" -m trainer.torchrun --standalone --nproc_per_node="$nproc" train.py "$@"
  else
    : "${MASTER_ADDR:?multi-node runs need MASTER_ADDR (address of the first node)}"
    : "${RDZV_ID:?multi-node runs need RDZV_ID: a new id for this job, the same on every node (it names the run folder)}"
    "$PY" -m trainer.torchrun --nnodes="$nnodes" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$nproc" \
      --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29517}" --rdzv-id="$RDZV_ID" train.py "$@"
  fi
}

cpu_track() {
  local config=${CONFIG:-configs/cpu.toml} run_id checkpoint
  run_id=cpu-$(date +%Y%m%d-%H%M%S)
  echo "[run.sh] CPU track: no GPU found. Preparing the offline demo corpus (Python's standard library, bytes tokenizer)"
  local demo=(-m data.prepare --demo --tokenizer bytes --val-tokens 1000000 --shard-tokens 10000000 --out shards/demo)
  # Derived data: a folder that an older version (or other settings) made is refused by prepare; remake it.
  "$PY" "${demo[@]}" || { echo "[run.sh] making shards/demo again (--overwrite)"; "$PY" "${demo[@]}" --overwrite; }
  # One single-threaded process per core: on 2 cores, 2 x 1 thread ran ~5x the steps of 1 process x 2 threads
  # whenever anything else used the CPU (the intra-op threads spin waiting for each other).
  local procs=${NPROC:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}  # cores: GNU nproc honours OMP_*
  echo "[run.sh] training $config: $procs processes x 1 thread (batch_size is per process)"
  OMP_NUM_THREADS=1 NPROC=$procs launch --config "$config" --log.run_id="$run_id"
  checkpoint=$(checkpoint_of "$run_id")
  echo "[run.sh] a sample from $checkpoint:"
  "$PY" -m scripts.sample "$checkpoint" --prompt "def " --tokens 300 --seed 0
  echo
  summary "$run_id" "def "
}

# The checkpoint a run saved: its config's train.checkpoint_path (a config such as the hackathon's sets one,
# relative to this folder), else the run folder's checkpoint.pt.
checkpoint_of() {
  "$PY" - "runs/$1" <<'PY'
import sys, tomllib
from pathlib import Path
run = Path(sys.argv[1])
config = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").is_file() else {}
print(config.get("train", {}).get("checkpoint_path") or run / "checkpoint.pt")
PY
}

# Where a finished run's files are, and the command that samples from its checkpoint.
summary() {
  local run_id=$1 prompt=$2 checkpoint
  checkpoint=$(checkpoint_of "$run_id")
  echo "[run.sh] done: the run is in runs/$run_id/"
  if [ -f "runs/$run_id/loss.png" ]; then echo "  curves      runs/$run_id/loss.png"
  else echo "  curves      not drawn (train.py said why above)"; fi
  echo "  checkpoint  $checkpoint"
  echo "  sample      bash run.sh sample $checkpoint --prompt \"$prompt\" --tokens 300"
}

gpu_track() {
  local ngpu=$1 config run_id
  config=${CONFIG:-configs/speedrun_8xh100.toml}
  [ "$ngpu" = 1 ] && [ -z "${CONFIG:-}" ] && config=configs/speedrun_1gpu.toml
  echo "[run.sh] speedrun track on $ngpu GPU(s): fetching pre-tokenized FineWeb shards if missing"
  "$PY" -m scripts.fetch_fineweb --shards "${FINEWEB_SHARDS:-9}" --out shards/fineweb10B
  # Every node must name the same folder: a multi-node job's RDZV_ID, else this launch's time.
  run_id=$(basename "$config" .toml)-${RDZV_ID:-$(date +%Y%m%d-%H%M%S)}
  NPROC=${NPROC:-$ngpu} launch --config "$config" --log.run_id="$run_id"
  summary "$run_id" "The "
}

# A benchmark name that is not scripts/bench_NAME.py: list the ones there are (before any install).
check_bench() {
  [ -f "scripts/bench_$1.py" ] && return
  local f known=""
  for f in scripts/bench_*.py; do f=${f#scripts/bench_}; known+=" ${f%.py}"; done
  echo "run.sh bench: no benchmark '$1'; the benchmarks are:$known (scripts/bench_NAME.py)" >&2
  exit 2
}

cmd=${1:-main}
[ $# -gt 0 ] && shift
[ "$cmd" = bench ] && check_bench "${1:-loader}"
case "$cmd" in
  help|-h|--help) usage; exit 0 ;;
  test|prepare|train|bench|leaderboard|plot|sample|main) setup_env ;;
  *) echo "run.sh: unknown command '$cmd'" >&2; usage >&2; exit 2 ;;
esac
case "$cmd" in
  test) exec "$PY" -m pytest tests "$@" ;;
  prepare) exec "$PY" -m data.prepare "$@" ;;
  train)
    [ $# -ge 1 ] || { echo "usage: bash run.sh train CONFIG [--section.key=value ...]" >&2; exit 2; }
    config=$1; shift
    launch --config "$config" "$@" ;;
  bench)
    which=${1:-loader}; [ $# -gt 0 ] && shift
    exec "$PY" -m "scripts.bench_$which" "$@" ;;
  leaderboard)
    if [ $# -eq 0 ]; then
      for d in runs records; do [ -d "$d" ] && set -- "$@" "$d"; done
      [ $# -gt 0 ] || { echo "run.sh leaderboard: no runs/ or records/ folder yet; train first or name folders" >&2; exit 2; }
    fi
    exec "$PY" -m scripts.leaderboard "$@" ;;
  plot) exec "$PY" -m scripts.plot "$@" ;;
  sample) exec "$PY" -m scripts.sample "$@" ;;
  main)
    ngpu=$(num_gpus)
    if [ "$ngpu" -gt 0 ]; then gpu_track "$ngpu"; else cpu_track; fi ;;
esac
