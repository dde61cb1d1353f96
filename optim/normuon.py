"""NorMuon: Muon's orthogonalised update rescaled per neuron by a running second moment, its norm kept.

For each matrix V (rows x cols) that Muon orthogonalises (each view of a split parameter), the neurons are its
rows when rows >= cols and its columns otherwise (the longer side counts the neurons, as the records decide), or
its columns whatever its shape (`columns`, a param group's `normuon_columns`: record 46's attention matrices);
a parameter's second moment B holds its views' neurons one view after another:
    s_i = mean of V's squares along neuron i;   B <- lerp(B, s, 1 - beta2)
    V' = V / sqrt(B) (neuron by neuron);         V <- V' * ||V||_F / ||V'||_F
Once B tracks s, every neuron's update has the same RMS, and the matrix keeps the size of step Muon gave it.

A rank may hold only some rows (FSDP2): it adds up the squares of its rows, one all_reduce of those sums (all
parameters at once) gives every rank the whole matrices' statistics, and B is the same on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from optim.compiled import chosen
from optim.views import Block, Split, blocks


def _by_neuron(block: Block, cols: int, columns: bool) -> bool:
    """Whether the neurons of the block's [rows, cols] views are their rows (else their columns)."""
    return not columns and block.rows >= cols


def _neurons(block: Block, cols: int, columns: bool) -> int:
    """The number of neurons of each view of the block."""
    return block.rows if _by_neuron(block, cols, columns) else cols


def moment_size(shape: torch.Size, split: Split, columns: bool = False) -> int:
    """The length of a parameter's second moment: each view's neurons, view after view (optim/views.py)."""
    return sum(b.count * _neurons(b, shape[1], columns) for b in blocks(shape, split))


def _parts(shape: torch.Size, split: Split, start: int, held: int, columns: bool):
    """Per Block of the parameter: (the block, its slice of the per-neuron tensors, the rows of it among this
    rank's rows start... start + held: as a range in the block and as a slice of this rank's rows)."""
    offset = 0
    for b in blocks(shape, split):
        size = b.count * _neurons(b, shape[1], columns)
        lo = min(max(start, b.start), b.stop)
        hi = max(min(start + held, b.stop), lo)
        yield b, slice(offset, offset + size), range(lo - b.start, hi - b.start), slice(lo - start, hi - start)
        offset += size


def _square_sums(o: Tensor, shape: torch.Size, split: Split, start: int, columns: bool = False) -> Tensor:
    """The sums of squares per neuron that this rank's rows o (rows start... of the parameter) contribute."""
    sq = o.float().square()
    sums = torch.zeros(moment_size(shape, split, columns), dtype=torch.float32, device=o.device)
    for b, neurons, rows, mine in _parts(shape, split, start, o.size(0), columns):
        if not rows:  # none of this block's rows are here
            continue
        part = sums[neurons].view(b.count, -1)
        if _by_neuron(b, shape[1], columns):
            part.view(-1)[rows.start:rows.stop] = sq[mine].sum(-1)
        else:
            part.index_add_(0, torch.arange(rows.start, rows.stop, device=o.device) // b.rows, sq[mine])
    return sums


def _rescaled(o: Tensor, sums: Tensor, moment: Tensor, beta2: float, shape: torch.Size,
              split: Split, start: int, columns: bool = False) -> Tensor:
    """o (fp32) rescaled per neuron by the updated second moment, each view keeping its Frobenius norm. Every
    block's moment advances, also of the views this rank holds no rows of: the moment is the same on all ranks."""
    out = []
    for b, neurons, rows, mine in _parts(shape, split, start, o.size(0), columns):
        by_neuron = _by_neuron(b, shape[1], columns)
        s, m = sums[neurons].view(b.count, -1), moment[neurons].view(b.count, -1)  # [views, neurons]
        m.lerp_(s / (shape[1] if by_neuron else b.rows), 1 - beta2)
        step = m.clamp_min(1e-10).rsqrt()
        kept = s.sum(-1, keepdim=True).sqrt() / (s * step.square()).sum(-1, keepdim=True).sqrt().clamp_min(1e-10)
        scale = step * kept
        if rows:
            index = torch.arange(rows.start, rows.stop, device=o.device)
            factor = scale.view(-1)[index, None] if by_neuron else scale[index // b.rows]
            out.append(o[mine].float() * factor)
    return out[0] if len(out) == 1 else torch.cat(out or [o.float()])


def _all_square_sums(updates: list[Tensor], shapes: list[torch.Size], splits: list[Split], starts: list[int],
                     columns: list[bool]) -> list[Tensor]:
    """_square_sums of each update: the part before the all_reduce, one graph when compiled."""
    return [_square_sums(*args) for args in zip(updates, shapes, splits, starts, columns)]


def _all_rescaled(updates: list[Tensor], sums: list[Tensor], moments: list[Tensor], beta2: list[float],
                  shapes: list[torch.Size], splits: list[Split], starts: list[int],
                  columns: list[bool]) -> list[Tensor]:
    """_rescaled of each update: the part after the all_reduce, one graph when compiled."""
    return [_rescaled(*args) for args in zip(updates, sums, moments, beta2, shapes, splits, starts, columns)]


def normalize(updates: list[Tensor], shapes: list[torch.Size], splits: list[Split], starts: list[int],
              moments: list[Tensor], beta2: list[float], group: dist.ProcessGroup | None = None,
              columns: list[bool] | None = None, compile: bool = False) -> list[Tensor]:
    """NorMuon of each update (this rank's rows of it, from row `starts[i]` of a parameter of global shape
    `shapes[i]`), advancing its second moment; `group`: the ranks that hold the other rows (None: all here);
    `columns[i]`: its neurons are its views' columns (None: the longer side's, for all); `compile`: the math on
    either side of the all_reduce under torch.compile (optim/compiled.py)."""
    columns = columns or [False] * len(updates)
    sums = chosen(_all_square_sums, compile)(updates, shapes, splits, starts, columns)
    if group is not None:
        flat = torch.cat([s.view(-1) for s in sums])
        dist.all_reduce(flat, group=group)
        sums = [f.view_as(s) for f, s in zip(flat.split([s.numel() for s in sums]), sums)]
    return chosen(_all_rescaled, compile)(updates, sums, moments, beta2, shapes, splits, starts, columns)
