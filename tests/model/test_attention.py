"""The attention: its logit scale, output gate, XSA, value-embedding gate and a MUDD connection's values, each
against attention computed by hand."""
import dataclasses
import math

import pytest
import torch

import model.masks
from tests.model.tiny import batch, hand_attention, joined, sigmoid_of, tiny


@pytest.mark.parametrize("scale", [0.0, 0.12])
@pytest.mark.parametrize("windowed", [False, True])
def test_attn_scale_multiplies_the_attention_logits(scale, windowed):
    m = tiny(attn_scale=scale)
    att, (B, T) = m.blocks[0].attn, (2, 9)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2))
    idx = batch(B=B, T=T)
    mask = model.masks.attention_mask(idx, torch.tensor(4), False, 0) if windowed else None
    with torch.no_grad():
        torch.testing.assert_close(att(x, None, mask, None), att.proj(joined(hand_attention(att, x, scale, mask))))


def test_value_scale_multiplies_the_values_of_a_layer_without_a_value_embedding_by_its_scalar():
    m = tiny(value_scale=True, value_embeds=1)
    assert [b.attn.v_lambda is not None for b in m.blocks] == [False, True, True, False]  # 0 and 3 have a table
    att = m.blocks[1].attn
    assert att.v_lambda.tolist() == [0.5]
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        att.v_lambda.fill_(0.3)
        # attention is linear in v: scaling v by 0.3 scales every head's output by 0.3, before proj and its bias
        torch.testing.assert_close(att(x, None, None, None), att.proj(joined(0.3 * hand_attention(att, x))))


def test_attn_gate_at_init_halves_every_heads_output():
    m = tiny(attn_gate=True)
    att = m.blocks[1].attn
    assert att.gate.weight.shape == (2, 12) and not att.gate.weight.any()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = hand_attention(att, x)
        # sigmoid(0) = 0.5 on each head; proj has a bias, so the gate acts before it
        torch.testing.assert_close(att(x, None, None, None), att.proj(joined(0.5 * y)))


def test_attn_gate_scales_each_head_by_the_sigmoid_of_the_first_12_channels_of_its_input():
    m = tiny(attn_gate=True)
    att = m.blocks[0].attn
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 32, generator=g)
    with torch.no_grad():
        att.gate.weight.copy_(torch.randn(2, 12, generator=g))
        y = hand_attention(att, x)
        for t in range(3):
            for h in range(2):
                gate = 1 / (1 + math.exp(-sum(att.gate.weight[h, c].item() * x[0, t, c].item() for c in range(12))))
                y[0, h, t] *= gate
        torch.testing.assert_close(att(x, None, None, None), att.proj(joined(y)))
        x2 = x.clone()
        x2[..., 12:] += 1  # the gate reads the first 12 channels only
        assert torch.equal(att.gate(x2), att.gate(x))
        assert not torch.equal(att(x2, None, None, None), att(x, None, None, None))


def _attention_by_hand(att, x: torch.Tensor, ve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, v) [B, H, T, D] of `att` on x with the value embedding ve (the value mix at its init, 0.5 and 0.5)."""
    B, T, C = x.shape
    H = att.cfg.n_head
    q, k, v = att.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
    v = 0.5 * v + 0.5 * ve.view(B, T, H, C // H).transpose(1, 2)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(C // H)
    return logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf).softmax(-1) @ v, v


def test_xsa_drops_tanh_alpha_of_each_heads_output_along_the_tokens_own_value():
    m = tiny(xsa=[1], value_embeds=2)  # layer 1 mixes value-embedding table 1 into its values
    att = m.blocks[1].attn
    assert [b.attn.xsa_alpha is not None for b in m.blocks] == [False, True, False, False]
    g = torch.Generator().manual_seed(8)
    x, ve = torch.randn(2, 1, 5, 32, generator=g)
    alpha = [0.7, -1.3]
    seen = []
    att.proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        att.xsa_alpha.copy_(torch.tensor(alpha))
        att(x, ve, None)
        y, v = _attention_by_hand(att, x, ve)
    out = seen[0].view(1, 5, 2, 16).transpose(1, 2)
    for h in range(2):
        # the first token attends to itself alone: its output is its value, of which 1 - tanh(alpha) is left
        torch.testing.assert_close(out[0, h, 0], (1 - math.tanh(alpha[h])) * v[0, h, 0])
        for t in range(5):
            u = v[0, h, t] / v[0, h, t].norm()
            torch.testing.assert_close(out[0, h, t], y[0, h, t] - math.tanh(alpha[h]) * (y[0, h, t] @ u) * u)


def test_xsa_starts_as_plain_attention_and_at_full_strength_leaves_nothing_along_the_value():
    options = dict(rotary=True, qk_norm=True, attn_gate=True)
    m, plain = tiny(xsa=[0, 1, 2, 3], **options), tiny(**options)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == [
        f"blocks.{i}.attn.xsa_alpha" for i in range(4)]
    idx = batch()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=0, rtol=0)  # tanh(0) = 0
    att = m.blocks[0].attn
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(9))
    v = att.qkv(x)[..., 64:].view(2, 7, 2, 16)
    seen = []
    att.proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].view(2, 7, 2, 16)))
    with torch.no_grad():
        att(x, None, None)
        att.xsa_alpha.fill_(20.0)  # tanh(20) is 1 in float32
        att(x, None, None)
    before, after = ((y * v).sum(-1).abs().max() for y in seen)
    assert before > 0.1 and after < 1e-6


def test_ve_gate_scales_each_heads_value_embedding_by_twice_the_sigmoid_of_6_input_and_6_embedding_channels():
    m = tiny(value_embeds=1, ve_gate=True)
    att = m.blocks[0].attn
    assert att.ve_gate.weight.shape == (2, 12)  # n_head gates of 6 + 6 channels
    g = torch.Generator().manual_seed(8)
    x, ve = torch.randn(2, 1, 3, 32, generator=g)
    ungated = type(att)(dataclasses.replace(att.cfg, ve_gate=False), has_ve=True)
    assert ungated.load_state_dict(att.state_dict(), strict=False).unexpected_keys == ["ve_gate.weight"]
    with torch.no_grad():
        att.ve_gate.weight.copy_(torch.randn(2, 12, generator=g))
        factor = torch.ones_like(ve)  # heads of 16 channels: head h's value embedding times its gate
        for t in range(3):
            inputs = x[0, t, :6].tolist() + ve[0, t, :6].tolist()
            for h in range(2):
                factor[0, t, 16 * h:16 * (h + 1)] = 2 * sigmoid_of(att.ve_gate.weight[h], inputs)
        torch.testing.assert_close(att(x, ve, None, None), ungated(x, ve * factor, None, None))
        x2, ve2 = x.clone(), ve.clone()
        x2[..., 6:] += 1
        ve2[..., 6:12] += 1  # still head 0's values, but not read by the gate
        torch.testing.assert_close(att(x2, ve2, None, None), ungated(x2, ve2 * factor, None, None))


def test_attention_adds_the_mudd_values_to_its_values():
    # q and k zero: every key weighs the same, so the output at t is the mean of the values up to t; the values'
    # own rows zero and the projection the identity leave the mean of the added values
    m = tiny(bias=False, value_embeds=1)  # layer 0 mixes a value embedding in first
    att = m.blocks[0].attn
    g = torch.Generator().manual_seed(4)
    x, value, ve = torch.randn(3, 2, 6, 32, generator=g)
    with torch.no_grad():
        att.qkv.weight.zero_()
        att.proj.weight.copy_(torch.eye(32))
        got = att(x, ve, None, None, value)
        added = value + 0.5 * ve  # the value-embedding mix at its init, 0.5 v + 0.5 ve, v = 0
    want = added.cumsum(dim=1) / torch.arange(1, 7).view(1, 6, 1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
