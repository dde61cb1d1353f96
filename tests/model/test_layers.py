"""The norm, the sparse gate and the MLP."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model.layers
from tests.model.tiny import tiny


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_norm_gain_off_leaves_the_norms_without_weights(norm):
    m, gained = tiny(norm=norm, norm_gain=False), tiny(norm=norm)
    assert not [name for name, _ in m.named_parameters() if "norm" in name and "weight" in name]
    assert m.num_params() == gained.num_params() - (2 * 4 + 1) * 32
    h = torch.randn(3, 5, 32)
    bias = m.norm_f.bias
    with torch.no_grad():
        expected = F.rms_norm(h, (32,)) if norm == "rmsnorm" else F.layer_norm(h, (32,), None, bias)
        torch.testing.assert_close(m.norm_f(h), expected, atol=0, rtol=0)


def test_a_gate_is_the_sigmoid_of_a_linear_map_of_its_inputs_first_channels_and_starts_at_one_half():
    cfg = tiny().cfg
    gate = model.layers.Gate(cfg, 3)
    gate.reset_parameters()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    assert gate.weight.shape == (3, 12) and torch.equal(gate(x), torch.full((2, 5, 3), 0.5))
    with torch.no_grad():
        gate.weight.normal_(generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(gate(x), torch.sigmoid(x[..., :12] @ gate.weight.T))
        x[..., 12:] = 7.0  # the channels after the first 12 are never read
        torch.testing.assert_close(gate(x), torch.sigmoid(x[..., :12] @ gate.weight.T))
    assert model.layers.Gate(cfg, 2, channels=6).weight.shape == (2, 6)


@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_the_mlp_is_its_two_matrices_around_gpt2s_gelu_or_the_records_squared_relu(activation):
    mlp = tiny(activation=activation).blocks[0].mlp
    x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        nn.init.normal_(mlp.proj.weight, std=0.1)
        h = mlp.fc(x)
        h = F.relu(h) ** 2 if activation == "relu2" else F.gelu(h, approximate="tanh")
        torch.testing.assert_close(mlp(x), mlp.proj(h))
