"""optim.bf16_storage: record 46's bf16 tables, head, gates, their gradients and AdamW's moments, as fp32 tensors:
each step is the fp32 step of the same state, rounded where the record's values are bf16, the gradients of its bf16
weights add up in bf16, and nothing else changes."""
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


def bf16_add(total: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """`grad` rounded to bf16 and added to `total` in bf16 tensors (None: nothing yet), as fp32."""
    return (grad.bfloat16() if total is None else total.bfloat16() + grad.bfloat16()).float()


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
        held = {}  # the twins' gradients held for AdamW, set apart while this step's own are made
        for q in (q for q in plain.parameters() if id(q) in twins):
            held[id(q)], q.grad = q.grad, None
        for m, o in ((model, opts), (plain, plain_opts)):
            set_lr(o, 1.0, step)
            _loss(m, step).backward()
            if m is plain:  # the record's bf16 gradients: this step's rounded, added in bf16 to the held ones
                for q in (q for q in plain.parameters() if id(q) in twins and q.grad is not None):
                    q.grad = bf16_add(held[id(q)], q.grad)
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


def test_the_gradients_of_the_bf16_stored_weights_add_up_in_bf16_as_the_records_bf16_grads():
    """Five backwards with no step between (micro-steps, or steps whose gradients AdamW holds): a bf16-stored
    weight's gradient is the five gradients rounded to bf16 and added up in bf16 tensors, one by one; every other
    weight's their fp32 sum."""
    model = gpt(**MODEL)
    build_optimizers(model, OptimConfig(**RECORD, bf16_storage=True))
    alone = copy.deepcopy(model)  # the same weights, without the hooks: each backward's gradient on its own
    ids = {id(w) for w in stored_in_bf16(model)}
    stored = {id(q) for p, q in zip(model.parameters(), alone.parameters()) if id(p) in ids}
    totals, fp32 = {}, {}
    for i in range(5):
        _loss(model, i).backward()
        alone.zero_grad(set_to_none=True)
        _loss(alone, i).backward()
        for q in (q for q in alone.parameters() if q.grad is not None):
            fp32[id(q)] = q.grad + fp32.get(id(q), 0)
            if id(q) in stored:
                totals[id(q)] = bf16_add(totals.get(id(q)), q.grad)
    pairs = [(p, id(q)) for p, q in zip(model.parameters(), alone.parameters()) if p.grad is not None]
    assert {i for _, i in pairs} == set(fp32) and stored <= set(fp32)
    for p, i in pairs:
        assert torch.equal(p.grad, totals[i] if i in stored else fp32[i])
    assert any(not torch.equal(fp32[i].bfloat16().float(), totals[i]) for i in stored)  # the sums differ
