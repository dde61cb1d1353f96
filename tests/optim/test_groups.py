"""The parameter groups: every parameter in one role, Muon's groups and AdamW's, and weight decay on matrices only."""
from model import get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers, param_roles
from tests.helpers import MODERN_GPT as MODERN, TINY_GPT as TINY


def test_param_roles_cover_every_parameter_once():
    m = get_model({**TINY, **MODERN})
    roles = param_roles(m)
    ids = [id(p) for ps in roles.values() for p in ps]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())
    assert all(p.ndim == 2 for p in roles["matrix"]) and len(roles["matrix"]) == 4 * 4
    assert roles["head"] == [m.lm_head.weight] and len(roles["embed"]) == 3
    adamw, muon = build_optimizers(m, OptimConfig(name="muon"))
    assert all(g["initial_lr"] == g["lr"] for opt in (adamw, muon) for g in opt.param_groups)
    assert {g["lr"] for g in adamw.param_groups} == {0.6, 0.008, 0.04}


def test_adamw_decays_only_matrices():
    m = get_model(TINY)
    (opt,) = build_optimizers(m, OptimConfig())
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    matrices = {id(p) for p in m.blocks.parameters() if p.ndim == 2}  # the tied head is the embedding
    assert {id(p) for p in decayed["params"]} == matrices
    assert len(decayed["params"]) + len(plain["params"]) == len(list(m.parameters()))
