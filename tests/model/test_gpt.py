"""The GPT: defaults, shapes, every option trains, masks, the records' pieces (also the newer ones: blocks without
attention, the attention, value-embedding and skip gates, the smear, the bigram hash embedding and its sign trick,
XSA, backout, YaRN, the loss's later-token and prefix-token terms, the head that unties from the embedding, MUDD
connections),
checkpoint round trip, FLOPs."""
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import model.gpt
from model import GPTConfig, get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers, param_roles
from tests.helpers import MODERN_GPT as MODERN, TINY_GPT as TINY
from trainer.clock import lr_multiplier
from trainer.config import parse_args

RECORDS = dict(MODERN, attn_scale=0.12, norm_gain=False, embed_norm=True, x0_mix=True, rope_truncate=True,
               rope_base=1024.0, window=8, window_start=2, window_pattern="LSSL", doc_causal=True, bos_id=0)
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
    "mudd": dict(mudd=[1, 3], mudd_sources=[0, 1]),
    "newer_records": dict(RECORDS, attn_gate=True, smear=True, no_attention=[2], bigram_hash=500, bigram_dim=16,
                          bigram_signs=True, xsa=[1, 3], ve_gate=True, skip_gate=True, backout=3, yarn=True,
                          mudd=[0, 3], mudd_sources=[0, 2]),
}


def tiny(**overrides):
    torch.manual_seed(0)
    return get_model({**TINY, **overrides})


def batch(B=4, T=17, vocab=257, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


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
@pytest.mark.parametrize("window, pattern, progress, reach", [
    (4, "", 1.0, 6),    # each layer reaches 3 tokens further back: 2 layers carry position 0 to position 6
    (8, "SS", 1.0, 6),  # S layers: half the window
    (8, "LS", 1.0, 10),
    (8, "", 0.0, 6),    # window_start=4 at the start of training,
    (8, "", 0.5, 10),   # 6 halfway,
    (8, "", 1.0, 14),   # the full window at the end
])
def test_window_limits_the_receptive_field(attention, window, pattern, progress, reach):
    m = tiny(window=window, window_pattern=pattern, window_start=4 if window == 8 and not pattern else 0,
             n_layer=2, attention=attention)
    m.set_progress(progress)
    x = batch(B=2, T=20, seed=4)
    x2 = x.clone()
    x2[:, 0] = (x[:, 0] + 1) % 257
    assert _changed_positions(m, x, x2) == list(range(reach + 1))


def test_window_schedule_sets_each_layers_mask():
    m = tiny(window=16, window_start=4, window_pattern="LSSL", doc_causal=True, bos_id=0)
    idx = batch(B=2, T=20).clamp(min=1)
    idx[:, 5] = 0
    for progress, long in [(0.0, 4), (0.5, 10), (1.0, 16), (2.0, 16), (-1.0, 4)]:
        m.set_progress(progress)
        assert m.window == long == m.window_at(progress) and m.windows.tolist() == [long, long // 2]
        for mask, kind in zip(m._masks(idx), "LSSL"):
            expected = model.gpt.attention_mask(idx, torch.tensor(long if kind == "L" else long // 2), True, 0)
            assert torch.equal(mask, expected)
    assert tiny(window=16, window_start=4).window == 16  # a fresh model (a loaded checkpoint): the final window
    # the records' 12-letter pattern on 4 layers, "LS" on 6: repeated or cut, so n_layer can change alone
    assert [tiny(window=16, window_pattern=p, n_layer=n).cfg.layer_windows
            for p, n in [("LSSSLSSLSSSL", 4), ("LS", 6), ("", 3)]] == ["LSSS", "LSLSLS", "LLL"]
    assert tiny(window=16, window_pattern="S" * 4, window_start=1).windows.tolist() == [16, 8]
    m = tiny(window=16, window_pattern="S" * 4, window_start=1)
    m.set_progress(0.0)
    assert m.windows.tolist() == [1, 1]  # a short window never reaches 0 (a query must see itself)


def hand_attention(att, x: torch.Tensor, scale: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of `att` on x [B, T, C] (logit scale `scale`, 0 = 1/sqrt(D); the allowed pairs `mask`), head
    by head, before the output projection: [B, H, T, D]."""
    B, T, C = x.shape
    H = att.cfg.n_head
    q, k, v = att.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
    logits = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(C // H))
    return logits.masked_fill(~allowed, -math.inf).softmax(-1) @ v


def joined(y: torch.Tensor) -> torch.Tensor:
    """Heads [B, H, T, D] side by side: [B, T, H * D], the output projection's input."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("scale", [0.0, 0.12])
@pytest.mark.parametrize("windowed", [False, True])
def test_attn_scale_multiplies_the_attention_logits(scale, windowed):
    m = tiny(attn_scale=scale)
    att, (B, T) = m.blocks[0].attn, (2, 9)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2))
    idx = batch(B=B, T=T)
    mask = model.gpt.attention_mask(idx, torch.tensor(4), False, 0) if windowed else None
    with torch.no_grad():
        torch.testing.assert_close(att(x, None, mask, None), att.proj(joined(hand_attention(att, x, scale, mask))))


def test_embed_norm_and_x0_mix_feed_the_normalised_embedding_to_every_block():
    x = batch()
    inputs = []
    for embed_norm in (False, True):
        m = tiny(embed_norm=embed_norm, rotary=True)
        m.blocks[0].register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
        with torch.no_grad():
            m(x)
            embed = m.wte(x)
        assert torch.equal(inputs.pop(), F.rms_norm(embed, (32,)) if embed_norm else embed)
    m = tiny(x0_mix=True, embed_norm=True, rotary=True)
    plain = tiny(embed_norm=True, rotary=True)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == [
        f"blocks.{i}.x0_lambda" for i in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], plain(x)[0], atol=0, rtol=0)  # (1, 0) at init: no change
        m.blocks[2].x0_lambda.copy_(torch.tensor([0.5, 2.0]))
        seen = {}
        m.blocks[2].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0], x0=args[1]))
        m.blocks[2].norm1.register_forward_pre_hook(lambda mod, args: seen.update(mixed=args[0]))
        m(x)
    assert torch.equal(seen["x0"], F.rms_norm(m.wte(x), (32,)))
    torch.testing.assert_close(seen["mixed"], 0.5 * seen["x"] + 2.0 * seen["x0"])
    assert [p is m.blocks[2].x0_lambda for p in param_roles(m)["scalar"]].count(True) == 1  # Adam, not Muon


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


def test_rope_truncate_rotates_half_of_each_head(monkeypatch):
    D, base, T = 16, 1024.0, 7
    freqs = model.gpt.rotary_frequencies(D, base, truncate=True)
    torch.testing.assert_close(freqs, torch.tensor([1.0, 1024 ** (-1 / 3), 1024 ** (-2 / 3), 1 / 1024, 0, 0, 0, 0]))
    x = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(3))
    y = model.gpt.rotary(x, freqs)
    unrotated = list(range(4, 8)) + list(range(12, 16))
    assert torch.equal(y[..., unrotated], x[..., unrotated]) and torch.equal(y[..., 0, :], x[..., 0, :])
    # pair j is (dim j, dim j + 8): pair 0 turns by one radian per position, pair 3 by 1/1024
    for pair, freq in [(0, 1.0), (3, 1 / 1024)]:
        turned = torch.atan2(y[0, 0, :, pair + 8], y[0, 0, :, pair]) - torch.atan2(x[0, 0, :, pair + 8], x[0, 0, :, pair])
        torch.testing.assert_close(torch.remainder(turned, 2 * math.pi),
                                   torch.remainder(torch.arange(T) * freq, 2 * math.pi), atol=1e-5, rtol=0)
    full = model.gpt.rotary(x, model.gpt.rotary_frequencies(D, base, truncate=False))
    assert not torch.equal(full[..., 1:, unrotated], x[..., 1:, unrotated])  # the default rotates every pair
    calls, rotary = [], model.gpt.rotary
    monkeypatch.setattr(model.gpt, "rotary", lambda x, f, gain=None: calls.append((f, gain)) or rotary(x, f, gain))
    tiny(rotary=True, rope_truncate=True, rope_base=1024.0)(batch())
    assert len(calls) == 2 * 4  # q and k of every layer
    assert all(torch.equal(f, model.gpt.rotary_frequencies(16, 1024.0, True)) and gain is None for f, gain in calls)


def test_one_long_document_masked_sequence_scores_each_document_as_if_alone():
    # the records' batches: documents packed back to back into one long sequence, never attending to each other
    m = tiny(**{**RECORDS, "block_size": 64})
    docs = [batch(B=1, T=n, seed=n)[0].clamp(min=1) for n in (7, 20, 12)]
    for d in docs:
        d[0] = 0
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        logits, start = m(packed)[0][0], 0
        for d in docs:
            torch.testing.assert_close(logits[start:start + len(d)], m(d[None])[0][0], atol=2e-5, rtol=0)
            start += len(d)


def _listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A BlockMask's (counts [B, 1, n], indices [B, 1, n, n]) as a dense [B, n, n] bool of the listed tiles."""
    n = indices.shape[-1]
    dense = torch.zeros(counts.shape[0], n, n, dtype=torch.bool)
    for b in range(dense.shape[0]):
        for i in range(n):
            dense[b, i, indices[b, 0, i, :counts[b, 0, i]].long()] = True
    return dense


def _window(w):
    return None if w is None else torch.tensor(w)


@pytest.mark.skipif(model.gpt.flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("window, doc_causal", [(5, True), (None, True), (7, False), (13, True), (None, False)])
def test_flex_block_mask_tiles_follow_the_dense_mask(window, doc_causal):
    # 8-token tiles over 45 tokens (a ragged last tile), so every kind of tile occurs; compiled FlexAttention
    # skips tiles left out and runs full tiles without the mask, so both must be exactly right
    T, block = 45, 8
    idx = batch(B=2, T=T, vocab=50, seed=6).clamp(min=1)
    idx[0, 10] = idx[0, 11] = idx[1, 3] = idx[1, 25] = 0
    dense = model.gpt.attention_mask(idx, _window(window), doc_causal, 0)[:, 0]
    n = -(-T // block)
    padded = torch.zeros(2, n * block, n * block, dtype=torch.bool)
    padded[:, :T, :T] = dense
    tiles = padded.view(2, n, block, n, block).transpose(2, 3)
    real = torch.zeros(n * block, dtype=torch.bool)
    real[:T] = True
    real_pairs = (real[:, None] & real[None, :]).view(n, block, n, block).transpose(1, 2)
    some, every = tiles.any(dim=(-1, -2)), (tiles | ~real_pairs).all(dim=(-1, -2))
    bm = model.gpt.flex_block_mask(idx, _window(window), doc_causal, 0, block=block)
    # without documents one mask serves every row of the batch
    full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices).expand_as(some)
    partial = _listed(bm.kv_num_blocks, bm.kv_indices).expand_as(some)
    assert bm.seq_lengths == (T, T) and not (full & partial).any()
    assert torch.equal(full, every)                     # no pair of a full tile is masked
    assert not (some & ~(full | partial)).any()         # no allowed pair lies in a skipped tile
    if not doc_causal:
        assert torch.equal(partial, some & ~every)      # exact without documents
    assert (partial & ~some).sum() <= 0.1 * partial.sum()  # with them: a bound, nearly tight


@pytest.mark.skipif(model.gpt.flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("window, doc_causal", [(5, True), (None, True), (7, False)])
def test_flex_mask_mod_equals_the_sdpa_fallback_mask(window, doc_causal):
    idx = batch(B=2, T=40, vocab=50, seed=6).clamp(min=1)
    idx[0, 10] = idx[1, 3] = idx[1, 25] = 0
    q, k, v = torch.randn(3, 2, 2, 40, 16, generator=torch.Generator().manual_seed(7)).unbind(0)
    block_mask = model.gpt.flex_block_mask(idx, _window(window), doc_causal, 0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        flex = model.gpt.flex_attention(q, k, v, block_mask=block_mask, scale=0.3)
    mask = model.gpt.attention_mask(idx, _window(window), doc_causal, 0)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


@pytest.mark.skipif(model.gpt.flex_attention is None, reason="no FlexAttention in this torch")
def test_flex_gets_one_dtype_under_bf16_autocast(monkeypatch):
    # value embeddings (not autocast) made v fp32 beside bf16 q and k: FlexAttention of torch 2.6 refuses that
    m = tiny(attention="flex", window=8, doc_causal=True, bos_id=0, value_embeds=1, rotary=True, qk_norm=True)
    idx = batch(B=2, T=32).clamp(min=1)
    idx[:, 0] = 0
    monkeypatch.setattr(model.gpt, "flex_available", lambda device: True)  # the CUDA path (forward only on CPU)
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


@pytest.mark.parametrize("options", ["baseline", "modern", "records", "newer_records"])
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
        pairs += int(model.gpt.attention_mask(idx, torch.tensor(w), False, 0).sum())
    tables = ("wte", "wpe", "value_embeds")  # lookups, no matmul; a tied head is listed again as lm_head
    weights = sum(p.numel() for name, p in m.named_parameters(remove_duplicate=False) if not name.startswith(tables))
    assert m.flops_per_token(T, window) == pytest.approx(6 * weights + 12 * 32 * pairs / T, rel=1e-12)


@pytest.mark.parametrize("name", ["speedrun_8xh100", "speedrun_1gpu"])
def test_speedrun_configs_turn_the_records_pieces_on(name):
    # record 46 (2025-11-29_BatchSizeSchedule), as configs/speedrun_8xh100.toml's comments say
    cfg = parse_args(["--config", f"configs/{name}.toml"])
    m, t, o = cfg.model, cfg.train, cfg.optim
    assert (m.n_layer, m.no_attention, m.backout) == (11, [6], 8) and m.smear and m.attn_gate
    assert (m.window_start, m.window, m.window_pattern) == (384, 1408, "SSSLSSSSSSL")
    assert m.yarn and m.attn_scale == 0.1 and m.x0_mix and m.embed_norm and not m.norm_gain
    assert m.rotary and m.rope_truncate and m.rope_base == 1024
    assert o.normuon and o.muon_cautious_wd and o.ns_coefficients == "polar_express" and o.adam_every == 2
    # its get_lr: each batch stage's rate, flat, then linear over the last 55% of the run down to 0.1 of the first
    # stage's rate
    assert lr_multiplier(0.45, t.lr_warmup_frac, t.lr_decay_frac, t.lr_final_frac) == pytest.approx(1.0)
    assert t.lr_decay_frac == 0.55
    assert t.batch_stage_lr[-1] * t.lr_final_frac == pytest.approx(0.1, abs=1e-3)
    # 8 document-masked rows of 2,048 tokens per rank and micro-step, x 1, 2, 3 micro-steps by thirds of the run
    assert (t.batch_size, t.seq_len, t.batch_stages) == (8, 2048, [1, 2, 3]) and m.block_size >= t.seq_len
    assert cfg.data.bos_aligned and m.doc_causal and m.attention == "flex"


# A block without one sublayer loses its weights and its norm, and is x plus the other one. C = 32, with biases:
# attention qkv and proj (3C^2 + 3C, C^2 + C), MLP fc and proj (4C^2 + 4C, 4C^2 + C), and a norm's gain and bias 2C.
@pytest.mark.parametrize("key, gone, kept, lost", [
    ("no_attention", ("attn", "norm1"), ("mlp", "norm2"), 4 * 32 * 32 + 4 * 32 + 2 * 32),
    ("no_mlp", ("mlp", "norm2"), ("attn", "norm1"), 8 * 32 * 32 + 5 * 32 + 2 * 32)])
def test_a_block_without_a_sublayer_has_none_of_its_parameters_and_is_the_other_alone(key, gone, kept, lost):
    plain, m = tiny(), tiny(**{key: [2]})
    block = m.blocks[2]
    assert all(getattr(block, name) is None for name in gone)
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in plain.blocks[2].named_parameters()
                                                        if not n.startswith(tuple(f"{g}." for g in gone))]
    assert m.num_params() == plain.num_params() - lost
    if key == "no_mlp":  # 6 FLOPs less per parameter lost (matmul_weights counts all but the tables)
        assert plain.flops_per_token(16) - m.flops_per_token(16) == 6 * lost
    x, x0 = torch.randn(2, 2, 5, 32, generator=torch.Generator().manual_seed(3))
    sublayer, norm = (getattr(block, name) for name in kept)
    with torch.no_grad():
        h = F.layer_norm(x, (32,), norm.weight, norm.bias)
        other = sublayer(h) if key == "no_attention" else sublayer(h, None, None, None)
        torch.testing.assert_close(block(x, x0, None, None, None), x + other, atol=0, rtol=0)


@pytest.mark.parametrize("options", [{}, dict(window=8, window_pattern="LSSL", doc_causal=True, bos_id=0,
                                              value_embeds=2, unet_skips=True, x0_mix=True, rotary=True)],
                         ids=["baseline", "masks-value-embeds-skips"])
def test_a_model_without_attention_in_a_layer_equals_one_whose_attention_there_adds_nothing(options):
    # with the attention's output projection zeroed, layer 2 of the full model is its MLP alone: the same logits
    # (value embedding table 0, which serves layers 0 and 2, is read by layer 0 only)
    m, plain = tiny(**options, no_attention=[2]), tiny(**options)
    missing = plain.load_state_dict(m.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith(("blocks.2.attn.", "blocks.2.norm1.")) for k in missing)
    with torch.no_grad():
        plain.blocks[2].attn.proj.weight.zero_()
        plain.blocks[2].attn.proj.bias.zero_()
        idx = batch(B=2, T=20, seed=5).clamp(min=1)
        idx[:, 7] = 0
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=1e-6, rtol=0)


def test_no_mask_is_built_for_the_layers_without_attention(monkeypatch):
    built, build = [], model.gpt.attention_mask
    monkeypatch.setattr(model.gpt, "attention_mask", lambda idx, w, *a: built.append(int(w)) or build(idx, w, *a))
    m = tiny(window=8, window_pattern="LSSL", no_attention=[1, 2])
    masks = m._masks(batch())
    assert built == [8] and masks[1] is None and masks[2] is None and masks[0] is masks[3]


def test_flops_per_token_drop_by_the_attention_of_the_layer_without_it():
    options = dict(window=8, window_pattern="LSSL", block_size=64)
    m, plain, T = tiny(**options, no_attention=[2]), tiny(**options), 30
    weights = 4 * 32 * 32 + 4 * 32 + 2 * 32  # qkv, proj and norm1 (see above)
    keys = int(model.gpt.attention_mask(torch.zeros(1, T, dtype=torch.long), torch.tensor(4), False, 0).sum())
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


def test_value_embeddings_skip_the_layers_without_attention():
    # table 0 serves layers 0 and 2, table 1 layers 1 and 3: each is left with the layer that has attention
    m = tiny(value_embeds=2, no_attention=[0, 3])
    assert m.cfg.value_embed_layers == [1, 2] and len(m.value_embeds) == 2
    assert all(m.blocks[i].attn.ve_lambda is not None for i in (1, 2))


def gates(m) -> list[torch.nn.Parameter]:
    return [mod.weight for mod in m.modules() if isinstance(mod, model.gpt.Gate)]


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


def test_smear_adds_the_gated_previous_token_by_hand():
    m = tiny(smear=True)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 3, 32, generator=g)
    with torch.no_grad():
        m.smear.lam.fill_(0.7)
        m.smear.gate.weight.copy_(torch.randn(1, 12, generator=g))
        out = m.smear(x)
        w = m.smear.gate.weight[0]
        assert torch.equal(out[0, 0], x[0, 0])  # the first token has no predecessor
        for t in (1, 2):
            gate = 1 / (1 + math.exp(-sum(w[c].item() * x[0, t, c].item() for c in range(12))))
            torch.testing.assert_close(out[0, t], x[0, t] + 0.7 * gate * x[0, t - 1])


def test_smear_mixes_the_token_embeddings_before_the_positions_and_starts_as_a_no_op():
    m, plain = tiny(smear=True), tiny()
    plain.load_state_dict(m.state_dict(), strict=False)
    idx = batch()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=0, rtol=0)  # lambda 0 at init
        m.smear.lam.fill_(0.5)
        seen = []
        m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        m(idx)
        positions = m.wpe(torch.arange(idx.size(1)))
        torch.testing.assert_close(seen[0], m.smear(m.wte(idx)) + positions, atol=0, rtol=0)
        assert not torch.allclose(seen[0], m.wte(idx) + positions)


def smeared(**options):
    """A model with the smear on and moved off its no-op init."""
    m = tiny(smear=True, rotary=True, **options)
    with torch.no_grad():
        m.smear.lam.fill_(1.0)
        m.smear.gate.weight.normal_()
    return m


def test_smear_reaches_one_token_forward_and_none_back():
    x = batch(B=2, T=12, seed=7)
    x2 = x.clone()
    x2[:, 5] = (x[:, 5] + 1) % 257
    # no attention anywhere: a token's logits see the previous token only through the smear
    assert _changed_positions(smeared(no_attention=[0, 1, 2, 3]), x, x2) == [5, 6]
    assert _changed_positions(smeared(), x, x2) == list(range(5, 12))  # with attention: later tokens, never earlier


def test_bigram_rows_follow_the_records_hash_and_keep_the_last_row_for_the_first_token():
    rows = 251520  # record 62's 5 x 50304
    idx = torch.tensor([[50256, 464, 2068, 50256, 0], [1, 0, 1, 1, 50255]])
    hashed = [[rows - 1] + [(36313 * now ^ 27191 * before) % (rows - 1) for before, now in zip(r, r[1:])]
              for r in idx.tolist()]
    assert model.gpt.bigram_rows(idx, rows).tolist() == hashed
    assert hashed[1][1:4] == [27191, 36313, 36313 ^ 27191]  # (1, 0), (0, 1), (1, 1) by hand
    # the records hash in int32: their products stay below 2^31 for every id of a vocabulary under 59,000
    assert 36313 * 59_000 < 2 ** 31


def test_bigram_rows_spread_every_bigram_over_the_table_and_none_on_the_first_tokens_row():
    V, rows = 257, 1001  # 66,049 bigrams over 1,000 hashed rows: 66 each on average
    tokens = torch.arange(V)
    pairs = torch.stack(torch.meshgrid(tokens, tokens, indexing="ij"), dim=-1).view(-1, 2)  # (previous, current)
    counts = torch.bincount(model.gpt.bigram_rows(pairs, rows)[:, 1], minlength=rows)
    mean = V * V / (rows - 1)
    assert counts[-1] == 0 and mean / 2 < counts[:-1].min() and counts[:-1].max() < 2 * mean


def test_bigram_table_starts_as_a_no_op_then_each_block_adds_its_lambda_times_the_row():
    m, plain = tiny(bigram_hash=100, x0_mix=True), tiny(x0_mix=True)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == [
        "bigram.weight", *(f"blocks.{i}.bigram_lambda" for i in range(4))]
    idx = batch()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=0, rtol=0)  # the table is zero at init
        m.bigram.weight.normal_()
        m.blocks[2].bigram_lambda.fill_(0.3)
        m.blocks[2].x0_lambda.copy_(torch.tensor([0.5, 2.0]))
        seen = {}
        m.blocks[2].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0], x0=args[1]))
        m.blocks[2].norm1.register_forward_pre_hook(lambda mod, args: seen.update(mixed=args[0]))
        m(idx)
        rows = m.bigram.weight[model.gpt.bigram_rows(idx, 100)]
    torch.testing.assert_close(seen["mixed"], 0.5 * seen["x"] + 2.0 * seen["x0"] + 0.3 * rows)


def test_bigram_table_reads_the_token_before_and_no_other():
    x = batch(B=2, T=12, seed=7)
    x2 = x.clone()
    x2[:, 5] = (x[:, 5] + 1) % 257
    m = tiny(bigram_hash=1000, no_attention=[0, 1, 2, 3], rotary=True)
    with torch.no_grad():
        m.bigram.weight.normal_()
    # no attention anywhere: a token sees the one before only through its bigram's row
    assert _changed_positions(m, x, x2) == [5, 6]
    assert _changed_positions(tiny(no_attention=[0, 1, 2, 3], rotary=True), x, x2) == [5]


@pytest.mark.parametrize("signs", [False, True])
def test_bigram_row_is_read_into_the_first_bigram_dim_channels_times_its_sign_pattern(signs):
    table = tiny(bigram_hash=100, bigram_dim=8, bigram_signs=signs).bigram
    idx = torch.tensor([[3, 5, 5, 200], [200, 5, 3, 3]])
    with torch.no_grad():
        table.weight.normal_()
        out = table(idx)
    assert table.weight.shape == (100, 8) and out.shape == (2, 4, 32) and not out[..., 8:].any()
    rows = model.gpt.bigram_rows(idx, 100)
    for b, seq in enumerate(idx.tolist()):
        for t, pattern in enumerate([0] + [before ^ now for before, now in zip(seq, seq[1:])]):
            sign = table.signs[pattern] if signs else 1.0
            torch.testing.assert_close(out[b, t, :8], table.weight[rows[b, t]] * sign, atol=0, rtol=0)


def test_sign_patterns_are_a_fixed_draw_of_plus_and_minus_one_saved_with_the_model():
    signs = tiny(bigram_hash=100, bigram_dim=8, bigram_signs=True).bigram.signs
    assert signs.shape == (8192, 8) and set(signs.unique().tolist()) == {-1.0, 1.0} and abs(signs.mean()) < 0.02
    torch.manual_seed(123)  # a draw of their own: torch's seed and the table's size change nothing
    assert torch.equal(get_model({**TINY, "bigram_hash": 7, "bigram_dim": 8, "bigram_signs": True}).bigram.signs, signs)
    assert "bigram.signs" in tiny(bigram_hash=100, bigram_signs=True).state_dict()
    assert tiny(bigram_hash=100).bigram.signs is None


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


def test_the_cpu_config_trains_with_the_bigram_table_and_xsa():
    cfg = parse_args(["--config", "configs/cpu.toml", "--model.vocab_size=257", "--model.bigram_hash=1921",
                      "--model.bigram_dim=32", "--model.bigram_signs=true", "--model.xsa=[1, 3]"])
    torch.manual_seed(0)
    m = get_model(dataclasses.asdict(cfg.model))
    losses = _train(m, cfg.optim, steps=8)
    assert losses[-1] < losses[0] - 0.1, losses
    assert m.bigram.weight.any() and all(m.blocks[i].attn.xsa_alpha.any() for i in (1, 3))  # both learn


def sigmoid_of(w: torch.Tensor, inputs: list[float]) -> float:
    """sigmoid(w . inputs) in plain Python floats."""
    return 1 / (1 + math.exp(-sum(wc.item() * xc for wc, xc in zip(w, inputs))))


@pytest.mark.parametrize("key, options", [("ve_gate", dict(value_embeds=2)), ("skip_gate", dict(unet_skips=True))])
def test_ve_and_skip_gates_start_at_one_so_the_model_starts_unchanged(key, options):
    m, plain = tiny(**options, **{key: True}, rotary=True), tiny(**options, rotary=True)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == (
        [f"blocks.{i}.attn.ve_gate.weight" for i in range(4)] if key == "ve_gate" else ["skip_gate.weight"])
    assert all(not w.any() for w in gates(m))  # 2 sigmoid(0) = 1, exactly
    idx = batch()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=0, rtol=0)


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


def yarn_by_hand(f: float, start: int, window: int) -> float:
    """YaRN's frequency for f, in Python floats: f (s + r (1 - s)), s = start / window, r the ramp of f's turns
    across the start window from 1 (r = 0) to 32 (r = 1)."""
    s, turns = start / window, start * f / (2 * math.pi)
    r = min(max((turns - 1) / 31, 0.0), 1.0)
    return f * (s + r * (1 - s))


@pytest.mark.parametrize("truncate, base", [(True, 1024.0), (False, 10000.0)], ids=["records", "plain"])
def test_yarn_frequencies_follow_the_closed_form_keep_the_fast_and_stretch_the_slow(truncate, base):
    # the records' head: 128 channels; record 31's start window 3 x 128 tokens, its final eval's 13 x 128
    freqs, start, window = model.gpt.rotary_frequencies(128, base, truncate), 384, 1664
    scaled, gain = model.gpt.yarn(freqs, start, torch.tensor(window))
    turns = freqs * start / (2 * math.pi)
    fast, slow = turns >= 32, turns <= 1
    assert fast.sum() >= 3 and slow.sum() >= 10 and (~fast & ~slow).sum() >= 10  # all three regimes occur
    assert torch.equal(scaled[fast], freqs[fast])  # kept bit for bit
    torch.testing.assert_close(scaled[slow], freqs[slow] * start / window, atol=0, rtol=1e-6)  # interpolated
    by_hand = torch.tensor([yarn_by_hand(f, start, window) for f in freqs.tolist()])
    torch.testing.assert_close(scaled, by_hand, atol=0, rtol=1e-6)
    assert (scaled <= freqs).all() and gain.item() == pytest.approx(1 + 0.2 * math.log(window / start), rel=1e-6)
    same, one = model.gpt.yarn(freqs, start, torch.tensor(start))  # at the start window: plain rotary, exactly
    assert torch.equal(same, freqs) and one.item() == 1.0


def test_yarn_attention_rotates_by_the_stretched_frequencies_and_scales_the_logits():
    m = tiny(rotary=True, window=8, window_start=2, yarn=True, attn_scale=0.3, n_layer=1)
    att, (B, T, H, D) = m.blocks[0].attn, (1, 11, 2, 16)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(10))
    m.set_progress(0.5)  # window 5
    mask = model.gpt.attention_mask(batch(B=B, T=T), m.windows[0], False, 0)
    with torch.no_grad():
        q, k, v = att.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        freqs = [yarn_by_hand(10000 ** (-2 * i / D), 2, 5) for i in range(D // 2)]
        angles = torch.tensor([[t * f for f in freqs] for t in range(T)])

        def turned(y):  # pair i is (channel i, channel i + D/2)
            y1, y2 = y.chunk(2, dim=-1)
            return torch.cat((y1 * angles.cos() - y2 * angles.sin(), y1 * angles.sin() + y2 * angles.cos()), -1)
        logits = turned(q) @ turned(k).transpose(-1, -2) * 0.3 * (1 + 0.2 * math.log(5 / 2))
        y = logits.masked_fill(~mask, -math.inf).softmax(-1) @ v
        torch.testing.assert_close(att(x, None, mask, m.windows[0]), att.proj(joined(y)), atol=1e-5, rtol=0)


def test_yarn_is_plain_rotary_at_the_start_window_and_follows_the_window_without_state():
    options = dict(rotary=True, rope_truncate=True, rope_base=1024.0, window=16, window_start=4, window_pattern="LS",
                   block_size=64)
    m, plain = tiny(**options, yarn=True), tiny(**options)
    idx = batch(B=2, T=40)
    with torch.no_grad():
        assert not torch.equal(m(idx)[0], plain(idx)[0])  # a fresh model: the final window, 4 times the start
        plain.set_progress(1.0)
        for progress in (0.5, 0.0):  # back to the start window: nothing carried over from the longer ones
            m.set_progress(progress)
            plain.set_progress(progress)
            same = torch.equal(m(idx)[0], plain(idx)[0])
            assert same == (progress == 0.0), progress


# --- the training loss's other terms (model.mtp_weights, model.prefix_weight) ---

PREFIXES = {5: 3, 9: 5, 11: 9, 12: 1}  # a made-up prefix table: these ids have a prefix token, the others none


def with_prefixes(m):
    """`m` with PREFIXES as its prefix table (train.py fills it from the data's tokenizer)."""
    m.set_prefix_targets([PREFIXES.get(i, -1) for i in range(257)])
    return m


def loss_by_hand(logits: torch.Tensor, targets: torch.Tensor, weights: list[float], prefix: float) -> torch.Tensor:
    """sum over rows b, positions t, offsets k with a target of w_k * -log p(targets[b, t + k] | logits[b, t]), plus
    prefix * -log p(prefix of targets[b, t]) where it has one, over the count of next-token targets; loops."""
    logp = F.log_softmax(logits.double(), dim=-1)
    B, T = targets.shape
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            count += int(targets[b, t] != -100)
            for k, w in enumerate(weights):
                if t + k < T and targets[b, t + k] != -100:
                    total -= w * logp[b, t, targets[b, t + k]]
            if targets[b, t] != -100 and int(targets[b, t]) in PREFIXES:
                total -= prefix * logp[b, t, PREFIXES[int(targets[b, t])]]
    return total / count


@pytest.mark.parametrize("options, progress, weights, prefix", [
    (dict(mtp_weights=[1.0, 0.5, 0.25]), 0.0, [1.0, 0.5, 0.25], 0.0),
    (dict(mtp_weights=[1.0, 0.5, 0.25]), 0.5, [1.0, 0.25, 0.0], 0.0),  # half way through the second third
    (dict(prefix_weight=0.25), 0.1, [1.0], 0.25),
    (dict(mtp_weights=[1, 0.5, 0.25, 0.125], prefix_weight=0.5), 0.125, [1.0, 0.5, 0.25, 0.0625], 0.5),
])
def test_the_training_loss_is_the_weighted_sum_of_the_shifted_and_prefix_cross_entropies(
        options, progress, weights, prefix):
    """Each position's logits against the tokens 1, 2, ... ahead (a token past the row's end left out) and against
    its target's prefix token (left out where it has none), over the count of next-token targets; padding (-100)
    is no target at all."""
    m = tiny(logit_softcap=15.0, **options)
    if prefix:
        with_prefixes(m)
    m.set_progress(progress)
    x = batch(B=2, T=9, vocab=14, seed=3)  # small ids: many targets have a prefix token, some repeat
    targets = x[:, 1:].clone()
    targets[1, -2:] = -100  # a padded tail, as the val batches have
    with torch.no_grad():
        logits, _ = m(x[:, :-1])
    _, loss = m(x[:, :-1], targets)
    assert m.training and m.loss_weights.tolist() == weights + ([prefix] if prefix else [])
    torch.testing.assert_close(loss.double(), loss_by_hand(logits, targets, weights, prefix), atol=1e-6, rtol=1e-6)
    loss.backward()  # the loss is one graph through the shared head: every weight gets a gradient
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("weights", [[], [1.0]])
def test_without_later_tokens_the_training_loss_is_the_plain_next_token_loss(weights):
    x = batch()
    plain, m = tiny(), tiny(mtp_weights=weights)
    m.set_progress(0.0)
    assert m.loss_weights is None and "loss_weights" not in dict(m.named_buffers())
    assert torch.equal(m(x[:, :-1], x[:, 1:])[1], plain(x[:, :-1], x[:, 1:])[1])


def test_the_last_stage_and_every_eval_score_the_next_token_alone():
    x = batch()
    plain, m = tiny(), with_prefixes(tiny(mtp_weights=[1.0, 0.5, 0.25], prefix_weight=0.25))
    want = plain(x[:, :-1], x[:, 1:])[1]
    m.set_progress(0.8)  # the last third: the later tokens' and the prefix's weights are 0
    assert m.loss_weights.tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(m(x[:, :-1], x[:, 1:])[1], want, atol=1e-6, rtol=1e-6)
    m.set_progress(0.0)
    assert m(x[:, :-1], x[:, 1:])[1] > want + 0.5  # the other terms weigh in training ...
    m.eval()
    assert torch.equal(m(x[:, :-1], x[:, 1:])[1], want)  # ... never in an eval (same weights as plain)


def record_53(x: float) -> list[float]:
    """Record 53's MTP weights at x = step / scheduled steps, and record 88's prefix weight after them."""
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x), 0.25]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1)), 0.0, 0.25 * (1 - (3 * x - 1))]
    return [1.0, 0.0, 0.0, 0.0]


def test_the_loss_weights_follow_the_records_schedule_and_a_fresh_model_has_the_final_ones():
    m = tiny(mtp_weights=[1.0, 0.5, 0.25], prefix_weight=0.25)
    assert m.loss_weights.tolist() == [1.0, 0.0, 0.0, 0.0]  # progress 1, as a model loaded from checkpoint.pt
    steps = 30
    for step in range(steps + 1):
        m.set_progress(step / steps)
        assert m.loss_weights_at(step / steps) == pytest.approx(record_53(step / steps), abs=1e-12)
        torch.testing.assert_close(m.loss_weights, torch.tensor(record_53(step / steps)))
    # stages as the batch schedule's: the third weight reaches 0 at step 10 of 30, the second at step 20
    assert [w for s in (9, 10, 19, 20) for w in m.loss_weights_at(s / 30)[1:3]] == pytest.approx(
        [0.5, 0.25 / 10, 0.5, 0.0, 0.5 / 10, 0.0, 0.0, 0.0])
    assert tiny().loss_weights_at(0.0) == [] and tiny(mtp_weights=[1.0, 0.5]).loss_weights_at(0.25) == [1.0, 0.25]


# --- the head that unties from the embedding (model.untie_at) ---

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


def train_tied(m, optimizers, steps: int, untie_at: int | None = None) -> list[float]:
    """train.py's step on one batch: the untie before step `untie_at`, the head's gradient to the embedding
    before the optimizers, the embedding's weights to the head after them."""
    from optim.groups import untie_head

    x, losses = batch(), []
    for step in range(steps):
        if step == untie_at:
            untie_head(m, optimizers)
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        m.tie_grads()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        m.tie_weights()
        losses.append(loss.item())
    return losses


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
    assert model.gpt.mudd_width(63) == 64 and model.gpt.mudd_width(64) == 128


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
