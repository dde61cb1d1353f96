"""checkpoint.pt (the evaluation contract) and the resume state, both written atomically.

checkpoint.pt = {"config": plain dict, "model": full state dict on CPU, "step": int}; it loads with
torch.load(path, weights_only=True) and get_model(ckpt["config"]).load_state_dict(ckpt["model"]), which is
what load_checkpoint does.

Resume state lives in <run>/resume/: each save goes to a new folder step<N>/ holding one rank<r>.pt per
rank (loader, clock, RNG; model, optimizer and the gradients held for a later AdamW step (optim.adam_every):
under FSDP2 each rank's shard, under DDP in rank0.pt only, but for the held gradients each rank adds up on its own
under train.adam_sync = "adam_steps", which every rank writes).
After a barrier rank 0 points resume/done.json at it and only then deletes older folders, so a crash
mid-save leaves the previous complete state in use. done.json also holds the config the state was saved
under: a resume compares the new config with it before anything in the run folder changes (trainer/runs.py
reads the marker).
"""
from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor  # imported also to register it: weights_only loads of FSDP2 shards

from data.loader import TokenLoader
from model import get_model
from optim.groups import adamw_params
from trainer import distributed
from trainer.config import ConfigError
from trainer.distributed import Dist
from trainer.runs import RUN_FILES, done_path, read_marker
from util.atomic import atomic_path, existing_folder, write_json

if TYPE_CHECKING:
    from trainer.state import Run


# what every rank holds alike under DDP, so that only rank 0 saves it
REPLICATED = ("model", "optim", "grads")
# how a file torch.save wrote begins: its zip archive, or its older pickle (protocol 2)
TORCH_HEADS = (b"PK\x03\x04", b"\x80\x02")


class CheckpointError(ValueError):
    """A checkpoint.pt that cannot be loaded; the message says which file and why."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nested dict/list/tuple (this rank's shard of a DTensor)."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif isinstance(obj, torch.Tensor):
        yield _local(obj)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in `obj`: what torch.save writes of it, but for a small index."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(obj)}.values())


def _save(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` atomically, through a Python file: a full disk then raises ENOSPC, which
    atomic_path reports (torch's own file writer says only "unexpected pos ..." or "iostream error")."""
    with atomic_path(path, size=tensor_bytes(obj)) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def save_checkpoint(path: str | Path, config: dict, model_state: dict, step: int) -> None:
    """Write checkpoint.pt atomically (call on rank 0 only)."""
    _save({"config": config, "model": model_state, "step": step}, Path(path))


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[nn.Module, dict]:
    """The GPT of a checkpoint.pt (eval mode, on `device`) and the checkpoint's run config."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint; pass runs/<run_id>/checkpoint.pt")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file; all mean "not loadable"
        if (why := _unreadable(path, e)) is None:
            raise
        raise CheckpointError(f"{path}: cannot be loaded as a checkpoint: {why}; copy it again from its run, or pass "
                              f"the run's own runs/<run_id>/checkpoint.pt") from None
    if not isinstance(ckpt, dict) or not {"config", "model"} <= ckpt.keys():
        got = f"keys {sorted(ckpt)}" if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: expected a dict with keys 'config' and 'model' (train.py's checkpoint.pt), "
                              f"got {got}")
    try:
        model = get_model(ckpt["config"])
        model.load_state_dict(ckpt["model"])
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: its config and weights do not make a model: {str(e)[:300]}") from None
    return model.to(device).eval(), ckpt["config"]


def _unreadable(path: Path, error: Exception) -> str | None:
    """Why torch.load could not read the file `path` (it raised `error`), in words: torch's own text is a pickle
    key, a zip library's internals or advice to load with weights_only=False, which runs the file's code. None
    where the file is not at fault (memory ran out as it loaded): the caller raises `error` as it is."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if not head:
        return "it is empty"
    if not head.startswith(TORCH_HEADS):
        return "it is not a file torch.save wrote"
    if head == TORCH_HEADS[0] and not zipfile.is_zipfile(path):  # the archive's index, written last, is missing
        return "it is incomplete (a copy cut short, or a save still being written)"
    if isinstance(error, pickle.UnpicklingError):
        return "it holds more than tensors and plain values"
    return f"torch cannot read it ({(str(error).splitlines() or [type(error).__name__])[0]})"


def rng_state() -> dict[str, torch.Tensor | None]:
    """This process's torch RNG states."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def training_state(module: nn.Module, optimizers: list[torch.optim.Optimizer], loader: TokenLoader,
                   own: Collection[nn.Parameter] = ()) -> dict[str, Any]:
    """The plain `module` (this rank's shard under FSDP2), the optimizers, the gradients the module holds between
    steps (AdamW's under optim.adam_every: "grads", or "own_grads" for the parameters in `own`, whose gradients
    each rank holds as its own: ParallelModel.apart), the loader and the RNG: what warm-up and resume restore."""
    # copies: a DDP gradient is a view of its bucket, whose whole storage torch.save would write
    ids, grads, own_grads = {id(p) for p in own}, {}, {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            (own_grads if id(p) in ids else grads)[name] = _local(p.grad).clone()
    return {"model": module.state_dict(), "optim": [o.state_dict() for o in optimizers], "grads": grads,
            "own_grads": own_grads, "loader": loader.state_dict(), "rng": rng_state()}


def restore(module: nn.Module, optimizers: list[torch.optim.Optimizer], loader: TokenLoader | None,
            state: dict[str, Any]) -> None:
    """Put the module, optimizers, held gradients (none for the others), loader (None: left where it is) and RNG
    back to a saved training_state."""
    module.load_state_dict(state["model"])
    # a state saved before gradients were held across steps holds none, one saved before own_grads no own ones
    grads = {**state.get("grads", {}), **state.get("own_grads", {})}
    for name, p in module.named_parameters():
        p.grad = None
        if name in grads:
            p.grad = torch.zeros_like(p)  # a DTensor like p under FSDP2
            _local(p.grad).copy_(grads[name])
    for opt, s in zip(optimizers, state["optim"]):
        built = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(s)
        # a state saved before a group setting existed: the setting as this run built it (a new key's default)
        for group, settings in zip(opt.param_groups, built):
            for key, value in settings.items():
                group.setdefault(key, value)
    if loader is not None:
        loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"]["cpu"].cpu())
    if state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())


def save_resume(run_dir: Path, dist: Dist, step: int, state: dict[str, Any], config: dict, *, replicated: bool) -> None:
    """Save this rank's resume state for `step` under `config`; mark it complete once every rank has written
    (all ranks call). `replicated`: every rank holds the same model and optimizer state (DDP), so only rank 0
    writes them and load_resume hands them to the others."""
    if replicated and not dist.master:
        # 32 copies of the hackathon model's 2 GB would be 69 GB on a shared disk at the end of the run
        state = {k: v for k, v in state.items() if k not in REPLICATED}
    done, folder = done_path(run_dir), f"step{step:07d}"
    root = done.parent
    if dist.master and done.exists():
        # what a save that failed on some rank left (its other ranks' files): space the new state needs
        _remove_steps(root, keep={folder, json.loads(done.read_text())["dir"]})
    _save(state, root / folder / f"rank{dist.rank}.pt")
    distributed.barrier()
    if dist.master:
        write_json(done, {"dir": folder, "step": step, "world_size": dist.world_size, "config": config})
        _remove_steps(root, keep={folder})
    distributed.barrier()


def record_end(run_dir: Path, dist: Dist, step: int, ended: dict[str, Any]) -> None:
    """Rank 0 adds `ended` to done.json where its state is the run's last, at `step`: the progress and metrics.jsonl's
    length after the final eval, which came after the save; a resume from that state takes them for the state's."""
    done = done_path(run_dir)
    if dist.master and done.exists() and (marker := json.loads(done.read_text()))["step"] == step:
        write_json(done, {**marker, "ended": ended})


def _remove_steps(root: Path, keep: set[str]) -> None:
    """Delete the step folders under resume/ but those named in `keep`."""
    for old in root.glob("step*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def save_space(files: list[tuple[Path, int]], saves: int) -> dict[Path, int]:
    """The free bytes `saves` saves need on each filesystem (named by the first of its folders in `files`): the
    most that `files` ((path, bytes) in the order a save writes them) hold there at once, less what their copies
    on disk already hold.

    A file's old copy stays until its new one is complete (atomic_path; save_resume deletes the old step folder
    after done.json), so the disk holds every file once and the one being written twice: from the first save
    for a file already on disk, from the second for the others."""
    held = {path: size if path.exists() else 0 for path, size in files}
    folders = {path: existing_folder(path) for path in held}
    device = {path: folders[path].stat().st_dev for path in held}

    def on(dev: int) -> int:
        return sum(size for path, size in held.items() if device[path] == dev)

    before = {dev: on(dev) for dev in device.values()}
    peak = dict(before)
    for _ in range(min(saves, 2)):  # a third save holds what the second did
        for path, size in files:
            peak[device[path]] = max(peak[device[path]], on(device[path]) + size)
            held[path] = size
    named: dict[int, Path] = {}
    for path, dev in device.items():
        named.setdefault(dev, folders[path])
    return {named[dev]: peak[dev] - before[dev] for dev in peak}


def run_files(run_dir: Path, dist: Dist) -> list[str]:
    """The RUN_FILES that `run_dir` holds, as rank 0 sees them; every rank gets the same."""
    return distributed.broadcast([name for name in RUN_FILES if (run_dir / name).exists()] if dist.master else None)


def remove_run(run_dir: Path, dist: Dist) -> None:
    """Delete the RUN_FILES of `run_dir` (rank 0), so that nothing of the old run is resumed or appended to."""
    if dist.master:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    distributed.barrier()


def resume_marker(run_dir: Path, dist: Dist) -> dict[str, Any] | None:
    """done.json of the run's last complete resume state as rank 0 reads it (None if there is none), its
    "config" being the config the state was saved under and "finished" the run's summary if the run ended
    there (else None); every rank gets the same."""
    # rank 0's view, so all ranks resume from the same step or none does (a stale or node-local copy elsewhere
    # would put the ranks' collectives out of step)
    try:
        return distributed.broadcast(read_marker(run_dir) if dist.master else None)
    except ValueError as e:  # done.json or summary.json written over by hand, or damaged on disk
        raise ConfigError(f"{run_dir}: its resume marker cannot be read ({str(e)[:200]}); start a new log.run_id, "
                          f"or train this one from the start with --overwrite") from None


def load_resume(run_dir: Path, dist: Dist, marker: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the resume state that `marker` (resume_marker's answer) names; a ConfigError where the
    state was saved by another number of ranks, or cannot be read."""
    done = done_path(run_dir)
    if marker["world_size"] != dist.world_size:  # checked here, not before: a finished run says it finished
        raise ConfigError(f"{done}: the run was saved with world size {marker['world_size']}, this one has "
                          f"world size {dist.world_size}; resume with the same world size or start a new log.run_id")
    folder = done.parent / marker["dir"]
    if not (folder / f"rank{dist.rank}.pt").exists():
        raise ConfigError(f"{folder / f'rank{dist.rank}.pt'} is missing, though rank 0 resumes from "
                          f"{done_path(run_dir)}: every node must see the same log.dir (a shared "
                          f"filesystem); or start a new log.run_id")
    state = _load_state(folder / f"rank{dist.rank}.pt", dist)
    if dist.rank and not {"model", "optim"} <= state.keys():  # a replica: save_resume left them to rank 0
        state.update({k: v for k, v in _load_state(folder / "rank0.pt", dist).items() if k in REPLICATED})
    # the state is the run's end, and its final eval, after the save, was done: its row and counters (a run
    # trained on; or one killed before it wrote summary.json, whose finish then takes that eval as done)
    state.update(marker.get("ended", {}))
    return state


def _load_state(path: Path, dist: Dist) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location=dist.device)
    except Exception as e:  # noqa: BLE001 - cut short or damaged since done.json named it
        if (why := _unreadable(path, e)) is None:
            raise
        raise ConfigError(f"{path}: this resume state cannot be read ({why}); start a new log.run_id, or train this "
                          f"one from the start with --overwrite") from None


def warn_if_the_saves_do_not_fit(run: Run) -> None:
    """Rank 0 warns before the first step where the free space is short of what the run's saves will hold at
    their peak: checkpoint.pt holds the model's state dict, the resume state that, at most two optimizer moments
    per parameter (AdamW's) and AdamW's held gradients (optim.adam_every), and each file's old copy stays until its
    new one is complete."""
    if not (run.dist.master and run.cfg.train.save_checkpoint):
        return
    # full sizes, also of DTensor shards; a tied head counts twice, as checkpoint.pt's CPU copies store it
    model = sum(v.numel() * v.element_size() for v in run.model.module.state_dict().values())
    moments = 2 * sum(p.numel() * p.element_size() for p in run.model.module.parameters())
    held = 0
    if run.cfg.optim.adam_every > 1:  # AdamW's gradients between its steps: every rank's own under train.adam_sync
        held = sum(p.numel() * p.element_size() for p in adamw_params(run.model.module, run.cfg.optim))
        held *= run.dist.world_size if run.model.apart else 1
    # in the order save() writes them; the resume state is on disk where its done.json is
    files = [(run.checkpoint_path, model), (done_path(run.run_dir), model + moments + held)]
    every, budget = run.cfg.train.checkpoint_every_s, run.cfg.train.budget_s
    # periodic saves, then the final one; a time budget that ends before the first periodic save leaves only the
    # final one (evals off the clock can stretch the wall time that periodic saves follow: then one more comes)
    saves = 2 if every > 0 and not 0 < budget <= every else 1
    first = save_space(files, 1)
    for folder, need in save_space(files, saves).items():
        free = shutil.disk_usage(folder).free
        if free < need:
            which = "first" if free < first[folder] else "second"
            run.log.print(f"warning: {folder} has {free:,} bytes free, but the run's saves need about {need:,} "
                          f"there (checkpoint.pt: the model's {model:,} bytes; the resume state: those, "
                          f"{moments:,} of optimizer moments and {held:,} of held gradients; each file's old copy "
                          f"stays until its new one is complete); its {which} save will fail: free space or move "
                          f"log.dir / train.checkpoint_path")
