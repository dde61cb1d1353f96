"""Muon: Nesterov momentum orthogonalised by a quintic Newton-Schulz iteration, for hidden 2-D matrices.

Update of a matrix W (rows x cols) with gradient G, momentum buffer B, rate lr:
    B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum)        (Nesterov)
    W <- W * (1 - lr * weight_decay) - lr * scale * NS(U)
(`wd_lr_squared`: the decay is lr * weight_decay * lr / initial_lr, so it falls with the rate squared, as record
46's; at the base rate the same.)
Options of the newer speedrun records, each off by default: Polar Express's per-step quintics in place of the
fixed one (`ns_coefficients`), cautious decay (only where U and W share a sign) and NorMuon (optim/normuon.py).
NS(U) ~ the orthogonal factor of U's SVD, so every singular value of the update is about 1 and its RMS is about
1 / sqrt(max(rows, cols)). `adjust_lr` picks `scale` (the first two are torch.optim.Muon's rules):
    "original":        sqrt(max(1, rows / cols))  (Keller Jordan's rule: tall matrices get a larger step)
    "match_rms_adamw": 0.2 * sqrt(max(rows, cols)) (Moonshot's: update RMS ~ 0.2, like AdamW, so AdamW's lr fits)
    "none":            1 (the records from 2025-07-18 on store the MLP's fc wide, so "original" gives it 1 too)

A param group's `split` (default 1; optim/views.py) says which matrices a parameter fuses along its rows: the
GPT's qkv weight [3d, d] is split=3, so Q, K and V are orthogonalised as three [d, d] views (as the speedrun
records do) with the [d, d] scale, while the parameter stays one tensor for one matmul in the forward pass. A
tuple of row counts gives views of several sizes (optim.muon_qk_pairs), each with the scale of its own shape.

Work is shared out by cost: each matrix costs its Newton-Schulz flops, and a greedy longest-first assignment
gives it to the least-loaded rank (the same plan on every rank). Same-shape matrices go through one batched
Newton-Schulz call and one collective. The mode comes from the parameters:
    plain tensors, one process:  every view, batched by shape;
    plain tensors, distributed:  DDP replicas (identical gradients; any process group, even of one): the views
                                 are assigned, each rank orthogonalises its share and one all_gather per view
                                 shape shares the results;
    DTensors sharded on dim 0:   FSDP2: whole parameters are assigned; one all_to_all per parameter shape brings
                                 each parameter's row shards to its owner, which splits it into views, and one
                                 more sends each rank its rows of the result.
Results travel in the precision Newton-Schulz works in (`ns_dtype`: bf16 on CUDA).
With `compile` (optim.muon_compile) the math between the collectives runs under torch.compile (optim/compiled.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch.distributed.tensor import DTensor, Shard

from optim.compiled import chosen
from optim.normuon import moment_size, normalize
from optim.quintics import quintics
from optim.symmetric import saves, unavailable
from optim.views import Split, blocks, view_rows

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

NS_EPS = 1e-7  # added to the starting norm, so that a zero update stays zero
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the same arguments; the old name warns there).
# Looked up on torch.distributed at each call, by name, so the tests' recorder sees it.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def ns_dtype(device: torch.device) -> torch.dtype:
    """The precision Newton-Schulz runs (and results travel) in: bf16 on CUDA, fp32 on CPUs, where bf16 matmuls
    are emulated, several times slower than fp32."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Iteration(NamedTuple):
    """How a group's updates are orthogonalised: the number of steps, whose quintic coefficients, whether the
    two symmetric products go to optim/symmetric.py's kernel, and the eps added to the starting norm."""
    steps: int = 5
    coefficients: str = "newton_schulz"  # or "polar_express"
    symmetric: bool = False
    eps: float = NS_EPS


def newton_schulz(g: Tensor, steps: int = 5, coefficients: str = "newton_schulz", symmetric: bool = False,
                  eps: float = NS_EPS, dtype: torch.dtype | None = None) -> Tensor:
    """Approximately orthogonalise a matrix, or each matrix of a [..., rows, cols] stack (a random one ends with
    singular values in ~[0.67, 1.14] in bf16), in `dtype` (default: ns_dtype of its device), by the quintic
    iteration X <- a X + (b A + c A^2) X, A = X X^T, with `coefficients`' (a, b, c) per step; `symmetric`: A and
    b A + c A^2 by optim/symmetric.py's kernel, which leaves out the tiles below the diagonal (where it saves any)."""
    safety, schedule = quintics(coefficients, steps)
    x = g.to(dtype or ns_dtype(g.device)).reshape(-1, *g.shape[-2:])
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    # Frobenius norm >= spectral norm, so every singular value starts in (0, 1], where the iteration converges.
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * safety + eps)
    symmetric = symmetric and saves(x.size(-2))
    for a, b, c in schedule:
        if symmetric:  # A A^T = A^2: A is symmetric
            gram = torch.ops.shardrun.symmetric_product(x, 1.0, None, 0.0)
            poly = torch.ops.shardrun.symmetric_product(gram, c, gram, b)
        else:
            gram = x @ x.mT
            # addmm rounds to bf16 once per product-and-sum, not once per product and once per sum, a smaller error
            # against fp64; baddbmm is its batched form (the kernel rounds once too).
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return (x if wide else x.mT).contiguous().view(g.shape)


NewtonSchulz = Callable[..., Tensor]  # newton_schulz itself, or compiled (optim/compiled.py)


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul flops of newton_schulz on one rows x cols matrix: per step, Gram m x n x m, its square, and the
    product with x (m = the smaller side)."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m ** 3)


def lr_scale(shape: torch.Size | tuple[int, int], rule: str) -> float:
    """Multiplier of the learning rate for a matrix of this (global, per-view) shape; see the module docstring."""
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    if rule == "none":
        return 1.0
    raise ValueError(f"Muon adjust_lr={rule!r}; use 'original', 'match_rms_adamw' or 'none'")


def assign(costs: list[int], world: int) -> list[int]:
    """Owner rank of each job: costliest first (ties: lower index), each to the least-loaded rank (ties: lower
    rank). Longest-processing-time greedy; deterministic, so every rank computes the same plan."""
    loads, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(world), key=loads.__getitem__)
        loads[owners[i]] += costs[i]
    return owners


def _local(t: Tensor) -> Tensor:
    """The tensor this rank holds (a DTensor's local shard shares its storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _row_offset(p: Tensor) -> int:
    """The first row of p that this rank holds: FSDP2 shards like torch.chunk, ceil(rows / world) rows a rank."""
    if not isinstance(p, DTensor):
        return 0
    mesh = p.device_mesh
    return min(mesh.get_local_rank() * -(-p.shape[0] // mesh.size()), p.shape[0])


def _views(u: Tensor, split: Split) -> list[Tensor]:
    """The matrices fused in u: a [count, rows, cols] stack per Block of `split` (views, no copy)."""
    return [u[b.start:b.stop].view(b.count, b.rows, u.size(1)) for b in blocks(u.shape, split)]


def _joined(stacks: list[Tensor], shape: torch.Size) -> Tensor:
    """The [rows, cols] matrix that a parameter's result stacks make, in row order."""
    return stacks[0].reshape(shape) if len(stacks) == 1 else torch.cat([s.flatten(0, 1) for s in stacks])


def _rate_scales(p: Tensor, split: Split, rule: str) -> list[tuple[slice, float]]:
    """(rows of this rank's part of p, lr_scale of their views), neighbouring views of one scale together: all
    the rows at once unless views of several shapes scale differently."""
    start, held, out = _row_offset(p), _local(p).size(0), []
    for b in blocks(p.shape, split):
        scale = lr_scale((b.rows, p.shape[1]), rule)
        lo, hi = max(b.start, start) - start, min(b.stop, start + held) - start
        if hi <= lo:
            continue
        if out and out[-1][1] == scale:
            lo = out.pop()[0].start
        out.append((slice(lo, hi), scale))
    return out


def _wide(v: Tensor) -> Tensor:
    """v, or v transposed if it is tall: newton_schulz iterates on the wide form anyway, so [n, d] and [d, n]
    matrices share a batch (the MLP's fc and proj)."""
    return v if v.size(-2) <= v.size(-1) else v.mT


def _shaped(o: Tensor, like: Tensor) -> Tensor:
    """A wide result o back in the orientation of `like`, the matrix it came from."""
    return o if o.shape[-2:] == like.shape[-2:] else o.mT


def _batched(views: list[Tensor], iterations: list[Iteration], dtype: torch.dtype,
             iterate: NewtonSchulz) -> list[Tensor]:
    """iterate (newton_schulz, eager or compiled) of every [k, rows, cols] stack, all stacks of one wide shape and
    iteration in one call."""
    buckets = defaultdict(list)
    for i, (v, s) in enumerate(zip(views, iterations)):
        buckets[(*_wide(v).shape[-2:], s)].append(i)
    out = [None] * len(views)
    for (*_, s), idx in buckets.items():
        done = iterate(torch.cat([_wide(views[i]) for i in idx]), *s, dtype=dtype)
        for i, o in zip(idx, done.split([views[i].size(0) for i in idx])):
            out[i] = _shaped(o, views[i])
    return out


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """t with zero rows appended up to `rows` (collectives need equal shard sizes), contiguous."""
    return torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])]) if t.size(0) < rows else t.contiguous()


def _orthogonalize_local(updates: list[Tensor], splits: list[Split], iterations: list[Iteration],
                         dtype: torch.dtype, iterate: NewtonSchulz) -> list[Tensor]:
    """Every view of every update here, batched by shape across them all; each result [rows, cols]."""
    stacks = [_views(u, k) for u, k in zip(updates, splits)]
    done = iter(_batched([s for ss in stacks for s in ss], [it for ss, it in zip(stacks, iterations) for _ in ss],
                         dtype, iterate))
    return [_joined([next(done) for _ in ss], u.shape) for u, ss in zip(updates, stacks)]


def _orthogonalize_replicated(updates: list[Tensor], splits: list[Split], iterations: list[Iteration],
                              dtype: torch.dtype, iterate: NewtonSchulz) -> list[Tensor]:
    """DDP: each view goes to one rank by cost; per wide shape, each rank orthogonalises its share in one call and
    one all_gather gives every rank all the results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [len(view_rows(u.shape, k)) for u, k in zip(updates, splits)]
    views = [v for u, k in zip(updates, splits) for stack in _views(u, k) for v in stack]
    view_its = [s for n, s in zip(counts, iterations) for _ in range(n)]
    owners = assign([ns_flops(*v.shape, s.steps) for v, s in zip(views, view_its)], world)
    buckets = defaultdict(list)
    for n, (v, s) in enumerate(zip(views, view_its)):
        buckets[(*_wide(v).shape, s)].append(n)
    pending = []
    for (rows, cols, s), ns in buckets.items():
        mine = [n for n in ns if owners[n] == rank]
        slots = max(sum(owners[n] == r for n in ns) for r in range(world))  # all_gather sends equal sizes
        send = views[0].new_zeros(slots, rows, cols, dtype=dtype)
        if mine:
            send[:len(mine)] = iterate(torch.stack([_wide(views[n]) for n in mine]), *s, dtype=dtype)
        recv = send.new_empty(world * slots, rows, cols)  # gloo takes the concatenated form only, not [world, ...]
        pending.append((getattr(dist, ALL_GATHER)(recv, send, async_op=True), recv.view(world, slots, rows, cols),
                        ns))
    done = [None] * len(views)
    for work, recv, ns in pending:
        work.wait()
        seen = [0] * world
        for n in ns:  # each rank's results arrive in the order of its views in the bucket
            r = owners[n]
            done[n], seen[r] = _shaped(recv[r, seen[r]], views[n]), seen[r] + 1
    out, n = [], 0
    for k in counts:
        out.append(torch.cat(done[n:n + k]))
        n += k
    return out


def _to_owners(params: list[DTensor], updates: list[Tensor], owners: list[int], group, dtype: torch.dtype):
    """Per parameter shape, one async all_to_all that brings every row shard to the parameter's owner.
    Returns [(work, received [world * mine, chunk, cols], the bucket's parameters by owner, mine, counts)]."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    buckets = defaultdict(list)
    for i, p in enumerate(params):
        buckets[tuple(p.shape)].append(i)
    sends = []
    for (rows, cols), idx in buckets.items():
        idx.sort(key=owners.__getitem__)  # all_to_all_single sends its input to rank 0 first, then 1, ...
        mine = [i for i in idx if owners[i] == rank]
        # FSDP2 shards like torch.chunk: ceil(rows / world) rows per rank, the last ranks fewer (or none).
        chunk = -(-rows // world)
        send = torch.stack([_pad_rows(updates[i].to(dtype), chunk) for i in idx])
        recv = send.new_empty(world * len(mine), chunk, cols)
        counts = [sum(owners[i] == r for i in idx) for r in range(world)]
        work = dist.all_to_all_single(recv, send, [len(mine)] * world, counts, group=group, async_op=True)
        sends.append((work, recv, idx, mine, counts))
    return sends


def _orthogonalize_sharded(params: list[DTensor], updates: list[Tensor], splits: list[Split],
                           iterations: list[Iteration], dtype: torch.dtype, iterate: NewtonSchulz) -> list[Tensor]:
    """FSDP2: each parameter goes to one rank by cost; per parameter shape, one all_to_all brings the row shards
    of each to its owner, the owner splits and orthogonalises them, and one all_to_all sends the rows back."""
    mesh = params[0].device_mesh
    if mesh.ndim != 1 or any(p.placements != (Shard(0),) for p in params):
        raise ValueError("Muon supports DTensor parameters sharded on dim 0 over a 1-D mesh (FSDP2 fully_shard); "
                         f"got placements {params[0].placements} on a {mesh.ndim}-D mesh")
    group = mesh.get_group()
    world = dist.get_world_size(group)
    owners = assign([sum(b.count * ns_flops(b.rows, p.shape[1], it.steps) for b in blocks(p.shape, k))
                     for p, k, it in zip(params, splits, iterations)], world)
    sends, full = _to_owners(params, updates, owners, group, dtype), {}
    for work, recv, _, mine, _ in sends:
        work.wait()
        parts = recv.view(world, len(mine), *recv.shape[1:])  # [source rank, parameter, rows, cols]
        for j, i in enumerate(mine):
            full[i] = parts[:, j].flatten(0, 1)[:params[i].shape[0]]
    done = dict(zip(full, _orthogonalize_local(list(full.values()), [splits[i] for i in full],
                                               [iterations[i] for i in full], dtype, iterate)))
    backs = []
    for _, recv, idx, mine, counts in sends:
        chunk, cols = recv.shape[1:]
        rows = recv.new_zeros(len(mine), world * chunk, cols)
        for j, i in enumerate(mine):
            rows[j, :params[i].shape[0]] = done[i]
        # [parameter, rank, chunk, cols] -> [rank, parameter, chunk, cols]: what each rank gets, together
        send = rows.view(len(mine), world, chunk, cols).transpose(0, 1).reshape(-1, chunk, cols)
        back = send.new_empty(len(idx), chunk, cols)
        backs.append((dist.all_to_all_single(back, send, counts, [len(mine)] * world, group=group, async_op=True),
                      back, idx))
    out = [None] * len(params)
    for work, back, idx in backs:
        work.wait()
        for pos, i in enumerate(idx):
            out[i] = back[pos, :updates[i].size(0)]
    return out


def _orthogonalize(params: list[Tensor], updates: list[Tensor], splits: list[Split], iterations: list[Iteration],
                   dtype: torch.dtype, iterate: NewtonSchulz) -> list[Tensor]:
    """iterate (newton_schulz, eager or compiled) of every update's views, shared out across ranks according to
    how the parameters are distributed."""
    sharded = [isinstance(p, DTensor) for p in params]
    if any(sharded):
        if not all(sharded):
            raise ValueError("Muon: its parameters mix DTensor (FSDP2) and plain tensors; shard all or none")
        if params[0].device_mesh.size() > 1:
            return _orthogonalize_sharded(params, updates, splits, iterations, dtype, iterate)
    elif dist.is_available() and dist.is_initialized():  # also a group of one (train.ddp_always): its rehearsal
        return _orthogonalize_replicated(updates, splits, iterations, dtype, iterate)
    return _orthogonalize_local(updates, splits, iterations, dtype, iterate)


Scalar = float | Tensor  # a rate, momentum or decay: a number, or when compiled a 0-dim tensor (Muon._scalars)


def nesterov(buffers: list[Tensor], grads: list[Tensor], momenta: list[Scalar]) -> list[Tensor]:
    """Advance each momentum buffer towards its gradient and return the Nesterov updates."""
    out = []
    for buf, g, momentum in zip(buffers, grads, momenta):
        buf.lerp_(g, 1 - momentum)
        out.append(g.lerp(buf, momentum))
    return out


def _add_product(w: Tensor, factor: Scalar, a: Tensor, b: Tensor | None = None) -> None:
    """w += factor * a (* b). A number is the op's alpha (value), rounded once with the product, as eager always
    did; a tensor, which the op takes nowhere but as an operand, is multiplied in first."""
    if isinstance(factor, Tensor):
        a, factor = a * factor, 1
    if b is None:
        w.add_(a, alpha=factor)
    else:
        w.addcmul_(a, b, value=factor)


def apply_updates(weights: list[Tensor], updates: list[Tensor], lrs: list[Scalar], decays: list[Scalar],
                  cautious: list[bool], rates: list[list[tuple[slice, float]]]) -> None:
    """Decay each weight (`cautious`: only where its update shares its sign), then step it by -lr * scale * its
    update, its rows of each rate scale (`rates`, see _rate_scales) apart. A decay of the number 0 is no pass."""
    for w, o, lr, decay, only_agreeing, scales in zip(weights, updates, lrs, decays, cautious, rates):
        if isinstance(decay, Tensor) or decay:  # else a full read and write of the weights for nothing
            if only_agreeing:
                _add_product(w, -decay, w, (o * w >= 0).to(w.dtype))
            else:
                w.mul_(1 - decay)
        for rows, scale in scales:
            _add_product(w[rows], -lr * scale, o[rows].to(w.dtype))


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (plain, DDP replicas or FSDP2 shards); state: one momentum buffer per parameter
    (and NorMuon's second moment). Param group options:
    `split`: the matrices orthogonalised apart: a number of equal row blocks, or a tuple of row counts (see
    optim/views.py);
    `ns_coefficients`: the quintics of the iteration, "newton_schulz" or "polar_express" (see `quintics`);
    `ns_eps`: added to the update's starting norm (scaled by the safety factor), which it divides by;
    `cautious_wd`: decay only the weights whose sign the update shares (W -= lr * U pulls them toward 0);
    `wd_lr_squared`: the decay times lr / initial_lr (initial_lr: the group's base rate, lr at construction);
    `normuon` (with `normuon_beta2`): the update rescaled per neuron, see optim/normuon.py (`normuon_columns`: the
    neurons are the views' columns, whatever their shape).
    `compile` (for all groups): the math between the collectives under torch.compile (optim/compiled.py);
    `symmetric` (for all groups): Newton-Schulz's symmetric products by optim/symmetric.py's Triton kernel."""

    def __init__(self, params: ParamsT, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, adjust_lr: str = "original", split: Split = 1,
                 ns_dtype: torch.dtype | None = None, ns_coefficients: str = "newton_schulz",
                 cautious_wd: bool = False, normuon: bool = False, normuon_beta2: float = 0.95,
                 wd_lr_squared: bool = False, normuon_columns: bool = False, compile: bool = False,
                 symmetric: bool = False, ns_eps: float = NS_EPS):
        lr_scale((1, 1), adjust_lr)  # reject an unknown rule now, not at the first step
        self.ns_dtype = ns_dtype  # None: ns_dtype(device) of the parameters
        self.compile = compile
        self.symmetric = symmetric
        self._scalars_on_device: Tensor | None = None  # _scalars' device copy when compiled
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                                      adjust_lr=adjust_lr, split=split, ns_coefficients=ns_coefficients,
                                      cautious_wd=cautious_wd, normuon=normuon, normuon_beta2=normuon_beta2,
                                      wd_lr_squared=wd_lr_squared, normuon_columns=normuon_columns, ns_eps=ns_eps))
        reason = unavailable(self.param_groups[0]["params"][0].device) if symmetric else None
        if reason:
            raise ValueError(f"Muon symmetric=True: {reason}")
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])
            quintics(group["ns_coefficients"], group["ns_steps"])  # an unknown name or too few steps fail here
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(p.shape)}; "
                                     "give embeddings, norms and biases to AdamW")
                view_rows(p.shape, group["split"])  # a split that does not fit the rows fails here

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every matrix that has a gradient (all groups planned and batched together)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not work:
            return loss
        params = [p for p, _ in work]
        lrs, momenta, decays = self._scalars(work)
        updates = chosen(nesterov, self.compile)([self._momentum_buffer(p) for p in params],
                                                 [_local(p.grad) for p in params], momenta)
        dtype = self.ns_dtype or ns_dtype(params[0].device)
        iterations = [Iteration(g["ns_steps"], g["ns_coefficients"], self.symmetric, g["ns_eps"]) for _, g in work]
        done = _orthogonalize(params, updates, [g["split"] for _, g in work], iterations, dtype,
                              chosen(newton_schulz, self.compile))
        done = self._normuon(work, done)
        chosen(apply_updates, self.compile)(
            [_local(p) for p in params], done, lrs, decays, [g["cautious_wd"] for _, g in work],
            [_rate_scales(p, g["split"], g["adjust_lr"]) for p, g in work])
        return loss

    def _scalars(self, work: list[tuple[Tensor, dict]]) -> tuple[list[Scalar], list[Scalar], list[Scalar]]:
        """Each matrix's rate, momentum and decay: numbers, or when compiled 0-dim tensors (one copy to the device),
        so that the schedule's new values each step are new inputs to the same graphs, not new graphs. A group
        without decay keeps the number 0, which skips the decay's pass over the weights."""
        rows = []
        for _, g in work:
            decay = g["lr"] * g["weight_decay"]
            if g["wd_lr_squared"]:  # record 46 decays by its rate times (its rate x decay): the rate squared
                decay *= g["lr"] / g["initial_lr"]
            rows.append((g["lr"], g["momentum"], decay))
        if not self.compile:
            return tuple(list(column) for column in zip(*rows))
        w = _local(work[0][0])
        # from pinned memory into a tensor kept on the device: a copy the host does not wait for (a plain
        # torch.tensor(..., device=cuda) would wait for the whole backward before every step)
        host = torch.tensor(rows, dtype=w.dtype, pin_memory=w.is_cuda)
        if self._scalars_on_device is None or self._scalars_on_device.shape != host.shape:
            self._scalars_on_device = torch.empty_like(host, device=w.device)
        lrs, momenta, decays = self._scalars_on_device.copy_(host, non_blocking=True).unbind(1)
        return (list(lrs.unbind()), list(momenta.unbind()),
                [d if g["weight_decay"] else 0.0 for d, (_, g) in zip(decays.unbind(), work)])

    def _normuon(self, work: list[tuple[Tensor, dict]], done: list[Tensor]) -> list[Tensor]:
        """`done` with NorMuon applied to the updates of the groups that ask for it."""
        picked = [i for i, (_, g) in enumerate(work) if g["normuon"]]
        if not picked:
            return done
        params, groups = [work[i][0] for i in picked], [work[i][1] for i in picked]
        for p, g in zip(params, groups):
            if "second_moment" not in self.state[p]:
                self.state[p]["second_moment"] = torch.zeros(moment_size(p.shape, g["split"], g["normuon_columns"]),
                                                             dtype=torch.float32, device=_local(p).device)
        sharded = isinstance(params[0], DTensor) and params[0].device_mesh.size() > 1
        rescaled = normalize(
            [done[i] for i in picked], [p.shape for p in params], [g["split"] for g in groups],
            [_row_offset(p) for p in params], [self.state[p]["second_moment"] for p in params],
            [g["normuon_beta2"] for g in groups], params[0].device_mesh.get_group() if sharded else None,
            [g["normuon_columns"] for g in groups], self.compile)
        done = list(done)
        for i, o in zip(picked, rescaled):
            done[i] = o
        return done

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        """p's momentum buffer (this rank's part of it), zeros before the first step."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        return _local(state["momentum_buffer"])
