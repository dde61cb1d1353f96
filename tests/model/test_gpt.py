"""The GPT as a whole: defaults, shapes, every option trains, init (also on the meta device), checkpoint round trip,
the speedrun configs' pieces, U-net skips and their gate, backout, the head that unties from the embedding, FLOPs, and
which optimizer each piece's parameters get."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import model.gpt
import model.masks
from model import GPTConfig, get_model
from model.masks import short_window, window_at
from optim.config import OptimConfig
from optim.groups import build_optimizers, param_roles
from tests.helpers import MODERN_GPT as MODERN
from tests.helpers import TINY_GPT as TINY
from tests.helpers import live_peak
from tests.model.tiny import RECORDS, batch, gates, sigmoid_of, tiny, train_tied
from trainer.clock import Clock
from trainer.config import parse_args

OPTIONS = {  # each option alone on top of TINY, then all of them
    "baseline": {}, "rotary": dict(rotary=True), "rmsnorm": dict(norm="rmsnorm"), "qk_norm": dict(qk_norm=True),
    "relu2": dict(activation="relu2"), "untied": dict(tie_embeddings=False), "zero_init": dict(zero_init_proj=True),
    "softcap": dict(logit_softcap=15.0), "value_embeds": dict(value_embeds=1), "unet": dict(unet_skips=True),
    "no_bias": dict(bias=False), "window": dict(window=5), "doc_causal": dict(doc_causal=True, bos_id=0),
    "flex": dict(attention="flex", window=5, doc_causal=True, bos_id=0), "modern": MODERN,
    "attn_scale": dict(attn_scale=0.12), "no_gain": dict(norm_gain=False), "embed_norm": dict(embed_norm=True),
    "x0_mix": dict(x0_mix=True), "rope_truncate": dict(rotary=True, rope_truncate=True, rope_base=1024.0),
    "window_schedule": dict(window=8, window_start=2, window_pattern="LSSL"), "records": RECORDS,
    "attn_gate": dict(attn_gate=True), "smear": dict(smear=True), "no_attention": dict(no_attention=[2]),
    "no_mlp": dict(no_mlp=[0]), "bigram_hash": dict(bigram_hash=500),
    "bigram_signs": dict(bigram_hash=500, bigram_dim=16, bigram_signs=True), "xsa": dict(xsa=[0, 3]),
    "ve_gate": dict(value_embeds=1, ve_gate=True), "skip_gate": dict(unet_skips=True, skip_gate=True),
    "backout": dict(backout=2), "yarn": dict(rotary=True, window=8, window_start=2, yarn=True),
    "mudd": dict(mudd=[1, 3], mudd_sources=[0, 1]), "uniform_init": dict(init="uniform"),
    "record_46": dict(x0_mix=True, x0_mix_init=1.1, value_embeds=1, value_embed_skip=1, value_scale=True,
                      skip_connection=[1, 2], tie_embeddings=False, embed_init_std=1.0),
    "newer_records": dict(RECORDS, attn_gate=True, smear=True, no_attention=[2], bigram_hash=500, bigram_dim=16,
                          bigram_signs=True, xsa=[1, 3], ve_gate=True, skip_gate=True, backout=3, yarn=True,
                          mudd=[0, 3], mudd_sources=[0, 2]),
}


def test_defaults_are_gpt2_small():
    m = get_model({})
    assert m.cfg.padded_vocab == 50304 and m.lm_head.weight is m.wte.weight
    assert m.num_params() == 124_475_904  # nanoGPT's GPT-2 small with a 50304-row table, biases on
    c = m.cfg  # the records' pieces are all off
    assert (c.attn_scale, c.norm_gain, c.embed_norm, c.x0_mix, c.rope_truncate) == (0.0, True, False, False, False)
    assert (c.window, c.window_start, c.window_pattern) == (0, 0, "")


def test_meta_device_build_then_reset_matches_a_normal_build():
    with torch.device("meta"):
        lazy = get_model({**TINY, **MODERN, "zero_init_proj": False})
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.reset_parameters()
    eager = get_model({**TINY, **MODERN, "zero_init_proj": False})
    torch.manual_seed(5)
    eager.reset_parameters()
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    with torch.device("meta"):
        lazy = get_model({**TINY, **RECORDS})
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()  # buffers are not parameters: the window must be set here too
    assert lazy.windows.tolist() == [8, 4] and all(b.x0_lambda.tolist() == [1.0, 0.0] for b in lazy.blocks)


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="sequence length 40 exceeds model block_size=32"):
        tiny()(batch(T=40))


@pytest.mark.parametrize("tie", [True, False])
def test_shapes_and_padded_ids_never_predicted(tie):
    m = tiny(tie_embeddings=tie)
    with torch.no_grad():  # make the padded rows the most likely ids if anything let them through
        m.lm_head.weight[257:] = 10 * m.lm_head.weight[:127].sign()
    head_out = []
    m.lm_head.register_forward_hook(lambda mod, inputs, out: head_out.append(out))
    x = batch()
    logits, loss = m(x)
    assert logits.shape == (4, 17, 257) and logits.dtype == torch.float32 and loss is None
    assert head_out[0].shape[-1] == 384 and (head_out[0].argmax(-1) >= 257).float().mean() > 0.5
    none, loss = m(x[:, :-1], x[:, 1:], keep_logits=False)  # train.py's step: no logits kept past the call
    assert none is None and loss.ndim == 0
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 257), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, by_hand)
    # an evaluator of the checkpoint contract gets the logits with the loss, in training mode too
    kept, same = m(x[:, :-1], x[:, 1:])
    assert torch.equal(kept, logits[:, :-1]) and torch.equal(same, loss)


def test_a_vocabulary_past_the_tokenizers_spans_the_softmax_as_the_records_padded_one():
    """vocab_size 384 on ids below 257 (the speedrun's 50,304 on GPT-2's 50,257): a zero head scores ln(384)."""
    m = tiny(vocab_size=384, zero_init_proj=True, tie_embeddings=False)
    assert m.cfg.padded_vocab == 384 and not m.lm_head.weight.any()
    x = batch()
    logits, _ = m(x)
    assert logits.shape == (4, 17, 384)
    assert m(x[:, :-1], x[:, 1:])[1].item() == pytest.approx(math.log(384), rel=1e-6)


def _train(m, optim: OptimConfig, steps: int) -> list[float]:
    opts = build_optimizers(m, optim)
    x = batch(T=17)
    losses = []
    for _ in range(steps):
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("optim", [OptimConfig(lr=3e-3),
                                   OptimConfig(name="muon", embed_lr=0.05, head_lr=0.01, scalar_lr=0.01)],
                         ids=["adamw", "muon"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_option_trains(option, optim):
    m = tiny(**OPTIONS[option])
    losses = _train(m, optim, steps=6)
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("options", ["baseline", "modern", "records", "newer_records", "record_46"])
def test_checkpoint_round_trip_gives_identical_logits(tmp_path, options):
    config = {"model": {**TINY, **OPTIONS[options]}, "train": {"steps": 1}}
    m = get_model(config)
    _train(m, OptimConfig(lr=1e-2), steps=2)  # move off the init (zero-init projections would hide errors)
    torch.save({"config": config, "model": m.state_dict(), "step": 2}, tmp_path / "checkpoint.pt")
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    loaded = get_model(ckpt["config"])
    loaded.load_state_dict(ckpt["model"])
    x = batch()
    torch.testing.assert_close(loaded(x)[0], m(x)[0], atol=0, rtol=0)
    assert not torch.equal(get_model(config)(x)[0], m(x)[0])


def test_flops_per_token_counts_matmul_weights():
    cfg = dataclasses.replace(GPTConfig(), n_layer=2)
    m = get_model(dataclasses.asdict(cfg))
    linear = sum(p.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear) for p in mod.parameters())
    attention = 12 * 2 * 768 * 1025 / 2  # causal: position p attends to p + 1 keys, 512.5 on average
    # norm gains/biases are the only non-matmul weights counted: under 0.1% here
    assert m.flops_per_token(1024) == pytest.approx(6 * linear + attention, rel=1e-3)


@pytest.mark.parametrize("options, window, T", [
    (dict(), None, 30), (dict(window=8), None, 30), (dict(window=64), None, 30),
    (dict(window=16, window_start=4, window_pattern="LSSL"), None, 30),
    (dict(window=16, window_start=4, window_pattern="LSSL"), 4, 30), (dict(window=8), 1, 5)])
def test_flops_per_token_counts_the_attended_keys(options, window, T):
    m = tiny(**{**options, "block_size": 64})
    m.set_progress(0.5)  # window 10 on the schedule
    idx = torch.zeros(1, T, dtype=torch.long)
    long = m.window if window is None else window
    pairs = 0  # the allowed (query, key) pairs of each layer's mask, counted one by one
    for kind in m.cfg.window_pattern or "L" * 4:
        w = (long if kind == "L" else long // 2) or T
        pairs += int(model.masks.attention_mask(idx, torch.tensor(w), False, 0).sum())
    tables = ("wte", "wpe", "value_embeds")  # lookups, no matmul; a tied head is listed again as lm_head
    weights = sum(p.numel() for name, p in m.named_parameters(remove_duplicate=False) if not name.startswith(tables))
    assert m.attention_flops_per_token(T, window) == pytest.approx(12 * 32 * pairs / T, rel=1e-12)
    assert m.flops_per_token(T, window) == pytest.approx(6 * weights + 12 * 32 * pairs / T, rel=1e-12)


@pytest.mark.parametrize("name", ["speedrun_8xh100", "speedrun_1gpu"])
def test_speedrun_configs_turn_the_records_pieces_on(name):
    # record 46 (2025-11-29_BatchSizeSchedule), as configs/speedrun_8xh100.toml's comments say
    cfg = parse_args(["--config", f"configs/{name}.toml"])
    m, t, o = cfg.model, cfg.train, cfg.optim
    assert (m.n_layer, m.no_attention, m.backout) == (11, [6], 8) and m.smear and m.attn_gate
    assert m.window_pattern == "SSSLSSSSSSL"
    assert m.yarn and m.attn_scale == 0.1 and m.x0_mix and m.embed_norm and not m.norm_gain
    assert m.rotary and m.rope_truncate and m.rope_base == 1024
    assert m.vocab_size == m.padded_vocab == 50304  # its softmax spans GPT-2's 50,257 ids and 47 never a target
    assert o.normuon and o.muon_cautious_wd and o.ns_coefficients == "polar_express" and o.adam_every == 2
    # its get_lr (tests/trainer/test_clock.py follows it step by step): flat, then down to 0.1 of the base rate
    # over the last 55% of the scheduled steps
    assert (t.lr_decay_frac, t.lr_final_frac, t.lr_final_of) == (0.55, 0.1, "base")
    # its get_ws: long windows of 3, 7, 11 blocks of 128 tokens by thirds of its 2,120 scheduled steps, 13 in the
    # 40 after them; short windows half as many blocks
    with torch.device("meta"):
        gpt = get_model(cfg.to_dict()["model"])
    clock = Clock(t)
    for step in range(t.steps):
        blocks = 13 if step >= 2120 else (3, 7, 11)[3 * step // 2120]
        long = window_at(gpt.cfg, clock.progress(step))
        assert (long, short_window(long, m.window_block)) == (128 * blocks, 128 * (blocks // 2)), step
    assert m.first_window == 384  # what YaRN stretches from, as the record's starts at 3 blocks
    assert cfg.eval.final_window == 2560  # its final eval: 20 blocks, the short ones and YaRN at 13's
    # its micro-batch: one document-masked row of 16,384 tokens per rank, x 1, 2, 3 micro-steps by thirds of the run
    assert (t.batch_size, t.seq_len, t.batch_stages) == (1, 16384, [1, 2, 3]) and m.block_size >= t.seq_len
    assert cfg.data.bos_aligned and m.doc_causal and m.attention == "flex"
    # its init and optimizer: one sigmoid skip from its block 4 to 7 (ours 3 to 6), x0 mix from 1.1, value tables
    # ". 1 2 ... 0 1 2" over its 12 blocks (block 0 empty), the values of the others scaled, tables N(0, 1), fc at
    # twice Muon's rate, decay with the rate squared, NorMuon by the attention's input columns, gates in NorMuon
    assert m.skip_connection == [3, 6] and m.x0_mix_init == 1.1 and m.embed_init_std == 1.0 and m.value_scale
    assert m.init == "uniform"  # q, k, v and fc U(-sqrt(3) s, sqrt(3) s) (tests/model/test_uniform_init.py)
    assert m.value_embed_layers == [0, 1, 8, 9, 10] and [m.layer_table(i) for i in (0, 1, 8, 9, 10)] == [1, 2, 0, 1, 2]
    assert o.muon_fc_lr_scale == 2.0 and o.muon_wd_lr_squared and o.normuon_attn_columns and o.muon_gates


# A block without one sublayer loses its weights and its norm, and is x plus the other one. C = 32, with biases:
# attention qkv and proj (3C^2 + 3C, C^2 + C), MLP fc and proj (4C^2 + 4C, 4C^2 + C), and a norm's gain and bias 2C.
def test_flops_per_token_drop_by_the_attention_of_the_layer_without_it():
    options = dict(window=8, window_pattern="LSSL", block_size=64)
    m, plain, T = tiny(**options, no_attention=[2]), tiny(**options), 30
    weights = 4 * 32 * 32 + 4 * 32 + 2 * 32  # qkv, proj and norm1 (see above)
    keys = int(model.masks.attention_mask(torch.zeros(1, T, dtype=torch.long), torch.tensor(4), False, 0).sum())
    # layer 2 is an S layer: window 4
    assert m.matmul_weights == plain.matmul_weights - weights
    assert m.flops_per_token(T) == pytest.approx(plain.flops_per_token(T) - 6 * weights - 12 * 32 * keys / T,
                                                 rel=1e-12)


def test_muon_splits_the_qkv_of_the_layers_with_attention_only():
    m = tiny(no_attention=[0, 3])
    _, muon = build_optimizers(m, OptimConfig(name="muon"))
    split, rest = muon.param_groups
    assert split["split"] == 3 and {id(p) for p in split["params"]} == {id(m.blocks[i].attn.qkv.weight) for i in (1, 2)}
    assert len(rest["params"]) == 2 + 2 * 4  # two attention projections, each block's two MLP matrices


def test_gates_and_the_smear_are_adamw_scalars_never_muon_matrices():
    m = tiny(attn_gate=True, smear=True, no_attention=[3])
    roles = param_roles(m)
    scalars = {id(p) for p in roles["scalar"]}
    assert len(gates(m)) == 3 + 1 and {id(p) for p in gates(m)} | {id(m.smear.lam)} <= scalars
    adam, muon = build_optimizers(m, OptimConfig(name="muon"))
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    assert not in_muon & scalars and len(in_muon) == 3 * 2 + 4 * 2  # attentions' qkv and proj, MLPs' fc and proj
    scalar_group = next(g for g in adam.param_groups if g["lr"] == OptimConfig().scalar_lr)
    assert {id(p) for p in gates(m)} <= {id(p) for p in scalar_group["params"]}
    decayed, _ = build_optimizers(m, OptimConfig())[0].param_groups
    assert not {id(p) for p in decayed["params"]} & scalars  # the AdamW recipe decays no gate


def _gates_and_smear_start_at_zero(m) -> bool:
    return all(not w.any() for w in gates(m)) and m.smear.lam.item() == 0.0


def _bigram_and_xsa_start_as_the_records(m) -> bool:
    alphas = [b.attn.xsa_alpha for b in m.blocks if b.attn is not None and b.attn.xsa_alpha is not None]
    lambdas = [b.bigram_lambda.item() for b in m.blocks]
    return (not m.bigram.weight.any() and set(m.bigram.signs.unique().tolist()) == {-1.0, 1.0} and len(alphas) == 2
            and lambdas == [pytest.approx(0.1)] * 4 and not any(a.any() for a in alphas))


def _value_and_skip_gates_and_backout_start_as_the_records(m) -> bool:
    # the attention gates, the smear's, the value embedding's (layers 0 and 3) and the skip gates
    return (len(gates(m)) == 3 + 1 + 2 + 1 and all(not w.any() for w in gates(m)) and m.smear.lam.item() == 0.0
            and m.backout_lambda.tolist() == [0.5])


# pieces that start at constants (and the sign patterns, drawn from their own generator): none draws from torch's.
# `base`: the options they need, which the plain model compared with has too
@pytest.mark.parametrize("pieces, base, start", [
    (dict(attn_gate=True, smear=True), {}, _gates_and_smear_start_at_zero),
    (dict(bigram_hash=50, bigram_dim=8, bigram_signs=True, xsa=[0, 2]), {}, _bigram_and_xsa_start_as_the_records),
    (dict(attn_gate=True, smear=True, ve_gate=True, skip_gate=True, backout=2), dict(value_embeds=1, unet_skips=True),
     _value_and_skip_gates_and_backout_start_as_the_records),
], ids=["gates-smear", "bigram-xsa", "ve-skip-gates-backout"])
def test_meta_device_build_then_reset_initialises_the_newer_pieces_without_a_random_draw(pieces, base, start):
    # untied, as the meta-device test above: to_empty unties a tied head (the head gets a weight of its own)
    options = {**TINY, "tie_embeddings": False, "no_attention": [1], **base, **pieces}
    with torch.device("meta"):
        lazy = get_model(options)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for p in [*lazy.parameters(), *(b for b in lazy.buffers() if b.is_floating_point())]:
            p.fill_(math.nan)  # what to_empty leaves is arbitrary: reset must write every value
    torch.manual_seed(5)
    lazy.reset_parameters()
    torch.manual_seed(5)
    eager = get_model(options)
    torch.manual_seed(5)
    eager.reset_parameters()
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert start(lazy)
    # every other weight is the plain model's
    plain = tiny(tie_embeddings=False, no_attention=[1], **base)
    torch.manual_seed(0)
    with_pieces = get_model(options).state_dict()
    for name, w in plain.state_dict().items():
        assert torch.equal(with_pieces[name], w), name


def test_bigram_table_is_an_embedding_and_its_lambdas_and_xsas_alphas_are_adamw_scalars():
    m = tiny(bigram_hash=100, xsa=[0, 2])
    roles = param_roles(m)
    scalars = [b.bigram_lambda for b in m.blocks] + [m.blocks[i].attn.xsa_alpha for i in (0, 2)]
    assert [id(p) for p in roles["embed"]].count(id(m.bigram.weight)) == 1
    assert {id(p) for p in scalars} <= {id(p) for p in roles["scalar"]}
    adam, muon = build_optimizers(m, OptimConfig(name="muon"))
    rate = {id(p): g["lr"] for g in adam.param_groups for p in g["params"]}
    assert rate[id(m.bigram.weight)] == OptimConfig().embed_lr and {rate[id(p)] for p in scalars} == {
        OptimConfig().scalar_lr}
    assert not {id(p) for g in muon.param_groups for p in g["params"]} & set(rate)


def test_flops_per_token_count_no_matmul_for_the_bigram_table_or_xsa():
    plain, m = tiny(), tiny(bigram_hash=100, xsa=[1])
    # a lookup and elementwise work: only the lambdas (one a block) and alphas (one a head) join matmul_weights, as
    # every learned scalar does
    assert m.matmul_weights == plain.matmul_weights + 4 + 2
    assert m.flops_per_token(16) == plain.flops_per_token(16) + 6 * (4 + 2)


def test_the_cpu_config_trains_with_the_bigram_table_and_xsa():
    cfg = parse_args(["--config", "configs/cpu.toml", "--train.plan=false", "--model.vocab_size=257",  # 4 layers
                      "--model.bigram_hash=1921", "--model.bigram_dim=32", "--model.bigram_signs=true",
                      "--model.xsa=[1, 3]"])
    torch.manual_seed(0)
    m = get_model(dataclasses.asdict(cfg.model))
    losses = _train(m, cfg.optim, steps=8)
    assert losses[-1] < losses[0] - 0.1, losses
    assert m.bigram.weight.any() and all(m.blocks[i].attn.xsa_alpha.any() for i in (1, 3))  # both learn


@pytest.mark.parametrize("key, options", [("ve_gate", dict(value_embeds=2)), ("skip_gate", dict(unet_skips=True))])
def test_ve_and_skip_gates_start_at_one_so_the_model_starts_unchanged(key, options):
    m, plain = tiny(**options, **{key: True}, rotary=True), tiny(**options, rotary=True)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == (
        [f"blocks.{i}.attn.ve_gate.weight" for i in range(4)] if key == "ve_gate" else ["skip_gate.weight"])
    assert all(not w.any() for w in gates(m))  # 2 sigmoid(0) = 1, exactly
    idx = batch()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=0, rtol=0)


def test_skip_gate_scales_skip_j_by_twice_the_sigmoid_of_the_embedding():
    m = tiny(unet_skips=True, skip_gate=True)
    assert m.skip_gate.weight.shape == (2, 12)  # one gate per skip
    g = torch.Generator().manual_seed(9)
    idx = batch(B=1, T=3)
    seen = {}
    for i, block in enumerate(m.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.update({f"in{i}": args[0], "x0": args[1]}))
        block.register_forward_hook(lambda mod, args, out, i=i: seen.update({f"out{i}": out}))
    with torch.no_grad():
        m.skip_weights.copy_(torch.tensor([0.7, -1.3]))
        m.skip_gate.weight.copy_(torch.randn(2, 12, generator=g))
        m(idx)
        # block 2 adds block 1's output (skip 0), block 3 block 0's (skip 1)
        for j, (i, source) in enumerate([(2, 1), (3, 0)]):
            for t in range(3):
                gate = 2 * sigmoid_of(m.skip_gate.weight[j], seen["x0"][0, t, :12].tolist())
                expected = seen[f"out{i - 1}"][0, t] + m.skip_weights[j] * gate * seen[f"out{source}"][0, t]
                torch.testing.assert_close(seen[f"in{i}"][0, t], expected)


def test_the_skip_connection_adds_sigmoid_w_times_block_as_output_to_block_bs_input():
    m, plain = tiny(skip_connection=[0, 2]), tiny()
    assert m.skip_lambda.tolist() == [-1.5]  # sigmoid(-1.5) ~ 0.18 at init
    for name, w in plain.state_dict().items():  # every other weight drawn as without it
        assert torch.equal(m.state_dict()[name], w), name
    assert [p is m.skip_lambda for p in param_roles(m)["scalar"]].count(True) == 1
    idx = batch()
    with torch.no_grad():
        m.skip_lambda.fill_(0.3)
        x = x0 = m.embed(idx)
        for i, block in enumerate(m.blocks):
            if i == 2:
                x = x + 1 / (1 + math.exp(-0.3)) * out0
            x = block(x, x0, None, None)
            if i == 0:
                out0 = x
        torch.testing.assert_close(m(idx)[0], m.logits(x))
        assert not torch.allclose(plain(idx)[0], m(idx)[0])


@pytest.mark.parametrize("n_layer, skip, tables", [
    (7, 1, {0: 1, 1: 2, 4: 0, 5: 1, 6: 2}),  # record 46's ". 1 2 ... 0 1 2" over its 8 blocks, block 0 empty
    (7, 0, {0: 0, 1: 1, 2: 2, 4: 0, 5: 1, 6: 2}),  # the first and the last 3 layers
    (6, 3, {3: 0, 4: 1, 5: 2}),  # the last layers alone
])
def test_value_embed_skip_gives_the_first_layers_the_tables_from_it_on(n_layer, skip, tables):
    m = tiny(n_layer=n_layer, value_embeds=3, value_embed_skip=skip)
    assert m.cfg.value_embed_layers == sorted(tables)
    assert [b.attn.ve_lambda is not None for b in m.blocks] == [i in tables for i in range(n_layer)]
    seen = {}
    for i, block in enumerate(m.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.update({i: args[2]}))
    idx = batch()
    with torch.no_grad():
        m(idx)
    for i in range(n_layer):
        assert (seen[i] is None) if i not in tables else torch.equal(seen[i], m.value_embeds[tables[i]](idx)), i


def test_embed_init_std_draws_the_token_and_value_tables_at_it_and_every_other_weight_as_before():
    options = dict(tie_embeddings=False, value_embeds=1)
    m, plain = tiny(**options, embed_init_std=1.0), tiny(**options)
    for name, w in plain.state_dict().items():
        if name.startswith(("wte", "value_embeds")):  # the same draws, scaled: N(0, 1) / N(0, 0.02)
            torch.testing.assert_close(m.state_dict()[name], w / 0.02)
            assert 0.9 < m.state_dict()[name].std() < 1.1
        else:
            assert torch.equal(m.state_dict()[name], w), name


def test_ve_and_skip_gates_are_adamw_scalars():
    m = tiny(value_embeds=1, ve_gate=True, unet_skips=True, skip_gate=True)
    scalars = {id(p) for p in param_roles(m)["scalar"]}
    assert len(gates(m)) == 2 + 1 and {id(p) for p in gates(m)} <= scalars
    adam, muon = build_optimizers(m, OptimConfig(name="muon"))
    assert not {id(p) for group in muon.param_groups for p in group["params"]} & scalars


def test_backout_takes_lambda_times_the_embedding_back_when_every_block_adds_nothing():
    # zero output projections (and biases): every block is the identity, so the residual is the embedding x0
    # throughout, and the head reads (1 - lambda) x0
    m = tiny(backout=2, zero_init_proj=True)
    assert m.backout_lambda.tolist() == [0.5]
    idx = batch()
    seen = []
    m.norm_f.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        for lam in (0.5, 0.25, 1.5):
            m.backout_lambda.fill_(lam)
            m(idx)
            x0 = m.wte(idx) + m.wpe(torch.arange(idx.size(1)))
            torch.testing.assert_close(seen.pop(), (1 - lam) * x0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_backout_subtracts_lambda_times_the_residual_after_the_first_k_blocks(k):
    m = tiny(backout=k, unet_skips=True, rotary=True)
    seen = {}
    for i, block in enumerate(m.blocks):
        block.register_forward_hook(lambda mod, args, out, i=i: seen.update({i: out}))
    m.norm_f.register_forward_pre_hook(lambda mod, args: seen.update(head=args[0]))
    with torch.no_grad():
        m.backout_lambda.fill_(0.3)
        m(batch())
        torch.testing.assert_close(seen["head"], seen[3] - 0.3 * seen[k - 1], atol=0, rtol=0)
        plain = tiny(unet_skips=True, rotary=True)
        assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == ["backout_lambda"]
        m.backout_lambda.zero_()
        torch.testing.assert_close(m(batch())[0], plain(batch())[0], atol=0, rtol=0)
    assert [p is m.backout_lambda for p in param_roles(m)["scalar"]].count(True) == 1  # AdamW's, not Muon's


def test_a_head_that_unties_later_starts_as_the_tied_one_with_a_shared_matrixs_gradient():
    """Two parameters, equal to the shared matrix at init (the same random draws); the head's gradient added to
    the embedding's is bit for bit what the shared matrix gets, and the head is left without one."""
    x = batch()
    tied, later = tiny(), tiny(untie_at=0.5)
    assert later.lm_head.weight is not later.wte.weight and later.tied
    assert torch.equal(later.wte.weight, tied.wte.weight) and torch.equal(later.lm_head.weight, tied.wte.weight)
    for m in (tied, later):
        m(x[:, :-1], x[:, 1:])[1].backward()
    later.tie_grads()
    assert torch.equal(later.wte.weight.grad, tied.wte.weight.grad) and later.lm_head.weight.grad is None
    # a head of its own counts once in the FLOPs (it is the same matmul) and once more in the parameters
    assert later.flops_per_token(16) == tied.flops_per_token(16)
    assert later.num_params() == tied.num_params() + later.lm_head.weight.numel()


@pytest.mark.parametrize("optim", [OptimConfig(lr=3e-3), OptimConfig(name="muon", embed_lr=0.05, head_lr=0.05)],
                         ids=["adamw", "muon"])
def test_until_the_untie_training_is_the_tied_models_bit_for_bit_and_after_it_they_part(optim):
    tied, later = tiny(), tiny(untie_at=0.5)
    opts = build_optimizers(later, optim)
    assert train_tied(later, opts, 3) == _train(tied, optim, 3)
    assert torch.equal(later.wte.weight, tied.wte.weight) and torch.equal(later.lm_head.weight, tied.wte.weight)
    adamw = opts[0]
    assert later.lm_head.weight not in adamw.state  # the head had no step of its own yet
    train_tied(later, opts, 1, untie_at=0)
    head, embed = adamw.state[later.lm_head.weight], adamw.state[later.wte.weight]
    assert not later.tied and int(later.head_tied) == 0
    moved = (later.lm_head.weight - later.wte.weight).abs().amax()
    assert moved > 0 and not torch.equal(head["exp_avg"], embed["exp_avg"])  # each on its own gradient now
    assert int(head["step"]) == int(embed["step"]) == 4  # the step count (bias correction) went on from the tie


def test_at_the_untie_the_head_takes_the_embeddings_weights_and_a_copy_of_its_adamw_state():
    from optim.groups import untie_head

    m = tiny(untie_at=0.5)
    (adamw,) = build_optimizers(m, OptimConfig(lr=3e-3))
    train_tied(m, [adamw], 2)
    embed = {k: v.clone() for k, v in adamw.state[m.wte.weight].items()}
    with torch.no_grad():
        m.lm_head.weight.zero_()  # whatever the head holds, the untie gives it the embedding's weights
    untie_head(m, [adamw])
    assert torch.equal(m.lm_head.weight, m.wte.weight)
    head = adamw.state[m.lm_head.weight]
    assert head.keys() == embed.keys() and all(torch.equal(head[k], embed[k]) for k in embed)
    assert all(head[k].data_ptr() != adamw.state[m.wte.weight][k].data_ptr() for k in embed)  # copies


@pytest.mark.parametrize("steps", [1, 3])
def test_a_checkpoint_before_or_after_the_untie_loads_into_get_model(tmp_path, steps):
    config = {"model": {**TINY, "untie_at": 0.5}}
    m = get_model(config)
    opts = build_optimizers(m, OptimConfig(lr=1e-2))
    train_tied(m, opts, steps, untie_at=2)
    torch.save({"config": config, "model": m.state_dict(), "step": steps}, tmp_path / "checkpoint.pt")
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    loaded = get_model(ckpt["config"])
    assert loaded.tied
    loaded.load_state_dict(ckpt["model"])
    assert loaded.tied == (steps < 3) and torch.equal(loaded.lm_head.weight, loaded.wte.weight) == (steps < 3)
    x = batch()
    torch.testing.assert_close(loaded(x)[0], m(x)[0], atol=0, rtol=0)


def test_a_head_that_unties_built_on_the_meta_device_resets_tied():
    with torch.device("meta"):
        lazy = get_model({**TINY, "untie_at": 0.5, "mtp_weights": [1.0, 0.5]})
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.reset_parameters()
    assert lazy.tied and int(lazy.head_tied) == 1 and torch.equal(lazy.lm_head.weight, lazy.wte.weight)
    assert lazy.loss_weights.tolist() == [1.0, 0.0]


def test_an_eval_scores_its_targets_a_chunk_at_a_time_so_its_memory_does_not_grow_with_the_sequence():
    """A 262,144-token eval sequence's whole logits would be 50 GB of fp32 at GPT-2's vocabulary: without gradients
    the head and loss run LOSS_CHUNK tokens at a time, so the peak is a few chunks' logits however long the
    sequence (measured: 3.5 chunks' worth, the softcap's and log-softmax's copies; the whole sequence's at once
    would be 3.5 times its logits), and the mean is the whole sequence's."""
    m = tiny(rotary=True, logit_softcap=15.0).eval()
    chunk_logits = model.gpt.LOSS_CHUNK * 257 * 4
    for chunks in (2, 4):
        T = chunks * model.gpt.LOSS_CHUNK - 5  # the last chunk a short one
        x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(chunks))
        targets = torch.randint(0, 257, (1, T), generator=torch.Generator().manual_seed(chunks))
        targets[0, :7] = -100  # padding is left out of the sum and the count
        with torch.no_grad():
            peak = live_peak(lambda: m.head_loss(x, targets, keep_logits=False))
            _, loss = m.head_loss(x, targets, keep_logits=False)
            whole = F.cross_entropy(m.logits(x).reshape(-1, 257), targets.reshape(-1), ignore_index=-100)
        assert peak <= 4 * chunk_logits, (chunks, peak / chunk_logits)
        torch.testing.assert_close(loss, whole)
