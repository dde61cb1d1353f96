"""Rotary position embeddings (model.rotary; the records' half-truncated variant, model.rope_truncate) and YaRN's
stretch of their frequencies as the attention window grows (record 31, model.yarn)."""
from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor


def rotary_frequencies(head_dim: int, base: float, truncate: bool, device: torch.device | str | None = None) -> Tensor:
    """Angle per position of each (first half, second half) pair of a head: head_dim/2 frequencies."""
    if truncate:
        # The records' half-truncated rotary: head_dim/4 frequencies from 1 down to 1/base (both ends
        # included), and the other pairs keep frequency 0, so half of each head carries no position.
        quarter = head_dim // 4
        rotated = base ** -torch.linspace(0, 1, quarter, device=device, dtype=torch.float32)
        return torch.cat((rotated, rotated.new_zeros(head_dim // 2 - quarter)))
    return base ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


# YaRN's ramp over the turns a frequency makes across the start window: under ALPHA it is interpolated fully (its
# angles stay within those it trained on), over BETA kept (it tells nearby tokens apart), linear between
YARN_ALPHA, YARN_BETA = 1.0, 32.0
# the logits' gain, 1 + TEMPERATURE ln(window / start): more keys flatten a softmax of normalised q and k
YARN_TEMPERATURE = 0.2


def yarn(freqs: Tensor, start: int, window: Tensor) -> tuple[Tensor, Tensor]:
    """YaRN's rotary frequencies and attention-logit gain at the `window` now, for a model whose window started at
    `start` tokens: f * lerp(start / window, 1, ramp), ramp clamp((turns - ALPHA) / (BETA - ALPHA), 0, 1) with
    turns = start f / 2 pi; gain 1 + TEMPERATURE ln(window / start). `window` is a tensor: no new graph per size."""
    ramp = ((freqs * (start / (2 * math.pi)) - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
    # lerp is exact at both ends: a kept frequency (ramp 1), and every one at the start window, is unchanged
    stretch = torch.lerp(start / window.float(), torch.ones_like(ramp), ramp)
    return freqs * stretch, 1 + YARN_TEMPERATURE * torch.log(window.float() / start)


def yarn_jumps(freqs: Tensor, windows: list[int], window: Tensor) -> tuple[Tensor, Tensor]:
    """YaRN's frequencies and gain for a window that jumps through `windows` (model.window_stages, then
    model.window) and is at `window` now: `yarn` applied at each jump it has made, from the window before and to
    the frequencies of then, the gains multiplied (record 46's rule; a window grown in one jump is `yarn`'s)."""
    gain = torch.ones((), device=freqs.device)
    for old, new in itertools.pairwise(windows):
        stretched, jump_gain = yarn(freqs, old, window.new_tensor(new))
        reached = window >= new  # a tensor comparison: no host sync, no new graph per window
        freqs, gain = torch.where(reached, stretched, freqs), torch.where(reached, gain * jump_gain, gain)
    return freqs, gain


def bf16_rounded(x: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16's precision (to nearest, ties to even), still fp32. Integer arithmetic on its
    bits: torch.compile keeps it, where it fuses a cast to bf16 and back into nothing."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)


def rotary(x: Tensor, freqs: Tensor, gain: Tensor | None = None, bf16_tables: bool = False) -> Tensor:
    """Rotate each (first half, second half) pair of x [B, H, T, D] by its position times its frequency in `freqs`
    [D/2]; `gain` also scales the result (YaRN's attention temperature, on the queries). With `bf16_tables` the
    cos and sin tables are rounded to bf16 (record 46's, as its stream), the rotation summed in fp32."""
    T = x.size(-2)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos(), angles.sin()
    if bf16_tables:
        cos, sin = bf16_rounded(cos), bf16_rounded(sin)
    if gain is not None:
        cos, sin = cos * gain, sin * gain
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
