"""The parameter groups: every parameter in one role, Muon's groups and AdamW's, weight decay on matrices only,
Q and K in pairs of heads, and the steps: AdamW every adam_every steps on the summed gradients, Muon every step."""
from typing import Callable

import pytest
import torch

from model import get_model
from optim.config import OptimConfig
from optim.groups import adamw_params, build_optimizers, param_roles, set_lr, step_optimizers, untie_when_due
from tests.helpers import MODERN_GPT as MODERN, TINY_GPT as TINY
from tests.workers.muon_worker import GPT_CONFIG, gpt


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


def _adam_and_muon(opts) -> tuple[list, list]:
    return [[p for g in opt.param_groups for p in g["params"]] for opt in opts]


def _loss(model, step: int) -> torch.Tensor:
    """The GPT's loss on a batch of its own for each step."""
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(step))
    return model(idx[:, :-1], idx[:, 1:])[1]


def test_adamw_every_second_step_applies_the_sum_of_both_steps_gradients_and_muon_steps_every_step():
    cfg = OptimConfig(name="muon", adam_every=2, embed_lr=0.01, head_lr=0.01)
    model = gpt()
    opts = build_optimizers(model, cfg)
    adam, muon = _adam_and_muon(opts)
    start = [p.detach().clone() for p in adam]
    set_lr(opts, 1.0, 0)
    _loss(model, 0).backward()
    first = [p.grad.clone() for p in adam]
    moved = [p.detach().clone() for p in muon]
    step_optimizers(opts, 0, cfg.adam_every)
    # step 0: Muon stepped and dropped its gradients; AdamW neither moved nor dropped its own
    assert all(p.grad is None for p in muon) and all(not torch.equal(p, q) for p, q in zip(muon, moved))
    assert all(torch.equal(p, w) and torch.equal(p.grad, g) for p, w, g in zip(adam, start, first))

    # the second step's own gradients, at the weights step 0 left, in a copy
    copy = gpt()
    copy.load_state_dict(model.state_dict())
    _loss(copy, 1).backward()
    second = [p.grad for p in _adam_and_muon(build_optimizers(copy, cfg))[0]]
    set_lr(opts, 0.5, 1)  # the schedule's rate of the step that applies them
    _loss(model, 1).backward()
    assert all(torch.equal(p.grad, a + b) for p, a, b in zip(adam, first, second))
    step_optimizers(opts, 1, cfg.adam_every)
    assert all(p.grad is None for p in adam + muon)

    # torch's AdamW from the start, one step on the summed gradients at that rate
    fresh = gpt()
    reference = build_optimizers(fresh, cfg)
    for p, a, b in zip(_adam_and_muon(reference)[0], first, second):
        p.grad = a + b
    set_lr(reference, 0.5, 1)
    reference[0].step()
    want = _adam_and_muon(reference)[0]
    assert all(torch.equal(p, w) for p, w in zip(adam, want))
    assert all(not torch.equal(p, w) for p, w in zip(adam, start) if p.ndim == 2)  # the embeddings and head moved
    assert opts[0].state[adam[0]]["step"] == 1


def test_eps_before_correction_steps_as_record_46s_adam():
    # record 46's Adam at its t-th step: p -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps), on the odd steps
    # (adam_every 2) with the two steps' gradients; near eps in size, where torch's eps placement differs
    torch.manual_seed(0)
    lr, (b1, b2), eps = 0.01, (0.65, 0.95), 1e-8
    w, grads = torch.randn(64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64) * 1e-8
    m, v, ref = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64), w.clone()
    for t, g in enumerate(grads.view(4, 2, 64).sum(1), start=1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        ref -= lr * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) * m / (v.sqrt() + eps)
    for key, near in [({"eps_before_correction": eps}, True), ({}, False)]:
        p = torch.nn.Parameter(w.clone())
        opt = torch.optim.AdamW([{"params": [p], **key}], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
        for step, g in enumerate(grads):
            p.grad = g.clone() if p.grad is None else p.grad + g
            step_optimizers([opt], step, 2)
        # float64: the two forms agree to ~1e-17 on any machine, while torch's own placement ends ~lr off
        assert torch.allclose(p.detach(), ref, rtol=0, atol=1e-12 * lr) is near
    # the key gives every AdamW group the eps to place so
    adamw, _ = build_optimizers(gpt(), OptimConfig(name="muon", eps=eps, eps_before_correction=True))
    assert [g["eps_before_correction"] for g in adamw.param_groups] == [eps] * len(adamw.param_groups)
    adamw, _ = build_optimizers(gpt(), OptimConfig(name="muon"))
    assert not any("eps_before_correction" in g for g in adamw.param_groups)  # off: torch's own placement


def test_adam_every_1_steps_every_optimizer_and_drops_every_gradient():
    model = gpt()
    opts = build_optimizers(model, OptimConfig(name="muon", embed_lr=0.01, head_lr=0.01))
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    step_optimizers(opts, 0)
    assert all(p.grad is None and not torch.equal(p, w) for p, w in zip(model.parameters(), before) if p.ndim == 2)


@pytest.mark.parametrize("cfg", [OptimConfig(), OptimConfig(name="muon"), OptimConfig(name="muon", muon_gates=True)])
def test_adamw_params_are_those_build_optimizers_gives_adamw(cfg):
    model = get_model({**TINY, **MODERN, "attn_gate": True})
    adam = [p for opt in build_optimizers(model, cfg) if isinstance(opt, torch.optim.AdamW)
            for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, adamw_params(model, cfg))) == sorted(map(id, adam)) and adam


def test_adamw_steps_last_after_its_sync_and_only_on_its_steps():
    model = gpt()
    opts = build_optimizers(model, OptimConfig(name="muon", adam_every=2))
    muon_params = [p for g in opts[1].param_groups for p in g["params"]]
    started, seen = [], []

    def start() -> Callable[[], None]:  # before Muon's step: its gradients still there
        started.append(all(p.grad is not None for p in muon_params))
        return before_adam

    def before_adam() -> None:  # Muon has stepped (its gradients dropped), AdamW not yet (its gradients there)
        seen.append((all(p.grad is None for p in muon_params), all(p.grad is not None for p in adamw_params(
            model, OptimConfig(name="muon")))))
    for step in range(2):
        _loss(model, step).backward()
        step_optimizers(opts, step, 2, adam_sync=start)
        assert len(seen) == len(started) == step  # not at step 0, which is not AdamW's
    assert started == [True] and seen == [(True, True)]


def test_qk_pairs_split_the_qkv_group_by_pairs_of_heads():
    model = get_model({**TINY, **MODERN, "n_head": 4})  # head_dim 8, d = 32
    _, muon = build_optimizers(model, OptimConfig(name="muon", muon_qk_pairs=True))
    qkv = {id(b.attn.qkv.weight) for b in model.blocks}
    assert {id(p) for p in muon.param_groups[0]["params"]} == qkv
    assert muon.param_groups[0]["split"] == (16, 16, 16, 16, 32)
    assert muon.param_groups[1]["split"] == 1
    with pytest.raises(ValueError, match=r"optim.muon_qk_pairs pairs adjacent heads.*got 1"):
        build_optimizers(get_model({**TINY, "n_head": 1}), OptimConfig(name="muon", muon_qk_pairs=True))
    build_optimizers(get_model({**TINY, "n_head": 1}), OptimConfig(muon_qk_pairs=True))  # AdamW alone: no pairs


def test_the_mlp_fc_steps_at_muon_fc_lr_scale_times_muons_rate_in_a_group_of_its_own_only_when_set():
    model = get_model({**TINY, **MODERN})
    fc = {id(b.mlp.fc.weight) for b in model.blocks}
    _, plain = build_optimizers(model, OptimConfig(name="muon"))
    assert len(plain.param_groups) == 2  # saved optimizer states keep their groups
    _, muon = build_optimizers(model, OptimConfig(name="muon", muon_fc_lr_scale=2.0))
    qkv, rest, doubled = muon.param_groups
    assert {id(p) for p in doubled["params"]} == fc and not {id(p) for p in qkv["params"] + rest["params"]} & fc
    assert doubled["initial_lr"] == 2 * rest["initial_lr"] == 2 * OptimConfig().muon_lr
    # one step from the same gradients and no momentum: the fc moves twice as far, every other matrix as far
    moved = []
    for opt_cfg in (OptimConfig(name="muon", muon_momentum=0.0),
                    OptimConfig(name="muon", muon_momentum=0.0, muon_fc_lr_scale=2.0)):
        torch.manual_seed(0)
        m = get_model({**TINY, **MODERN})
        before = [p.detach().clone() for p in m.parameters()]
        x = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))
        m(x[:, :-1], x[:, 1:])[1].backward()
        build_optimizers(m, opt_cfg)[1].step()
        moved.append({name: p.detach() - b for (name, p), b in zip(m.named_parameters(), before) if p.ndim == 2})
    for name, delta in moved[0].items():
        torch.testing.assert_close(moved[1][name], (2 if ".mlp.fc." in name else 1) * delta, msg=name)


def test_record_46s_attention_matrices_take_normuon_by_columns_and_its_gates_are_muon_matrices():
    model = get_model({**TINY, **MODERN, "attn_gate": True, "smear": True, "value_embeds": 1, "ve_gate": True})
    attn = [b.attn for b in model.blocks]
    muon_gates = [a.gate.weight for a in attn] + [model.smear.gate.weight]
    adam, muon = build_optimizers(model, OptimConfig(name="muon", normuon_attn_columns=True, muon_gates=True))
    qkv, rest, proj = muon.param_groups
    assert {id(p) for p in qkv["params"]} == {id(a.qkv.weight) for a in attn} and qkv["normuon_columns"]
    assert {id(p) for p in proj["params"]} == {id(a.proj.weight) for a in attn} and proj["normuon_columns"]
    assert not rest["normuon_columns"] and {id(p) for p in muon_gates} <= {id(p) for p in rest["params"]}
    in_adam = {id(p) for g in adam.param_groups for p in g["params"]}
    assert not in_adam & {id(p) for p in muon_gates} and id(model.smear.lam) in in_adam
    assert all(id(a.ve_gate.weight) in in_adam for a in attn if a.ve_gate is not None)  # later records' gates
    assert {id(p) for p in param_roles(model, muon_gates=True)["matrix"]} == {id(p) for g in muon.param_groups
                                                                             for p in g["params"]}
    _, plain = build_optimizers(model, OptimConfig(name="muon"))
    assert len(plain.param_groups) == 2 and not any(g["normuon_columns"] for g in plain.param_groups)


def test_a_head_that_unties_later_is_its_own_adamw_parameter_in_the_head_group_from_the_start():
    model = get_model({**TINY, "untie_at": 0.5})
    adamw, _ = build_optimizers(model, OptimConfig(name="muon"))
    embed, head, _ = adamw.param_groups  # the embedding (as a shared head) at embed_lr, the head at head_lr after
    assert embed["params"][0] is model.wte.weight and embed["lr"] == 0.6
    assert len(head["params"]) == 1 and head["params"][0] is model.lm_head.weight and head["lr"] == 0.008


@pytest.mark.parametrize("adam_every, untied_at", [(1, 3), (2, 4), (3, 3)])
def test_the_untie_comes_at_its_progress_on_the_first_step_that_starts_with_no_adamw_gradients_held(
        adam_every, untied_at):
    """untie_at 0.5 of 6 steps: step 3, unless AdamW holds gradients then (adam_every 2: steps 2 and 3 add up
    for one AdamW step, so the untie waits for step 4)."""
    model = get_model({**TINY, "untie_at": 0.5})
    opts = build_optimizers(model, OptimConfig(name="muon", adam_every=adam_every))
    steps = []
    for step in range(6):
        untie_when_due(model, opts, step / 6, step, adam_every)
        steps.append(model.tied)
    assert steps.index(False) == untied_at and not any(steps[untied_at:])
    untie_when_due(get_model(TINY), opts, 1.0, 0)  # a shared head has nothing to untie
