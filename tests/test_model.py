"""The GPT: config handling, shapes, padded vocabulary, every option trains, masks, checkpoint round trip."""
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import model.gpt
from model import GPTConfig, get_model
from model.optim import OptimConfig, build_optimizers, param_roles

TINY = dict(vocab_size=257, block_size=32, n_layer=4, n_head=2, n_embd=32)
MODERN = dict(rotary=True, norm="rmsnorm", qk_norm=True, activation="relu2", tie_embeddings=False,
              zero_init_proj=True, logit_softcap=15.0, value_embeds=2, unet_skips=True, bias=False)
OPTIONS = {  # each option alone on top of TINY, then all of them
    "baseline": {}, "rotary": dict(rotary=True), "rmsnorm": dict(norm="rmsnorm"), "qk_norm": dict(qk_norm=True),
    "relu2": dict(activation="relu2"), "untied": dict(tie_embeddings=False), "zero_init": dict(zero_init_proj=True),
    "softcap": dict(logit_softcap=15.0), "value_embeds": dict(value_embeds=1), "unet": dict(unet_skips=True),
    "no_bias": dict(bias=False), "window": dict(window=5), "doc_causal": dict(doc_causal=True, bos_id=0),
    "flex": dict(attention="flex", window=5, doc_causal=True, bos_id=0), "modern": MODERN,
}


def tiny(**overrides):
    torch.manual_seed(0)
    return get_model({**TINY, **overrides})


def batch(B=4, T=17, vocab=257, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_get_model_takes_full_config_or_model_section():
    full = {"data": {"seq_len": 16}, "train": {"steps": 3}, "model": TINY}
    torch.manual_seed(0)
    a = get_model(full)
    torch.manual_seed(0)
    b = get_model(dict(TINY))
    assert a.cfg == b.cfg == GPTConfig(**TINY)
    x = batch()
    torch.testing.assert_close(a(x)[0], b(x)[0], atol=0, rtol=0)


def test_defaults_are_gpt2_small():
    m = get_model({})
    assert m.cfg.padded_vocab == 50304 and m.lm_head.weight is m.wte.weight
    assert m.num_params() == 124_475_904  # nanoGPT's GPT-2 small with a 50304-row table, biases on


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n_embed', 'rope'\].*valid keys are.*'n_embd'"):
        get_model({"model": {**TINY, "n_embed": 64, "rope": True}})


@pytest.mark.parametrize("bad, message", [
    (dict(norm="batchnorm"), "norm='batchnorm'; use 'layernorm' or 'rmsnorm'"),
    (dict(n_head=3), "n_embd=32 must be a multiple of n_head=3"),
    (dict(value_embeds=3), r"value_embeds=3 needs 0 <= 2 \* value_embeds <= n_layer=4"),
    (dict(attention="flash"), "attention='flash'; use 'sdpa' or 'flex'"),
    (dict(n_layer="4"), "n_layer='4' must be of type int"),
    (dict(rotary=1), "rotary=1 must be of type bool"),
    (dict(window=True), "window=True must be of type int"),
])
def test_bad_values_are_explained(bad, message):
    with pytest.raises(ValueError, match=message):
        get_model({**TINY, **bad})


def test_toml_integer_for_a_float_key_is_accepted():
    assert get_model({**TINY, "logit_softcap": 15}).cfg.logit_softcap == 15.0


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


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="sequence length 40 exceeds model block_size=32"):
        tiny()(batch(T=40))


@pytest.mark.parametrize("vocab, padded", [(32000, 32000), (50257, 50304), (257, 384), (128, 128)])
def test_vocab_padding(vocab, padded):
    assert GPTConfig(vocab_size=vocab).padded_vocab == padded


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
    none, loss = m(x[:, :-1], x[:, 1:])
    assert none is None and loss.ndim == 0
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 257), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, by_hand)


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


def test_param_roles_cover_every_parameter_once():
    m = tiny(**MODERN)
    roles = param_roles(m)
    ids = [id(p) for ps in roles.values() for p in ps]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())
    assert all(p.ndim == 2 for p in roles["matrix"]) and len(roles["matrix"]) == 4 * 4
    assert roles["head"] == [m.lm_head.weight] and len(roles["embed"]) == 3
    adamw, muon = build_optimizers(m, OptimConfig(name="muon"))
    assert all(g["initial_lr"] == g["lr"] for opt in (adamw, muon) for g in opt.param_groups)
    assert {g["lr"] for g in adamw.param_groups} == {0.6, 0.008, 0.04}


def test_adamw_decays_only_matrices():
    m = tiny()
    (opt,) = build_optimizers(m, OptimConfig())
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    matrices = {id(p) for p in m.blocks.parameters() if p.ndim == 2}  # the tied head is the embedding
    assert {id(p) for p in decayed["params"]} == matrices
    assert len(decayed["params"]) + len(plain["params"]) == len(list(m.parameters()))


def _changed_positions(m, x, x2) -> list[int]:
    """Positions whose logits differ between inputs x and x2."""
    with torch.no_grad():
        diff = (m(x)[0] - m(x2)[0]).abs().amax(dim=(0, 2))
    return [t for t in range(x.size(1)) if diff[t] > 1e-5]


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_doc_causal_hides_earlier_documents(attention):
    m = tiny(doc_causal=True, bos_id=0, attention=attention, rotary=True, value_embeds=1)
    x = batch(B=2, T=20, seed=3).clamp(min=1)
    x[:, 0] = x[:, 9] = 0  # documents: positions 0-8, then 9-19
    x2 = x.clone()
    x2[:, 2:9] = (x[:, 2:9] + 7) % 256 + 1
    assert _changed_positions(m, x, x2) == list(range(2, 9))
    assert _changed_positions(tiny(rotary=True), x, x2) == list(range(2, 20))  # without the mask they leak


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_window_limits_the_receptive_field(attention):
    m = tiny(window=4, n_layer=2, attention=attention)
    x = batch(B=2, T=16, seed=4)
    x2 = x.clone()
    x2[:, 0] = (x[:, 0] + 1) % 257
    # each layer reaches 3 tokens further back, so 2 layers carry position 0 up to position 6
    assert _changed_positions(m, x, x2) == list(range(7))


@pytest.mark.skipif(model.gpt.flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("window, doc_causal", [(5, True), (0, True), (7, False)])
def test_flex_mask_equals_the_sdpa_fallback_mask(window, doc_causal):
    from torch.nn.attention.flex_attention import create_block_mask
    idx = batch(B=2, T=40, vocab=50, seed=6).clamp(min=1)
    idx[0, 10] = idx[1, 3] = idx[1, 25] = 0
    q, k, v = torch.randn(3, 2, 2, 40, 16, generator=torch.Generator().manual_seed(7)).unbind(0)
    # Uncompiled mask and eager flex: the CUDA path compiles both, which takes minutes on CPU.
    block_mask = create_block_mask(model.gpt.flex_mask_mod(idx, window, doc_causal, 0), 2, None, 40, 40, device="cpu")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        flex = model.gpt.flex_attention(q, k, v, block_mask=block_mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=model.gpt.attention_mask(idx, window, doc_causal, 0))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


@pytest.mark.skipif(model.gpt.flex_attention is None, reason="no FlexAttention in this torch")
def test_flex_gets_one_dtype_under_bf16_autocast(monkeypatch):
    # value embeddings (not autocast) made v fp32 beside bf16 q and k: FlexAttention of torch 2.6 refuses that
    from torch.nn.attention.flex_attention import create_block_mask
    m = tiny(attention="flex", window=8, doc_causal=True, bos_id=0, value_embeds=1, rotary=True, qk_norm=True)
    idx = batch(B=2, T=32).clamp(min=1)
    idx[:, 0] = 0
    block_mask = create_block_mask(model.gpt.flex_mask_mod(idx, 8, True, 0), 2, None, 32, 32, device="cpu")
    monkeypatch.setattr(m, "_mask", lambda idx: block_mask)  # what the CUDA path builds
    seen, flex = [], model.gpt.flex_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex(q, k, v, **kwargs)
    monkeypatch.setattr(model.gpt, "flex_attention", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        m(idx)
    assert seen == [(torch.bfloat16,) * 3] * TINY["n_layer"]


def test_flex_on_cpu_warns_once():
    m = tiny(attention="flex", window=4)
    model.gpt._warned_fallback = False
    with pytest.warns(UserWarning, match="attention='flex' has no backward on cpu") as record:
        m(batch())
        m(batch())
    assert len([w for w in record if "attention='flex'" in str(w.message)]) == 1


@pytest.mark.parametrize("options", ["baseline", "modern"])
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
    attention = 12 * 2 * 768 * 1024
    # norm gains/biases are the only non-matmul weights counted: under 0.1% here
    assert m.flops_per_token(1024) == pytest.approx(6 * linear + attention, rel=1e-3)
