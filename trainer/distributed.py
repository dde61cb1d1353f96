"""Process-group setup and the few collectives the trainer needs.

torchrun (single node --standalone, or multi-node c10d rendezvous) sets RANK, WORLD_SIZE and LOCAL_RANK;
without them we are a single process and no group is created, unless asked for a group of one (train.ddp_always),
through which every collective of a multi-process run then really runs.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout  # torch >= 2.3: a group's timeout changed


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def master(self) -> bool:
        """True on the rank that writes files and prints."""
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        """True when this rank computes on a GPU."""
        return self.device.type == "cuda"


_store: dist.Store | None = None  # this attempt's rendezvous store once the group exists (first_to_report)


def init(timeout_s: float, group_of_one: bool = False) -> Dist:
    """Join the process group if launched by torchrun (NCCL on GPU, gloo on CPU), or form one of this process
    alone if `group_of_one`; pick this rank's device."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 or group_of_one:
        global _store
        # A finite timeout turns a lost peer into an error instead of a hang until SLURM's wall time.
        timeout = datetime.timedelta(seconds=timeout_s)
        # one process has no peer to meet: an in-process store, with no port to find or to collide on
        _store = _attempt_store(rank, world, timeout) if world > 1 else dist.HashStore()
        kwargs: dict[str, Any] = dict(timeout=timeout, rank=rank, world_size=world, store=_store)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, **kwargs)
        else:
            dist.init_process_group("gloo", **kwargs)
    return Dist(rank, local_rank, world, device)


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this torchrun attempt.

    torchrun shares its own TCPStore with the workers; after a --max-restarts restart the new group could read
    the dead group's addresses from it and fail with "connectFullMesh ... Connection refused". A key prefix per
    restart count keeps each attempt apart.
    """
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun already serves it
    store = dist.TCPStore(host, port, world, is_master=not agent_store and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def first_to_report(kind: str) -> bool:
    """True on the one rank that should print its error of this `kind`, so an error every rank hits prints once.

    Before the process group exists that is rank 0: every rank parses the same command line and files. After,
    it is the first rank to claim the kind in the rendezvous store (kept after close()), so an error of one
    rank alone still prints; if the store is gone, every rank says it rather than none.
    """
    if _store is None:
        return int(os.environ.get("RANK", 0)) == 0
    try:
        _store.set_timeout(datetime.timedelta(seconds=10))
        return _store.add("report/" + hashlib.sha256(kind.encode()).hexdigest(), 1) == 1
    except RuntimeError:  # DistStoreError, DistNetworkError: the store's host (rank 0 without torchrun) has exited
        return True


@contextlib.contextmanager
def timeout(seconds: float, after: float) -> Iterator[None]:
    """Collectives started inside the block wait up to `seconds` for a peer, those after it `after` (the group's
    own timeout); nothing in a single process."""
    if not dist.is_initialized():
        yield
        return
    _set_pg_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        _set_pg_timeout(datetime.timedelta(seconds=after))


# How a collective's error reads when its peer is gone: gloo's broken connection or timeout, NCCL's remote error
PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out waiting",
             "remote process exited")


def peer_gone(error: BaseException) -> str | None:
    """The line a rank says when `error` is a collective that failed because another rank ended or stopped
    answering, whose own message or torchrun's report says why; None for any other error (it keeps its traceback)."""
    text = str(error)
    if int(os.environ.get("WORLD_SIZE", 1)) < 2 or not any(words in text.lower() for words in PEER_GONE):
        return None
    first = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0]  # without gloo's source line and its advice
    return (f"rank {os.environ.get('RANK', 0)} lost another rank, which ended or stopped answering (its own message, "
            f"or torchrun's report, says why): {first}")


def close() -> None:
    """Leave the process group (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce in place with "sum" or "max" (no-op in a single process); return the tensor."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def mean_over_ranks(*values: torch.Tensor) -> list[float]:
    """Each 0-dim tensor's mean over the ranks, on the host: one all-reduce, and a wait for the GPU."""
    total = all_reduce(torch.stack([v.detach().double() for v in values]))
    return (total / (dist.get_world_size() if dist.is_initialized() else 1)).tolist()


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over all ranks (one MAX all-reduce, in float64)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64, device=device), "max").tolist()


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true on every rank if it is true on any rank."""
    return [bool(f) for f in max_over_ranks([float(f) for f in flags], device)]


class LateMax:
    """A MAX all-reduce of a few float64 values every step, whose result the host reads one step later.

    Reading a device result at once waits for all the GPU work queued before it: a per-step exchange read that
    way would stop the host from queueing step N+1 while the GPU runs step N. So `start` sends host values up
    from a pinned buffer (a non-blocking copy) next to values already on the device, all-reduces them, copies
    the result back into another pinned buffer and records an event; `collect`, called after the host has
    queued the next step, waits on that event, which the GPU passed while the host was queueing. On CPU (gloo)
    each call runs synchronously: the result is there when `start` returns, and collecting it at once is free.
    One exchange at a time: collect the pending one before starting the next (the buffers are reused).
    """

    def __init__(self, host_size: int, device_size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host_size = host_size
        self._send = torch.zeros(host_size, dtype=torch.float64, pin_memory=cuda)
        self._recv = torch.zeros(host_size + device_size, dtype=torch.float64, pin_memory=cuda)
        self._buf = torch.zeros(host_size + device_size, dtype=torch.float64, device=device)
        self._event = torch.cuda.Event() if cuda else None
        self._pending = False

    def start(self, host_values: list[float], device_values: torch.Tensor) -> None:
        """Begin the all-reduce of host_values followed by device_values (a float64 vector on the device)."""
        assert not self._pending, "LateMax.start: collect() the pending exchange first"
        self._send.copy_(torch.tensor(host_values, dtype=torch.float64))
        self._buf[:self.host_size].copy_(self._send, non_blocking=True)
        self._buf[self.host_size:].copy_(device_values)
        all_reduce(self._buf, "max")
        self._recv.copy_(self._buf, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True

    def collect(self) -> list[float] | None:
        """The result of the exchange started last, waiting for it if needed; None if none is pending."""
        if not self._pending:
            return None
        if self._event is not None:
            self._event.synchronize()
        self._pending = False
        return self._recv.tolist()


def broadcast(obj: Any) -> Any:
    """Rank 0's value of a picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()
