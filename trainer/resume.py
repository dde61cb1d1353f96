"""How a launch of train.py meets its run folder: which run it is, whether it continues one, what a resume
changes, and the command that resumes a stopped run. Refusals happen before anything in the folder changes."""
from __future__ import annotations

import fcntl
import os
import shlex
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from data.loader import TokenLoader
from trainer import distributed
from trainer.checkpoint import TORCH_HEADS, remove_run, restore, resume_marker, run_files
from trainer.clock import Clock
from trainer.config import Change, Config, ConfigError, TrainConfig, check_resume
from trainer.distributed import Dist
from trainer.runs import checkpoint_path, ended_summary
from trainer.state import Progress, Run, StopReason
from util.atomic import existing_folder, remove_left_behind, reporting_full_disk


class RunFinished(Exception):
    """The run in log.run_id ended already and this launch would not train it on: the message says so."""


def default_run_id(name: str) -> str:
    """<config name>-<torchrun's run id>, else <config name>-<timestamp>-<pid> (unique, so never resumed)."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # "none" when torchrun was given no --rdzv-id
    # torchrun keeps this id across --max-restarts (and SLURM jobs pass their job id), so a restarted job
    # finds its own run folder and resumes it
    return f"{name}-{elastic}" if elastic != "none" else f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def open_run_folder(cfg: Config, dist: Dist, run_dir: Path) -> tuple[dict | None, list[Change]]:
    """What train.resume makes of `run_dir`: the resume marker to continue from (None: a fresh start, for which
    "overwrite" has cleared the folder) and the config changes that resume makes. Raises ConfigError where it
    refuses, RunFinished where the run ended there; either way before anything in the folder changes."""
    _check_writable(cfg, run_dir)
    resume = cfg.train.resume
    marker = None if resume in ("never", "overwrite") else resume_marker(run_dir, dist)
    if marker is None and resume == "must":
        raise ConfigError(f"train.resume = 'must' (--resume) but {run_dir}/resume/done.json does not exist: "
                          f"nothing to resume; check log.run_id and log.dir")
    if resume == "never" and (held := run_files(run_dir, dist)):
        raise ConfigError(f"train.resume = 'never', but {run_dir} holds a run already ({', '.join(held)}); "
                          f"start a new run in another folder (another log.run_id), or replace this one with "
                          f"--train.resume=overwrite (--overwrite)")
    changes = check_resume(marker["config"], cfg, str(run_dir)) if marker else []
    if marker and (ended := marker["finished"]) and not any(_extends(c, ended) for c in changes):
        limit = LIMIT.get(ended["status"])
        raise RunFinished(f"{run_dir}: this run finished ({_said(ended)}); nothing to do"
                          + (f" (a larger {limit} with --extend-budget trains it on)" if limit else ""))
    if marker and not cfg.train.save_checkpoint:
        raise ConfigError(f"{run_dir}: this run saved its state (step {marker['step']}), so it goes on saving it: "
                          f"with train.save_checkpoint = false its end would lie past its last state and "
                          f"checkpoint.pt, and a relaunch would train it again from step {marker['step']}; set "
                          f"train.save_checkpoint = true (or leave it out), or start a new run (another "
                          f"--log.run_id)")
    if not marker and resume == "auto" and (ended := distributed.broadcast(
            ended_summary(run_dir) if dist.master else None)):  # it saved nothing to go on from
        raise RunFinished(f"{run_dir}: this run finished ({_said(ended)}) and saved no state to train on from "
                          f"(train.save_checkpoint = false); nothing to do (--overwrite trains it again from the "
                          f"start)")
    _check_access(cfg, dist, run_dir)
    hold(run_dir, dist)
    if run_dir.resolve() in _held:  # the run is ours alone now: a save it was killed in left its temporary file
        saved = checkpoint_path(run_dir, cfg.train.checkpoint_path)
        remove_left_behind(run_dir, recursive=True)
        remove_left_behind(saved.parent, saved.name)
    if resume == "overwrite":
        remove_run(run_dir, dist)
    return marker, changes


def reopen(run_dir: Path, dist: Dist, marker: dict) -> None:
    """A finished run about to be trained on (every refusal passed) is unfinished until its new end: a launch
    killed before that leaves a run to resume, not a finished one beside the longer run's config.toml and steps
    (done.json keeps what its end gave)."""
    if marker["finished"] and dist.master:
        (run_dir / "summary.json").unlink()


LOCK = ".lock"  # in the run folder: who trains it now (pid and host); the lock itself is the OS's, on the open file
# the run folders this process holds, each by its open file: held until the process ends, however it ends (the OS
# then releases them); a second run of the same folder in this process (train.main called again) holds it already
_held: dict[Path, int] = {}


def hold(run_dir: Path, dist: Dist) -> None:
    """Rank 0 locks `run_dir` for as long as this process lives; every rank gets a ConfigError where another launch
    holds it (the same log.run_id launched twice: both would append to one log and save over each other). A
    filesystem that gives no locks is said, and the run goes on without one."""
    holder, key = None, run_dir.resolve()
    if dist.master and key not in _held:
        with reporting_full_disk(run_dir / LOCK):
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
            except OSError as e:  # ENOLCK, EOPNOTSUPP: NFS without its lock daemon, a Lustre mount without flock
                print(f"train.py: {run_dir / LOCK}: this filesystem gives no lock ({e.strerror}): a second launch "
                      f"of this run id would not be refused", file=sys.stderr)
                os.close(fd)
            else:
                _held[key] = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
    holder = distributed.broadcast(holder)
    if holder:
        raise ConfigError(f"{run_dir} is being trained by another launch ({holder}, {LOCK} says): wait for it to "
                          f"end, or train this one under another log.run_id")


def _said(ended: dict) -> str:
    """How a finished run's summary.json ended, in a few words."""
    val = ended["final_val_loss"]
    return (f"{ended['status']}, step {ended['steps']}, "
            + (f"final val loss {val:.4f}" if val is not None else "no final eval"))


# the key whose limit stopped a run, by summary.json's status; a run stopped at its target has none to raise
LIMIT = {StopReason.BUDGET: "train.budget_s", StopReason.COMPLETED: "train.max_steps",
         StopReason.MAX_STEPS: "train.max_steps"}


def _extends(change: Change, ended: dict) -> bool:
    """Whether `change` gives the finished run `ended` (its summary) more to train: the limit that stopped it
    raised, or lifted (0)."""
    return change.key == LIMIT.get(ended["status"]) and (change.now == 0 or 0 < change.saved < change.now)


def _check_writable(cfg: Config, run_dir: Path) -> None:
    """Refuse, before the first step, a run folder or checkpoint path that a save could not write, or would write
    over a file that is not a checkpoint (a data shard named by mistake)."""
    if taken := _file_in_the_way(run_dir):
        raise ConfigError(f"log.dir = {cfg.log.dir!r}: {taken} is a file, so the run folder {run_dir} cannot be "
                          f"made there; set log.dir to a folder")
    if not (cfg.train.checkpoint_path and cfg.train.save_checkpoint):
        return
    target = checkpoint_path(run_dir, cfg.train.checkpoint_path)
    key = f"train.checkpoint_path = {cfg.train.checkpoint_path!r}"
    if target.is_dir():
        raise ConfigError(f"{key} is a folder; name the file to write, e.g. {target / 'checkpoint.pt'}")
    if taken := _file_in_the_way(target.parent):
        raise ConfigError(f"{key}: {taken} is a file, so no folder can hold the checkpoint there; name another path")
    if target.is_file():
        with open(target, "rb") as f:
            head = f.read(4)
        # torch.save's file, or an empty file put there to hold the name
        if head and not head.startswith(TORCH_HEADS):
            raise ConfigError(f"{key} names a file that is not a checkpoint (a data shard?), which the save "
                              f"would replace; name another path, or move the file away")


def _check_access(cfg: Config, dist: Dist, run_dir: Path) -> None:
    """Refuse a run folder, or a checkpoint path, in a folder this process cannot write (a read-only mount, another
    user's folder): the first save would fail there, after the training it was to keep."""
    paths = {f"log.dir = {cfg.log.dir!r}": run_dir / LOCK}
    if cfg.train.checkpoint_path and cfg.train.save_checkpoint and dist.master:  # rank 0 writes it
        paths[f"train.checkpoint_path = {cfg.train.checkpoint_path!r}"] = checkpoint_path(run_dir,
                                                                                        cfg.train.checkpoint_path)
    for key, path in paths.items():
        if not os.access(folder := existing_folder(path), os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {folder} cannot be written by this process (read-only, or another user's); "
                              f"name a folder it can write")


def _file_in_the_way(folder: Path) -> Path | None:
    """The file, if any, at `folder` or one of the folders above it: a save could not make the folder there."""
    # os.path's: a folder this process may not look into is no file (the access check names it)
    return next((p for p in (folder, *folder.parents) if os.path.exists(p) and not os.path.isdir(p)), None)


def change_lines(train_cfg: TrainConfig, saved_train: dict, clock: Clock, step: int,
                 changes: list[Change]) -> list[str]:
    """The log lines of a resume at `step`: the keys it changed (check_resume allowed them) and, for a budget
    changed from `saved_train`'s, what that does to the LR of the next step (`clock` is the resumed one)."""
    lines = [f"resume: {change}" for change in changes]
    before = replace(train_cfg, budget_s=saved_train["budget_s"], max_steps=saved_train["max_steps"])
    if (before.budget_s, before.max_steps) != (train_cfg.budget_s, train_cfg.max_steps):
        old = Clock(before)
        old.load_state_dict(clock.state_dict())
        now, then = clock.micro_steps(step), old.micro_steps(step)
        rows, rows_then = clock.seq_len(step), old.seq_len(step)
        batch = (f" and {now} micro-steps instead of {then} (train.batch_stages)" if now != then else
                 f" and rows of {rows} tokens instead of {rows_then} (train.batch_stage_rows)" if rows != rows_then
                 else "")
        lines.append(f"resume: --extend-budget: the LR schedule now spans the new budget, so step {step + 1} runs "
                     f"at LR multiplier {clock.lr_mult(step):.3f} instead of {old.lr_mult(step):.3f}{batch} (a "
                     f"decay that had ended rises again); this is not the run the new budget gives from the start")
    return lines


def resume_command(cfg: Config) -> str:
    """The command that resumes this run: this one, with its run id fixed and train.resume back to "auto", run
    from this folder (its paths are relative to it; run.sh works from the checkout) by this Python (torchrun as
    its module: the venv's torchrun need not be on PATH)."""
    args = [a for a in sys.argv[1:] if a != "--overwrite"]
    if not any(a == "--log.run_id" or a.startswith("--log.run_id=") for a in args):
        args.append(f"--log.run_id={cfg.log.run_id}")  # the default id is new each launch
    if cfg.train.resume in ("never", "overwrite"):
        args.append("--train.resume=auto")
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    command = shlex.join([sys.argv[0], *args])
    here, python = f"cd {shlex.quote(os.getcwd())} && ", shlex.quote(sys.executable)
    if world == 1:
        return f"{here}{python} {command}"
    if world == local:
        return f"{here}{python} -m torch.distributed.run --standalone --nproc_per_node={local} {command}"
    return f"the same torchrun command on each node, launching {command}"


def seek_loader(loader: TokenLoader, resumed: dict, run_dir: Path) -> None:
    """Put `loader` where load_resume's state `resumed` left it; data that changed since the save (other files, a
    seed, shuffle or row setting) is a ConfigError."""
    try:
        loader.load_state_dict(resumed["loader"])
    except ValueError as e:
        raise ConfigError(f"{run_dir}: cannot resume: {e}") from None


def restore_run(run: Run, resumed: dict, marker: dict, changes: list[Change]) -> None:
    """Put load_resume's state `resumed` into the freshly built `run` (weights, optimizers, loader, clock, counters)
    and log what this launch changed of the saved config (`marker`'s), as open_run_folder found it."""
    restore(run.model.module, run.optimizers, None, resumed)  # the loader: seek_loader placed it
    run.clock.load_state_dict(resumed["clock"])
    run.progress = Progress(**resumed["progress"])
    run.saved_step = run.progress.step
    run.progress.resume_changes += [{"step": run.progress.step, **c._asdict()} for c in changes]
    for line in change_lines(run.cfg.train, marker["config"]["train"], run.clock, run.progress.step, changes):
        run.log.print(line)
