"""MUDD connections: a no-op at init, their sources and channels, the weighted sums, gradients, optimizer, FLOPs."""
import math

import pytest
import torch
import torch.nn.functional as F

import model.mudd
from model import GPTConfig
from optim.config import OptimConfig
from optim.groups import build_optimizers, param_roles
from tests.helpers import TINY_GPT as TINY
from tests.model.tiny import batch, tiny


def test_mudd_starts_as_the_model_without_it():
    # the MLPs' output matrices and biases start at zero: every weight 0, the same logits and loss bit for bit; the
    # other parameters draw as without MUDD (its own draw comes last)
    options = dict(rotary=True, value_embeds=1, unet_skips=True)
    m, plain = tiny(mudd=[1, 2, 3], mudd_sources=[0, 1, 2], **options), tiny(**options)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == [
        f"mudd.{j}.{name}" for j in range(3) for name in ("fc", "proj", "bias")]
    assert all(not mod.proj.any() and not mod.bias.any() and mod.fc.any() for mod in m.mudd)
    x = batch()
    torch.testing.assert_close(m(x)[0], plain(x)[0], atol=0, rtol=0)
    torch.testing.assert_close(m(x, x)[1], plain(x, x)[1], atol=0, rtol=0)


def test_mudd_sources_shapes_and_value_channels_follow_the_layers():
    # record 81's layout on 11 layers: after 9, x0, h7, h9 for the residual and layer 10's values; after 10 (the last:
    # no values to feed), x0, h7, h9 for the residual alone
    cfg = GPTConfig(**{**TINY, "n_layer": 11, "mudd": [9, 10], "mudd_sources": [7, 9]})
    assert [cfg.mudd_reads(i) for i in (9, 10)] == [[7, 9], [7, 9]]
    assert [cfg.mudd_feeds_values(i) for i in (9, 10)] == [True, False]
    m = tiny(mudd=[0, 1, 3], mudd_sources=[0, 3], no_attention=[2])
    # after 0: x0, h0 and layer 1's values; after 1: layer 2 has no attention; after 3: the last layer
    assert [tuple(mod.proj.shape) for mod in m.mudd] == [(4, 64), (2, 64), (3, 64)]
    assert [mod.fc.shape for mod in m.mudd] == [(64, 32)] * 3
    assert [mod.scale for mod in m.mudd] == [0.2 / math.sqrt(2), 0.2 / math.sqrt(2), 0.2 / math.sqrt(3)]
    assert model.mudd.mudd_width(63) == 64 and model.mudd.mudd_width(64) == 128


def test_mudd_adds_the_weighted_sums_of_its_sources_to_the_residual_and_the_next_layers_values():
    m = tiny(mudd=[1], mudd_sources=[0, 1])
    mod = m.mudd[0]
    seen = {}
    m.blocks[0].register_forward_pre_hook(lambda _, args: seen.update(x0=args[0]))
    for i in (0, 1):
        m.blocks[i].register_forward_hook(lambda _, args, out, i=i: seen.update({f"h{i}": out}))
    # block 2's inputs: the residual stream (args[0]) and the values to add (args[6])
    m.blocks[2].register_forward_pre_hook(lambda _, args: seen.update(x=args[0], value=args[6]))
    m.blocks[3].register_forward_pre_hook(lambda _, args: seen.update(after=args[6]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mod.proj.copy_(torch.randn(mod.proj.shape, generator=g))
        mod.bias.copy_(torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5, -0.75]))  # residual: x0, h0, h1; values: the same
        m(batch(B=2, T=5))
        h1 = seen["h1"]
        hidden = F.gelu(h1 @ mod.fc.T)
        sources = [seen["x0"], seen["h0"], h1]
        for b, t in [(0, 0), (1, 3), (1, 4)]:
            w = [(hidden[b, t] @ mod.proj[j] + mod.bias[j]).item() * 0.2 / math.sqrt(3) for j in range(6)]
            residual = h1[b, t] + sum(w[k] * s[b, t] for k, s in enumerate(sources))
            value = 1.15 * sum(w[3 + k] * s[b, t] for k, s in enumerate(sources))
            torch.testing.assert_close(seen["x"][b, t], residual, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(seen["value"][b, t], value, atol=1e-6, rtol=1e-5)
    assert seen["after"] is None  # only the layer after the connection gets values


def test_mudd_mlp_gets_gradients_once_its_output_weights_are_not_zero():
    m = tiny(mudd=[1, 3], mudd_sources=[0, 1])
    x = batch()
    m(x, x)[1].backward()
    # at init only the output layer and bias learn: the hidden layer's gradient passes through the zero matrix
    assert all(mod.proj.grad.any() and mod.bias.grad.any() and not mod.fc.grad.any() for mod in m.mudd)
    m.zero_grad()
    with torch.no_grad():
        for mod in m.mudd:
            mod.proj.normal_(std=0.02)
    m(x, x)[1].backward()
    assert all(mod.fc.grad.abs().sum() > 0 for mod in m.mudd)


def test_mudd_mlps_are_adamw_at_a_twentieth_of_the_scalars_rate_and_the_records_betas():
    m = tiny(mudd=[1, 3], mudd_sources=[1])
    params = {id(p) for mod in m.mudd for p in mod.parameters()}
    assert {id(p) for p in param_roles(m)["mudd"]} == params
    adam, muon = build_optimizers(m, OptimConfig(name="muon"))
    (group,) = [g for g in adam.param_groups if {id(p) for p in g["params"]} & params]
    assert {id(p) for p in group["params"]} == params and group["lr"] == pytest.approx(0.04 / 20)
    assert group["betas"] == (0.9, 0.99) and group["weight_decay"] == 0.0
    assert not {id(p) for g in muon.param_groups for p in g["params"]} & params
    (adamw,) = build_optimizers(m, OptimConfig())
    assert all(g["weight_decay"] == 0.0 for g in adamw.param_groups if {id(p) for p in g["params"]} & params)


def test_flops_per_token_count_the_mudd_mlps_and_weighted_sums():
    plain, m = tiny(), tiny(mudd=[1, 3], mudd_sources=[0, 1])
    # after 1: 2 channels x 3 sources; after 3 (the last): 1 x 3; each MLP 64 x 32 in, 64 out per weight plus a bias
    weights = (64 * 32 + 6 * 64 + 6) + (64 * 32 + 3 * 64 + 3)
    assert m.matmul_weights == plain.matmul_weights + weights
    assert m.flops_per_token(16) == plain.flops_per_token(16) + 6 * weights + 6 * 32 * (6 + 3)
