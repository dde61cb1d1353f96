#!/usr/bin/env bash
# shardrun: one command from a fresh machine to a trained GPT.
#   bash run.sh            the main job for this machine (see `bash run.sh help`)
#   bash run.sh test       the whole test suite
set -euo pipefail
CALLER=$PWD
SOURCE=${BASH_SOURCE[0]}
if [ -L "$SOURCE" ]; then SOURCE=$(readlink -f "$SOURCE"); fi  # the checkout, also when called through a link
cd "$(dirname "$SOURCE")"
ROOT=$(pwd)
VENV=${SHARDRUN_VENV:-$ROOT/.venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac  # a relative one is the checkout's, wherever a command runs
PY=$VENV/bin/python
WHEELS=${SHARDRUN_WHEELS:-$ROOT/wheels}

usage() {
  cat <<'USAGE'
usage: bash run.sh [COMMAND] [ARGS...]

  (none)                 the main job: the CPU track on a machine without a GPU (offline: prepare the
                         Python stdlib corpus, train configs/cpu.toml, print the summary and a sample);
                         the speedrun track with GPUs (fetch FineWeb shards, train the speedrun config).
                         CPU track: Ctrl-C (or SIGTERM) saves the run after its step and prints the command
                         that continues it; run again with the same BUDGET, CONFIG and NPROC, it continues
                         the newest unfinished run in runs/ (FRESH=1: start a new one instead)
  test [PYTEST ARGS]     the whole test suite (pytest, two workers); e.g. `bash run.sh test -m "not slow"`
  prepare [ARGS]         python -m data.prepare ARGS         (corpus -> token shards)
  train CONFIG [ARGS]    train.py --config CONFIG ARGS, under torchrun when NPROC or NNODES > 1 (torchrun's
                         own log and failure report go to the run folder's torchrun.log)
  bench [loader|recipe|memory|budgets|beside_record|optimizer] [ARGS]
                         the benchmarks in scripts/ (default: loader)
  leaderboard [DIRS] [ARGS]
                         python -m scripts.leaderboard (default DIRS: the checkout's runs/ records/)
  plot RUN_DIR [...]     python -m scripts.plot: loss curves as an image (-o FILE.png|svg|pdf, --x time|tokens|steps)
  sample CHECKPOINT [ARGS]
                         python -m scripts.sample: text from a checkpoint
  wheels [ARGS]          a wheel folder for a node without network (python -m scripts.wheels --help)
  gpu-check [ARGS]       bash scripts/gpu_check.sh: the one-shot check of the GPU recipes on one GPU
  help                   this text

  prepare, train, bench, wheels, gpu-check and the main job work in the checkout (their paths are relative to it,
  as the configs' data globs are); leaderboard, plot and sample read the paths given from where run.sh was called.

environment:
  BUDGET                 training budget in seconds (overrides train.budget_s)
  CONFIG                 config of the main job (default configs/cpu.toml, or the speedrun config on GPUs)
  FRESH                  FRESH=1: the CPU track starts a new run even where an unfinished one would continue
  NPROC                  processes per node (default: number of GPUs, else 1; CPU track: number of cores)
  NNODES NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ID
                         multi-node: torchrun --rdzv-backend=c10d at MASTER_ADDR:MASTER_PORT
                         (MASTER_PORT default 29517: 29500 is often taken on shared nodes); RDZV_ID: a new
                         id per job, the same on every node: it names the run folder, so reusing an id
                         resumes that run
  FINEWEB_SHARDS         FineWeb train shards to fetch on GPUs, 100M tokens each (default: the speedrun's
                         budget at its predicted tokens/s + 25%, in the rows it reads of them:
                         python -m scripts.predict_speedrun --shards)
  SHARDRUN_VENV          virtualenv to create/reuse (default .venv); PYTHON: the interpreter to build it (one with
                         torch >= 2.6 keeps it and its packages)
  SHARDRUN_WHEELS        wheel folder to install from, with no index, where it exists (default wheels/)
USAGE
}

# Create or reuse the virtualenv and install requirements once (again only when they change). A machine whose
# Python already has torch >= 2.6 (a GPU node with CUDA torch) keeps that torch, the Triton it came with and the
# packages beside it. A wheel folder (bash run.sh wheels, for a node without network) is installed from with no
# index, its own list of lines.
setup_env() {
  local base=${PYTHON:-python3} req=requirements.txt keep_torch want pth from=()
  if [ -f "$WHEELS/requirements.txt" ]; then req=$WHEELS/requirements.txt; from=(--no-index --find-links "$WHEELS"); fi
  "$base" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "shardrun needs Python 3.11+")'
  # Whether the venv keeps its base's torch is decided when it is made, and kept in its stamp: a later call with
  # another PYTHON must not reinstall it (pip would put torch==2.13.0 over the node's own torch)
  keep_torch=$(cat "$VENV/.requirements.sha" 2>/dev/null || true)
  keep_torch=${keep_torch##*-}
  if [ ! -x "$PY" ] || { [ "$keep_torch" != 0 ] && [ "$keep_torch" != 1 ]; }; then
    keep_torch=$("$base" -c 'import torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); print(int(v >= (2, 6)))' 2>/dev/null || echo 0)
  fi
  if [ ! -x "$PY" ]; then
    if [ "$keep_torch" = 1 ]; then see_packages_of "$base"; else "$base" -m venv "$VENV"; fi
    # The project on the venv's path, as an editable install puts it (that needs setuptools, which offline nodes
    # lack); written once, so a checkout that reuses another's venv leaves it pointing home.
  fi
  pth="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/shardrun.pth"
  [ -f "$pth" ] || echo "$ROOT" > "$pth"
  want=$(sha256sum "$req" | cut -d' ' -f1)-$keep_torch
  if [ "$(cat "$VENV/.requirements.sha" 2>/dev/null)" != "$want" ]; then
    echo "[run.sh] installing requirements into $VENV (once)${from:+ from $WHEELS, no index} ..."
    "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip -q >/dev/null 2>&1 || {
      echo "run.sh: $VENV has no pip (its creation failed or was interrupted; on Debian/Ubuntu install" \
        "python3-venv); delete $VENV and run again" >&2; exit 1; }
    if [ "$keep_torch" = 1 ]; then
      grep -Ev '^(torch|triton)[=<>~ ;]' "$req" > "$VENV/requirements.notorch.txt"
      req=$VENV/requirements.notorch.txt
    fi
    "$PY" -m pip install -q --disable-pip-version-check "${from[@]}" -r "$req"
    echo "$want" > "$VENV/.requirements.sha"
  fi
}

# A virtualenv that sees every package of the interpreter $1 (its torch above all). A base that is itself a venv
# (a cluster's module, a conda env) shares nothing through --system-site-packages, so its site folders are added
# by a .pth file, whose `import` lines run site.addsitedir: .pth files in those folders are read too. No pip of
# its own: the base's is seen, and a Debian/Ubuntu Python without python3-venv has no ensurepip to make one.
see_packages_of() {
  if [ "$("$1" -c 'import sys; print(int(sys.prefix == sys.base_prefix))')" = 1 ]; then
    "$1" -m venv --system-site-packages --without-pip "$VENV"
  else
    "$1" -m venv --without-pip "$VENV"
    "$1" -c 'import site; print("".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/shardrun-base.pth"
  fi
}

# What scripts/gpu_check.sh runs on: a venv set up from the wheel folder where there is one; else the node's own
# Python if it has what the check imports (nothing to install, no network needed); else a venv set up earlier; else
# one line naming what is missing.
gpu_check_env() {
  local base=${PYTHON:-python3} missing
  if [ -f "$WHEELS/requirements.txt" ]; then setup_env; return; fi
  missing=$("$base" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "numpy", "tiktoken", "tomli_w", "tqdm") if u.find_spec(m) is None))')
  if [ -z "$missing" ]; then PY=$base; return; fi
  if [ -f "$VENV/.requirements.sha" ]; then setup_env; return; fi
  echo "gpu_check: $base lacks ${missing// /, } and there is no wheel folder $WHEELS: on a machine with network" \
    "run \`bash run.sh wheels --python-version $("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')\`" \
    "(README: \"Offline nodes\") and copy wheels/ here" >&2
  exit 1
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
  local config=${CONFIG:-configs/cpu.toml} run_id checkpoint id="" step="" differ="" prepared=0 status=0
  if [ ! -f "$config" ]; then
    echo "run.sh: CONFIG=$config: no such file (configs/: $(cd configs && echo *.toml))" >&2
    exit 2
  fi
  echo "[run.sh] CPU track: no GPU found. Preparing the offline demo corpus (Python's standard library, bytes tokenizer)"
  local demo=(-m data.prepare --demo --tokenizer bytes --val-tokens 1000000 --shard-tokens 10000000 --out shards/demo)
  # Derived data: a folder whose shards prepare cannot continue (another Python's standard library made them, an
  # older version, or they are not what their meta.json lists) is refused with status 3: remake it, and start a new
  # run, as the old runs' data is gone. Any other failure (Ctrl-C, a full disk) stops here, the kept shards left
  # for the same command to continue.
  "$PY" "${demo[@]}" || prepared=$?
  if [ "$prepared" = 3 ]; then
    echo "[run.sh] making shards/demo again (--overwrite); runs on the old shards are not continued"
    "$PY" "${demo[@]}" --overwrite
    FRESH=1
  elif [ "$prepared" != 0 ]; then
    exit "$prepared"
  fi
  # One single-threaded process per core: intra-op threads spin waiting for each other whenever anything else
  # uses the CPU (docs/PERFORMANCE.md).
  local procs=${NPROC:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}  # cores: GNU nproc honours OMP_*
  # the arguments launch gives train.py (it adds BUDGET's), for the unfinished runs they would continue
  local args=(--config "$config" ${BUDGET:+--train.budget_s="$BUDGET"})
  [ -n "${FRESH:-}" ] || read -r id step differ <<< "$(unfinished "cpu-*" "$procs" "${args[@]}")"
  if [ -n "$id" ] && [ -z "$differ" ]; then
    run_id=$id
    echo "[run.sh] continuing the unfinished run $(as_called "runs/$run_id") (saved at step $step);" \
      "FRESH=1 bash $(as_called run.sh) starts a new one"
  else
    run_id=cpu-$(date +%Y%m%d-%H%M%S)
    [ -z "$id" ] || echo "[run.sh] runs/$id is unfinished (saved at step $step) but had other settings" \
      "($differ): starting a new run; run.sh continues that one given its BUDGET, CONFIG and NPROC"
  fi
  echo "[run.sh] training $config: $procs processes x 1 thread (batch_size is per process)"
  # Compiled where inductor can build kernels (its gain: docs/PERFORMANCE.md), else eagerly, and said so.
  local eager=() missing
  missing=$(cannot_compile "${args[@]}") || missing="its check failed (above)"
  if [ -n "$missing" ]; then
    echo "[run.sh] training eagerly (--train.compile=false), 1.3-1.5x fewer steps: $missing"
    eager=(--train.compile=false --optim.muon_compile=false)
  fi
  # A trap, so that run.sh outlives a Ctrl-C (or a SIGTERM to its process group) and says how to continue.
  trap : INT TERM
  OMP_NUM_THREADS=1 NPROC=$procs launch --config "$config" --log.run_id="$run_id" ${eager[@]+"${eager[@]}"} \
    || status=$?
  trap - INT TERM
  if [ "$status" != 0 ]; then
    read -r id step differ <<< "$(unfinished "$run_id" "$procs" "${args[@]}")"
    [ -z "$id" ] || echo "[run.sh] stopped: $(as_called "runs/$run_id") is saved at step $step; $(main_command)" \
      "continues it"
    exit "$status"
  fi
  checkpoint=$(checkpoint_of "$run_id")
  echo "[run.sh] a sample from $checkpoint:"
  # a sample that fails or is stopped (Ctrl-C) costs the run nothing: the summary below still comes
  "$PY" -m scripts.sample "$checkpoint" --prompt "def " --tokens 300 --seed 0 || echo "[run.sh] no sample"
  echo
  summary "$run_id" "def "
}

# `bash run.sh` with the knobs this main job was given.
main_command() {
  local v
  for v in NPROC CONFIG BUDGET; do [ -z "${!v:-}" ] || printf '%s=%q ' "$v" "${!v}"; done
  echo "bash $(as_called run.sh)"
}

# A path of the checkout ($1: relative to it, or absolute) as the caller of run.sh names it, for the lines it prints.
as_called() {
  case $1 in
    /*) printf '%s' "$1" ;;
    *) if [ "$CALLER" = "$ROOT" ]; then printf '%s' "$1"; else printf '%q' "$ROOT/$1"; fi ;;
  esac
}

# The newest unfinished run in runs/ whose name matches the glob $1 (one stopped by a signal, or killed):
# "RUN_ID STEP" if train.py with arguments $3... in $2 processes continues it, "RUN_ID STEP DIFFERENCES" if
# those change what it trains, nothing if there is none.
unfinished() {
  "$PY" - "$@" <<'PY'
import sys
from pathlib import Path
from trainer.runs import unfinished_run
from trainer.config import ConfigError, parse_args
try:
    found = unfinished_run(Path("runs"), sys.argv[1], parse_args(sys.argv[3:]), int(sys.argv[2]))
except ConfigError:
    sys.exit()  # train.py says what is wrong
if found:
    print(found[0].name, found[1], "; ".join(found[2]))
PY
}

# Why train.py with arguments $@ cannot compile here (train.compile or optim.muon_compile on, and inductor lacks a C++
# compiler or Python's headers, or its trial compile fails or hangs: trainer/parallel.py `cannot_compile`), or nothing.
cannot_compile() {
  "$PY" - "$@" <<'PY'
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C here ends the probe and run.sh at once, without a traceback
from trainer.config import ConfigError, parse_args
try:
    cfg = parse_args(sys.argv[1:])
except ConfigError:
    sys.exit()  # train.py says what is wrong
if cfg.compiled_keys:
    from trainer.parallel import cannot_compile
    def too_long(*_):
        raise TimeoutError("no answer in 300 s")
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(300)
    answer, sys.stdout = sys.stdout, sys.stderr  # stdout is the answer alone, whatever the compile prints
    print(cannot_compile() or "", file=answer)
PY
}

# The checkpoint the run runs/$1 saved, as its folder records it (trainer/runs.py `saved_checkpoint`), from here.
checkpoint_of() {
  local path
  path=$("$PY" -c 'import sys, pathlib, trainer.runs as r; print(r.saved_checkpoint(pathlib.Path(sys.argv[1])))' \
    "runs/$1")
  echo "${path#"$ROOT/"}"
}

# Where a finished run's files are, and the command that samples from its checkpoint.
summary() {
  local run_id=$1 prompt=$2 checkpoint
  checkpoint=$(checkpoint_of "$run_id")
  echo "[run.sh] done: the run is in $(as_called "runs/$run_id/")"
  if [ -f "runs/$run_id/loss.png" ]; then echo "  curves      $(as_called "runs/$run_id/loss.png")"
  else echo "  curves      not drawn (train.py said why above)"; fi
  echo "  checkpoint  $(as_called "$checkpoint")"
  echo "  sample      bash $(as_called run.sh) sample $(as_called "$checkpoint") --prompt \"$prompt\" --tokens 300"
}

gpu_track() {
  local ngpu=$1 config run_id shards
  config=${CONFIG:-configs/speedrun_8xh100.toml}
  [ "$ngpu" = 1 ] && [ -z "${CONFIG:-}" ] && config=configs/speedrun_1gpu.toml
  echo "[run.sh] speedrun track on $ngpu GPU(s): fetching pre-tokenized FineWeb shards if missing"
  shards=${FINEWEB_SHARDS:-$("$PY" -m scripts.predict_speedrun --shards)}
  "$PY" -m scripts.fetch_fineweb --shards "$shards" --out shards/fineweb10B
  # Every node must name the same folder: a multi-node job's RDZV_ID, else this launch's time.
  run_id=$(basename "$config" .toml)-${RDZV_ID:-$(date +%Y%m%d-%H%M%S)}
  NPROC=${NPROC:-$ngpu} launch --config "$config" --log.run_id="$run_id"
  summary "$run_id" "The "
}

# Run module $1 of this checkout with the rest as arguments, from where run.sh was called: the paths a user names
# are read from there (-P: that folder's own files are not imported).
from_caller() {
  local module=$1; shift
  cd "$CALLER"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -P -m "$module" "$@"
}

# A benchmark name that is not scripts/bench/NAME.py: list the ones there are (before any install).
check_bench() {
  [ -f "scripts/bench/$1.py" ] && [ "$1" != __init__ ] && return
  local f known=""
  for f in scripts/bench/[a-z]*.py; do f=${f#scripts/bench/}; known+=" ${f%.py}"; done
  echo "run.sh bench: no benchmark '$1'; the benchmarks are:$known (scripts/bench/NAME.py)" >&2
  exit 2
}

# The knobs that are counts or switches, checked before anything runs: bash's own tests would say "integer
# expression expected" and go on with a guess.
check_knobs() {
  local v
  for v in NPROC NNODES NODE_RANK; do
    [ -z "${!v:-}" ] || [[ ${!v} =~ ^[0-9]+$ ]] || { echo "run.sh: $v=${!v}: give a whole number" >&2; exit 2; }
  done
  [ "${NPROC:-1}" -ge 1 ] && [ "${NNODES:-1}" -ge 1 ] \
    || { echo "run.sh: NPROC and NNODES count processes and nodes: give 1 or more (or leave them unset)" >&2; exit 2; }
  [ -z "${BUDGET:-}" ] || [[ $BUDGET =~ ^[0-9]*[.]?[0-9]+([eE][+-]?[0-9]+)?$ ]] \
    || { echo "run.sh: BUDGET=$BUDGET: give the training budget in seconds, e.g. BUDGET=180" >&2; exit 2; }
  case ${FRESH:-} in
    "" | 1) ;;
    *) echo "run.sh: FRESH=$FRESH: FRESH=1 starts a new run; leave it unset to continue an unfinished one" >&2
       exit 2 ;;
  esac
}

cmd=${1:-main}
[ $# -gt 0 ] && shift
[ "$cmd" = bench ] && check_bench "${1:-loader}"
case "$cmd" in train | main) check_knobs ;; esac  # the commands that read them
case "$cmd" in
  help|-h|--help) usage; exit 0 ;;
  test|prepare|train|bench|leaderboard|plot|sample|main) setup_env ;;
  gpu-check) gpu_check_env ;;
  wheels) exec "${PYTHON:-python3}" -m scripts.wheels "$@" ;;  # needs only that Python's pip
  *) echo "run.sh: unknown command '$cmd'" >&2; usage >&2; exit 2 ;;
esac
case "$cmd" in
  # Two workers, a test file each at a time: much of a test's time is waiting on its subprocesses (timeouts,
  # torchrun's grace period), which the other worker fills. `-n 0` runs the tests in one process.
  test) exec "$PY" -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder "$@" ;;
  prepare) exec "$PY" -m data.prepare "$@" ;;
  train)
    [ $# -ge 1 ] || { echo "usage: bash run.sh train CONFIG [--section.key=value ...]" >&2; exit 2; }
    config=$1; shift
    launch --config "$config" "$@" ;;
  bench)
    which=${1:-loader}; [ $# -gt 0 ] && shift
    exec "$PY" -m "scripts.bench.$which" "$@" ;;
  leaderboard|plot|sample) from_caller "scripts.$cmd" "$@" ;;
  # The Python body plans its parts to end by its 525-s deadline, counted from its start; this bound covers the
  # rest (a hung import, NFS). After the TERM at 528 s the body stops the check in flight (SIGTERM, then SIGKILL 5 s
  # later) and exits; the KILL at 536 s comes after that, within the 540 s the check may take.
  gpu-check) exec timeout --kill-after=8 528 "$PY" -m scripts.gpu_check "$@" ;;
  main)
    ngpu=$(num_gpus)
    if [ "$ngpu" -gt 0 ]; then gpu_track "$ngpu"; else cpu_track; fi ;;
esac
