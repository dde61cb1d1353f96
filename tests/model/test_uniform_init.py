"""model.init = "uniform": the matrices drawn U(-sqrt(3) s, sqrt(3) s) at their std s, as record 46 starts its qkv
and fc; the tables, zero-started weights and the default's draws as before."""
import math

import pytest
import torch

from model import get_model
from tests.helpers import MODERN_GPT as MODERN
from tests.helpers import ROOT
from tests.helpers import TINY_GPT as TINY
from tests.model.tiny import tiny
from trainer.config import parse_args

STD = 0.02  # TINY's init_std, the default


def assert_uniform(w: torch.Tensor, std: float, name: str) -> None:
    """w lies in [-sqrt(3) std, sqrt(3) std] and its mean and std are those of U(-sqrt(3) std, sqrt(3) std) within 5
    standard errors of n draws: std / sqrt(n) for the mean, and for the sample std (kurtosis 9/5) a relative
    sqrt((9/5 - 1) / (4 n)) = sqrt(0.2 / n)."""
    bound, n = math.sqrt(3) * std, w.numel()
    assert w.abs().max() <= bound, f"{name}: {w.abs().max()} outside [-{bound}, {bound}]"
    assert abs(w.mean()) < 5 * std / math.sqrt(n), name
    assert abs(w.std() / std - 1) < 5 * math.sqrt(0.2 / n), f"{name}: std {w.std()}, want {std}"


def assert_normal(w: torch.Tensor, std: float, name: str) -> None:
    """w's std is `std` within 5 standard errors of n normal draws (relative sqrt(0.5 / n)), and it has the tail a
    uniform of that std lacks: some |w| beyond sqrt(3) std (8% of normal draws are)."""
    assert abs(w.std() / std - 1) < 5 * math.sqrt(0.5 / w.numel()), f"{name}: std {w.std()}, want {std}"
    assert w.abs().max() > math.sqrt(3) * std, name


def test_qkv_and_fc_lie_within_the_bound_at_init_std_and_the_zero_started_weights_stay_zero():
    m = tiny(**MODERN, attn_gate=True, smear=True, init="uniform")  # zero-started projections, an untied head
    uniform = {name: w for name, w in m.named_parameters() if name.endswith(("qkv.weight", "fc.weight"))}
    assert len(uniform) == 2 * TINY["n_layer"]
    for name, w in uniform.items():
        assert_uniform(w.detach(), STD, name)
    zero = [n for n, w in m.named_parameters() if n.endswith(("proj.weight", "gate.weight")) or n == "lm_head.weight"]
    assert len(zero) == 2 * TINY["n_layer"] + TINY["n_layer"] + 1 + 1  # projections, attention gates, smear, head
    for name in zero:
        assert not m.get_parameter(name).any(), name


def test_the_residual_projections_drawn_at_their_scaled_std_are_uniform_too():
    m = tiny(init="uniform")
    std = STD / math.sqrt(2 * TINY["n_layer"])
    for name, w in m.named_parameters():
        if name.endswith("proj.weight"):
            assert_uniform(w.detach(), std, name)


@pytest.mark.parametrize("options", [dict(), dict(untie_at=0.5), dict(tie_embeddings=False, embed_init_std=1.0)],
                         ids=["tied", "untie_at", "untied"])
def test_the_tables_and_a_head_that_starts_as_the_token_table_keep_their_normal_draws(options):
    plain, m = tiny(**options, value_embeds=1), tiny(**options, value_embeds=1, init="uniform")
    std = options.get("embed_init_std", STD)
    for name in ("wte.weight", "wpe.weight", "value_embeds.0.weight"):
        w = m.get_parameter(name).detach()
        assert_normal(w, STD if name == "wpe.weight" else std, name)
        if name != "wte.weight" or not m.cfg.untie_at:  # drawn before any matrix: the very same draws
            assert torch.equal(w, plain.get_parameter(name)), name
    if m.cfg.tie_embeddings:  # the head is the token table, or starts as it
        assert torch.equal(m.lm_head.weight, m.wte.weight)
    else:
        assert_uniform(m.lm_head.weight.detach(), STD, "lm_head.weight")


def test_under_the_speedrun_pieces_the_key_changes_qkv_and_fc_alone():
    plain, m = tiny(**MODERN, init="normal"), tiny(**MODERN, init="uniform")
    pairs = zip(plain.state_dict().items(), m.state_dict().values())
    changed = [name for (name, a), b in pairs if not torch.equal(a, b)]
    assert changed == [f"blocks.{i}.{part}.weight" for i in range(TINY["n_layer"]) for part in ("attn.qkv", "mlp.fc")]


def test_the_default_draws_are_those_before_the_key():
    # sums (and sums of squares) of TINY's draws under torch.manual_seed(0), computed before model.init existed;
    # the tolerance absorbs the last bits that differ between CPU capabilities' normal_ kernels
    pinned = {"wte.weight": (5.451055878812554, 4.943169306946358),
              "blocks.0.attn.qkv.weight": (0.6356639635982901, 1.2725294653964276),
              "blocks.3.mlp.fc.weight": (-2.5118350756756627, 1.6628477664028358),
              "blocks.1.attn.proj.weight": (-0.2807414212693402, 0.05172902280520354)}
    for options in (dict(), dict(init="normal")):
        m = tiny(**options)
        for name, (total, squares) in pinned.items():
            w = m.get_parameter(name).detach().double()
            assert w.sum().item() == pytest.approx(total, rel=1e-4), name
            assert w.square().sum().item() == pytest.approx(squares, rel=1e-4), name


def test_the_speedrun_config_starts_as_record_46():
    # its modules at a small size: q, k, v and fc uniform at init_std, projections, head and gates zero, the
    # tables N(0, 1) (record 46's init, its code at lines 827-900 of its log)
    section = parse_args(["--config", str(ROOT / "configs" / "speedrun_8xh100.toml")]).to_dict()["model"]
    assert section["init"] == "uniform"
    torch.manual_seed(0)
    m = get_model({**section, "vocab_size": 1000, "n_embd": 128, "n_head": 1})
    std = section["init_std"]
    for name, w in m.named_parameters():
        w = w.detach()
        if name.endswith(("qkv.weight", "fc.weight")):
            assert_uniform(w, std, name)
        elif name.startswith(("wte", "value_embeds")):
            assert_normal(w, 1.0, name)
        elif w.dim() == 2:
            assert not w.any(), name


def test_an_unknown_init_is_refused_naming_the_key_and_the_values():
    with pytest.raises(ValueError, match="model config: init='gaussian'; use 'normal' or 'uniform'"):
        get_model({**TINY, "init": "gaussian"})
