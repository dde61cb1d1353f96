"""Muon: Nesterov momentum orthogonalised by a quintic Newton-Schulz iteration, for hidden 2-D matrices.

Update of a matrix W (rows x cols) with gradient G, momentum buffer B, rate lr:
    B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum)        (Nesterov)
    W <- W * (1 - lr * weight_decay) - lr * scale * NS(U)
NS(U) ~ the orthogonal factor of U's SVD, so every singular value of the update is about 1 and its RMS is about
1 / sqrt(max(rows, cols)). `adjust_lr` picks `scale` (the same rules as torch.optim.Muon):
    "original":        sqrt(max(1, rows / cols))  (Keller Jordan's rule: tall matrices get a larger step)
    "match_rms_adamw": 0.2 * sqrt(max(rows, cols)) (Moonshot's: update RMS ~ 0.2, like AdamW, so AdamW's lr fits)

The mode comes from the parameters: plain tensors in one process; plain tensors in a distributed run are DDP
replicas (identical gradients), and rank i % world orthogonalises matrix i and broadcasts the result; DTensors
sharded on dim 0 (FSDP2) are gathered only on their owner rank, orthogonalised there, and each rank receives
its shard back. Results travel in the precision Newton-Schulz works in (`ns_dtype`: bf16 on CUDA).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.5 kept DTensor under _tensor
    from torch.distributed._tensor import DTensor, Shard

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic chosen to maximise the slope at 0 (Keller Jordan, 2024)


def ns_dtype(device: torch.device) -> torch.dtype:
    """The precision Newton-Schulz runs (and results travel) in: bf16 on CUDA, fp32 on CPUs, where bf16 matmuls
    are emulated (measured 4x slower than fp32 on this project's 2-core Xeon)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None) -> Tensor:
    """Approximately orthogonalise a matrix (a random one ends with singular values in ~[0.67, 1.14] in bf16),
    in `dtype` (default: ns_dtype of its device)."""
    a, b, c = NS_COEFFS
    x = g.to(dtype or ns_dtype(g.device))
    wide = x.size(0) <= x.size(1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    # Frobenius norm >= spectral norm, so every singular value starts in (0, 1], where the iteration converges.
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        # addmm rounds to bf16 once per product-and-sum: max error vs fp64 measured 0.009 instead of 0.023.
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return (x if wide else x.mT).contiguous()


def lr_scale(shape: torch.Size, rule: str) -> float:
    """Multiplier of the learning rate for a matrix of this (global) shape; see the module docstring."""
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    raise ValueError(f"Muon adjust_lr={rule!r}; use 'original' or 'match_rms_adamw'")


def _local(t: Tensor) -> Tensor:
    """The tensor this rank holds (a DTensor's local shard shares its storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _orthogonalize_replicated(updates: list[Tensor], steps: int, dtype: torch.dtype) -> list[Tensor]:
    """DDP: rank i % world orthogonalises matrix i and broadcasts it, so every rank ends with all results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, works = [], []
    for i, u in enumerate(updates):
        owner = i % world
        o = newton_schulz(u, steps, dtype=dtype) if owner == rank else torch.empty(u.shape, dtype=dtype, device=u.device)
        works.append(dist.broadcast(o, src=owner, async_op=True))
        out.append(o)
    for w in works:
        w.wait()
    return out


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """t with zero rows appended up to `rows` (collectives need equal shard sizes), contiguous."""
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])]) if t.size(0) < rows else t.contiguous()


def _orthogonalize_sharded(params: list[DTensor], updates: list[Tensor], steps: int,
                           dtype: torch.dtype) -> list[Tensor]:
    """FSDP2: gather matrix i on rank i % world only, orthogonalise it there, scatter the row shards back."""
    mesh = params[0].device_mesh
    if mesh.ndim != 1 or any(p.placements != (Shard(0),) for p in params):
        raise ValueError("Muon supports DTensor parameters sharded on dim 0 over a 1-D mesh (FSDP2 fully_shard); "
                         f"got placements {params[0].placements} on a {mesh.ndim}-D mesh")
    group = mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # FSDP2 shards like torch.chunk: ceil(rows / world) rows per rank, the last ranks fewer (or none).
    chunks = [-(-p.shape[0] // world) for p in params]
    gathered, works = [], []
    for i, (u, c) in enumerate(zip(updates, chunks)):
        owner = i % world
        parts = [u.new_empty(c, u.size(1), dtype=dtype) for _ in range(world)] if owner == rank else None
        works.append(dist.gather(_pad_rows(u.to(dtype), c), parts, dst=dist.get_global_rank(group, owner),
                                 group=group, async_op=True))
        gathered.append(parts)
    out, scatters = [], []
    for i, (p, u, c) in enumerate(zip(params, updates, chunks)):
        owner, parts = i % world, None
        if owner == rank:
            works[i].wait()
            o = newton_schulz(torch.cat(gathered[i])[:p.shape[0]], steps, dtype=dtype)
            parts = list(_pad_rows(o, c * world).split(c))
        shard = u.new_empty(c, u.size(1), dtype=dtype)
        scatters.append(dist.scatter(shard, parts, src=dist.get_global_rank(group, owner), group=group,
                                     async_op=True))
        out.append(shard[:u.size(0)])
    for w in works + scatters:
        w.wait()
    return out


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (plain, DDP replicas or FSDP2 shards); state: one momentum buffer per matrix."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, adjust_lr: str = "original", ns_dtype: torch.dtype | None = None):
        lr_scale((1, 1), adjust_lr)  # reject an unknown rule now, not at the first step
        self.ns_dtype = ns_dtype  # None: ns_dtype(device) of the parameters
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                                      adjust_lr=adjust_lr))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}; "
                                     "give embeddings, norms and biases to AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every matrix that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = [self._nesterov(p, group["momentum"]) for p in params]
            dtype = self.ns_dtype or ns_dtype(params[0].device)
            for p, o in zip(params, _orthogonalize(params, updates, group["ns_steps"], dtype)):
                w = _local(p)
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(o.to(w.dtype), alpha=-group["lr"] * lr_scale(p.shape, group["adjust_lr"]))
        return loss

    def _nesterov(self, p: Tensor, momentum: float) -> Tensor:
        """Advance p's momentum buffer and return the Nesterov update (this rank's part of it)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf, g = _local(state["momentum_buffer"]), _local(p.grad)
        buf.lerp_(g, 1 - momentum)
        return g.lerp(buf, momentum)


def _orthogonalize(params: list[Tensor], updates: list[Tensor], steps: int, dtype: torch.dtype) -> list[Tensor]:
    """NS of every update, shared out across ranks according to how the parameters are distributed."""
    sharded = [isinstance(p, DTensor) for p in params]
    if any(sharded):
        if not all(sharded):
            raise ValueError("Muon: a param group mixes DTensor (FSDP2) and plain parameters; shard all or none")
        return _orthogonalize_sharded(params, updates, steps, dtype)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _orthogonalize_replicated(updates, steps, dtype)
    return [newton_schulz(u, steps, dtype=dtype) for u in updates]
