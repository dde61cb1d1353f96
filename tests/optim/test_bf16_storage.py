"""optim.bf16_storage: record 46's bf16 tables, head, gates, their gradients and AdamW's moments, as fp32 tensors:
each step is the fp32 step of the same state, rounded where the record's values are bf16, and nothing else
changes."""
import copy

import torch

from optim.bf16_storage import stored_in_bf16
from optim.config import OptimConfig
from optim.groups import build_optimizers, set_lr, step_optimizers
from tests.optim.test_groups import _loss
from tests.workers.muon_worker import gpt

# record 46's optimizers: AdamW every other step, the attention and smear gates Muon's
RECORD = dict(name="muon", adam_every=2, muon_gates=True, embed_lr=0.3, head_lr=0.008, scalar_lr=0.04,
              muon_lr=0.023, normuon=True, ns_coefficients="polar_express", betas=[0.65, 0.95])
MODEL = dict(attn_gate=True, smear=True)


def in_bf16(t: torch.Tensor) -> bool:
    return torch.equal(t, t.bfloat16().float())


def test_the_tables_head_and_gates_are_stored_in_bf16_and_the_block_matrices_and_scalars_are_not():
    model = gpt(**MODEL)
    names = {id(p): n for n, p in model.named_parameters()}
    stored = sorted(names[id(p)] for p in stored_in_bf16(model))
    assert stored == sorted(n for n in names.values() if n.endswith(("wte.weight", "lm_head.weight", "gate.weight"))
                            or n.startswith("value_embeds."))
    assert any("gate" in n for n in stored) and not any("qkv" in n or "fc" in n for n in stored)


def test_each_step_is_the_fp32_step_rounded_where_the_record_stores_bf16():
    model = gpt(**MODEL)
    opts = build_optimizers(model, OptimConfig(**RECORD, bf16_storage=True))
    stored = {id(p) for p in stored_in_bf16(model)}
    assert all(in_bf16(p) for p in model.parameters() if id(p) in stored)  # the initial weights too
    assert not all(in_bf16(p) for p in model.parameters() if id(p) not in stored)
    for step in range(4):
        # the same state under plain fp32 optimizers, stepped on the same gradients and rounded here by hand
        plain = copy.deepcopy(model)
        for p, q in zip(model.parameters(), plain.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()  # AdamW's held ones; deepcopy drops them
        plain_opts = build_optimizers(plain, OptimConfig(**RECORD))
        for opt, twin in zip(opts, plain_opts):
            twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # loaded as is, the tensors would be shared
        adam, muon = plain_opts
        twins = {id(q) for p, q in zip(model.parameters(), plain.parameters()) if id(p) in stored}
        adam_steps = (step + 1) % RECORD["adam_every"] == 0
        for m, o in ((model, opts), (plain, plain_opts)):
            set_lr(o, 1.0, step)
            _loss(m, step).backward()
            if m is plain:  # the gradients the stepping optimizers read: the gates' (Muon's), AdamW's on its steps
                for q in (q for opt in plain_opts if opt is muon or adam_steps for g in opt.param_groups
                          for q in g["params"] if id(q) in twins and q.grad is not None):
                    q.grad.copy_(q.grad.bfloat16())
            step_optimizers(o, step, RECORD["adam_every"])
        with torch.no_grad():
            rounded = [p for p in plain.parameters() if id(p) in twins]
            rounded += [s[k] for s in adam.state.values() for k in ("exp_avg", "exp_avg_sq")]
            rounded += [s[k] for p, s in muon.state.items() if id(p) in twins for k in ("momentum_buffer",
                                                                                       "second_moment")]
            for t in rounded:
                t.copy_(t.bfloat16())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters())), step
        for opt, twin in zip(opts, plain_opts):
            for p, q in zip(opt.state.values(), twin.state.values()):
                assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p), step
    adam, muon = opts
    assert adam.state and all(in_bf16(s["exp_avg"]) and in_bf16(s["exp_avg_sq"]) for s in adam.state.values())
    gates = [p for p in muon.state if id(p) in stored]
    assert gates and all(in_bf16(muon.state[p][k]) for p in gates for k in ("momentum_buffer", "second_moment"))
    assert not all(in_bf16(s["momentum_buffer"]) for p, s in muon.state.items() if id(p) not in stored)
