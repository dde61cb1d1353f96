"""Rotary positions (and their half-truncated variant) and YaRN's stretch of their frequencies."""
import itertools
import math

import pytest
import torch

import model.attention
import model.masks
import model.rotary
from tests.model.tiny import batch, joined, tiny


def test_rope_truncate_rotates_half_of_each_head(monkeypatch):
    D, base, T = 16, 1024.0, 7
    freqs = model.rotary.rotary_frequencies(D, base, truncate=True)
    torch.testing.assert_close(freqs, torch.tensor([1.0, 1024 ** (-1 / 3), 1024 ** (-2 / 3), 1 / 1024, 0, 0, 0, 0]))
    x = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(3))
    y = model.rotary.rotary(x, freqs)
    unrotated = list(range(4, 8)) + list(range(12, 16))
    assert torch.equal(y[..., unrotated], x[..., unrotated]) and torch.equal(y[..., 0, :], x[..., 0, :])
    # pair j is (dim j, dim j + 8): pair 0 turns by one radian per position, pair 3 by 1/1024
    for pair, freq in [(0, 1.0), (3, 1 / 1024)]:
        turned = (torch.atan2(y[0, 0, :, pair + 8], y[0, 0, :, pair])
                  - torch.atan2(x[0, 0, :, pair + 8], x[0, 0, :, pair]))
        torch.testing.assert_close(torch.remainder(turned, 2 * math.pi),
                                   torch.remainder(torch.arange(T) * freq, 2 * math.pi), atol=1e-5, rtol=0)
    full = model.rotary.rotary(x, model.rotary.rotary_frequencies(D, base, truncate=False))
    assert not torch.equal(full[..., 1:, unrotated], x[..., 1:, unrotated])  # the default rotates every pair
    calls, rotary = [], model.rotary.rotary

    def spy(x, f, gain=None, bf16_tables=False):
        calls.append((f, gain))
        return rotary(x, f, gain, bf16_tables)
    monkeypatch.setattr(model.attention, "rotary", spy)
    tiny(rotary=True, rope_truncate=True, rope_base=1024.0)(batch())
    assert len(calls) == 2 * 4  # q and k of every layer
    assert all(torch.equal(f, model.rotary.rotary_frequencies(16, 1024.0, True)) and gain is None for f, gain in calls)


def yarn_by_hand(f: float, start: int, window: int) -> float:
    """YaRN's frequency for f, in Python floats: f (s + r (1 - s)), s = start / window, r the ramp of f's turns
    across the start window from 1 (r = 0) to 32 (r = 1)."""
    s, turns = start / window, start * f / (2 * math.pi)
    r = min(max((turns - 1) / 31, 0.0), 1.0)
    return f * (s + r * (1 - s))


@pytest.mark.parametrize("truncate, base", [(True, 1024.0), (False, 10000.0)], ids=["records", "plain"])
def test_yarn_frequencies_follow_the_closed_form_keep_the_fast_and_stretch_the_slow(truncate, base):
    # the records' head: 128 channels; record 31's start window 3 x 128 tokens, its final eval's 13 x 128
    freqs, start, window = model.rotary.rotary_frequencies(128, base, truncate), 384, 1664
    scaled, gain = model.rotary.yarn(freqs, start, torch.tensor(window))
    turns = freqs * start / (2 * math.pi)
    fast, slow = turns >= 32, turns <= 1
    assert fast.sum() >= 3 and slow.sum() >= 10 and (~fast & ~slow).sum() >= 10  # all three regimes occur
    assert torch.equal(scaled[fast], freqs[fast])  # kept bit for bit
    torch.testing.assert_close(scaled[slow], freqs[slow] * start / window, atol=0, rtol=1e-6)  # interpolated
    by_hand = torch.tensor([yarn_by_hand(f, start, window) for f in freqs.tolist()])
    torch.testing.assert_close(scaled, by_hand, atol=0, rtol=1e-6)
    assert (scaled <= freqs).all() and gain.item() == pytest.approx(1 + 0.2 * math.log(window / start), rel=1e-6)
    same, one = model.rotary.yarn(freqs, start, torch.tensor(start))  # at the start window: plain rotary, exactly
    assert torch.equal(same, freqs) and one.item() == 1.0


def test_a_stepped_window_applies_yarn_at_each_jump_as_record_46():
    """Record 46's windows, 384 -> 896 -> 1,408 -> 1,664: each jump stretches the frequencies of then from the
    window before, and multiplies the logit gain by 1 + 0.2 ln(new / old): 1.318 at 1,664, where one jump from 384
    gives 1.293."""
    freqs, windows = model.rotary.rotary_frequencies(128, 1024.0, True), [384, 896, 1408, 1664]
    for reached in range(1, 4):
        by_hand, gain = freqs.tolist(), 1.0
        for old, new in itertools.pairwise(windows[:reached + 1]):
            by_hand = [yarn_by_hand(f, old, new) for f in by_hand]
            gain *= 1 + 0.2 * math.log(new / old)
        scaled, got = model.rotary.yarn_jumps(freqs, windows, torch.tensor(windows[reached]))
        torch.testing.assert_close(scaled, torch.tensor(by_hand), atol=0, rtol=1e-6)
        assert got.item() == pytest.approx(gain, rel=1e-6)
    assert gain == pytest.approx(1.318, abs=1e-3) and not torch.allclose(scaled, model.rotary.yarn(
        freqs, 384, torch.tensor(1664))[0])
    same, one = model.rotary.yarn_jumps(freqs, windows, torch.tensor(384))  # before any jump: plain rotary
    assert torch.equal(same, freqs) and one.item() == 1.0


def test_a_gpt_with_window_stages_takes_its_yarn_jump_by_jump():
    """Windows 4 -> 8 -> 16 by stages against 4 growing linearly to 16: the same at 4 and at 8 (one jump is the
    closed form), apart at 16, where the second jump stretches what the first left."""
    options = {"rotary": True, "rope_truncate": True, "rope_base": 1024.0, "window": 16, "yarn": True,
               "block_size": 64}
    stages, linear = tiny(**options, window_stages=[4, 8]), tiny(**options, window_start=4)
    idx = batch(B=2, T=40)
    with torch.no_grad():
        for stage_progress, linear_progress, alike in ((0.0, 0.0, True), (0.5, 1 / 3, True), (1.0, 1.0, False)):
            stages.set_progress(stage_progress)
            linear.set_progress(linear_progress)
            assert stages.window == linear.window
            assert torch.equal(stages(idx)[0], linear(idx)[0]) == alike, stages.window


def test_yarn_attention_rotates_by_the_stretched_frequencies_and_scales_the_logits():
    m = tiny(rotary=True, window=8, window_start=2, yarn=True, attn_scale=0.3, n_layer=1)
    att, (B, T, H, D) = m.blocks[0].attn, (1, 11, 2, 16)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(10))
    m.set_progress(0.5)  # window 5
    mask = model.masks.attention_mask(batch(B=B, T=T), m.windows[0], False, 0)
    with torch.no_grad():
        q, k, v = att.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        freqs = [yarn_by_hand(10000 ** (-2 * i / D), 2, 5) for i in range(D // 2)]
        angles = torch.tensor([[t * f for f in freqs] for t in range(T)])

        def turned(y):  # pair i is (channel i, channel i + D/2)
            y1, y2 = y.chunk(2, dim=-1)
            return torch.cat((y1 * angles.cos() - y2 * angles.sin(), y1 * angles.sin() + y2 * angles.cos()), -1)
        logits = turned(q) @ turned(k).transpose(-1, -2) * 0.3 * (1 + 0.2 * math.log(5 / 2))
        y = logits.masked_fill(~mask, -math.inf).softmax(-1) @ v
        torch.testing.assert_close(att(x, None, mask, m.windows[0]), att.proj(joined(y)), atol=1e-5, rtol=0)


def test_yarn_is_plain_rotary_at_the_start_window_and_follows_the_window_without_state():
    options = dict(rotary=True, rope_truncate=True, rope_base=1024.0, window=16, window_start=4, window_pattern="LS",
                   block_size=64)
    m, plain = tiny(**options, yarn=True), tiny(**options)
    idx = batch(B=2, T=40)
    with torch.no_grad():
        assert not torch.equal(m(idx)[0], plain(idx)[0])  # a fresh model: the final window, 4 times the start
        plain.set_progress(1.0)
        for progress in (0.5, 0.0):  # back to the start window: nothing carried over from the longer ones
            m.set_progress(progress)
            plain.set_progress(progress)
            same = torch.equal(m(idx)[0], plain(idx)[0])
            assert same == (progress == 0.0), progress


def test_bf16_rounded_is_the_cast_to_bf16_and_back_and_survives_compile():
    x = torch.cat((torch.randn(100_000, generator=torch.Generator().manual_seed(0)),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8])))  # ties go to even
    assert torch.equal(model.rotary.bf16_rounded(x), x.to(torch.bfloat16).float())
    # compiled, a cast to bf16 and back would fuse into nothing; the integer rounding stays. Against inductor's own
    # cos: its vectorised cos may differ from eager's in the last bit on some CPUs
    rounded = torch.compile(lambda t: model.rotary.bf16_rounded(t.cos()), backend="inductor")(x)
    cos = torch.compile(lambda t: t.cos(), backend="inductor")(x)
    assert torch.equal(rounded, cos.to(torch.bfloat16).float()) and not torch.equal(rounded, cos)


def test_bf16_tables_round_cos_and_sin_once_and_sum_in_fp32():
    """Record 46 keeps its cos and sin tables in bf16: `bf16_tables` rounds them, and nothing else."""
    freqs = model.rotary.rotary_frequencies(16, 1024.0, truncate=True)
    x = torch.randn(1, 2, 700, 16, generator=torch.Generator().manual_seed(3))
    gain = torch.tensor(1.3)
    angles = torch.outer(torch.arange(700, dtype=torch.float32), freqs)  # in fp32, as the tables are computed
    cos, sin = (f(angles).to(torch.bfloat16).double() * 1.3 for f in (torch.cos, torch.sin))
    x1, x2 = x.double().chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    got = model.rotary.rotary(x, freqs, gain, bf16_tables=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)
    # fp32 tables are another rotation, by up to bf16's rounding of the tables
    assert (model.rotary.rotary(x, freqs, gain) - got).abs().max() > 1e-3
