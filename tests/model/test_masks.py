"""Which keys a query attends to: documents, windows and their schedule, S layers; FlexAttention's block masks
against the dense mask SDPA gets, and the fallback to it."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import model.masks
from model import get_model
from model.masks import layer_masks, window_at
from tests.helpers import TINY_GPT as TINY
from tests.model.tiny import RECORDS, batch, changed_positions, tiny, window_tensor


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_doc_causal_hides_earlier_documents(attention):
    m = tiny(doc_causal=True, bos_id=0, attention=attention, rotary=True, value_embeds=1)
    x = batch(B=2, T=20, seed=3).clamp(min=1)
    x[:, 0] = x[:, 9] = 0  # documents: positions 0-8, then 9-19
    x2 = x.clone()
    x2[:, 2:9] = (x[:, 2:9] + 7) % 256 + 1
    assert changed_positions(m, x, x2) == list(range(2, 9))
    assert changed_positions(tiny(rotary=True), x, x2) == list(range(2, 20))  # without the mask they leak


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
    assert changed_positions(m, x, x2) == list(range(reach + 1))


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("window, pattern, reach, past_reach", [
    (4, "", 6, 8),     # 3 keys back a layer, its own included; 4 back and its own under window_past: (4, 0)
    (8, "SS", 6, 8),   # the S layers' half window too
])
def test_window_past_adds_the_querys_own_key_to_every_window(attention, window, pattern, reach, past_reach):
    x = batch(B=2, T=20, seed=4)
    x2 = x.clone()
    x2[:, 0] = (x[:, 0] + 1) % 257
    for past, expected in [(False, reach), (True, past_reach)]:
        m = tiny(window=window, window_pattern=pattern, window_past=past, n_layer=2, attention=attention)
        assert changed_positions(m, x, x2) == list(range(expected + 1))
    # and the FLOPs count one key more a query wherever the window, not the position, bounds it
    plain, past = (tiny(window=window, window_pattern=pattern, window_past=p, n_layer=2) for p in (False, True))
    keys = 2 * (model.masks.mean_keys(20, 5) - model.masks.mean_keys(20, 4))
    assert past.flops_per_token(20) - plain.flops_per_token(20) == pytest.approx(12 * TINY["n_embd"] * keys)
    with pytest.raises(ValueError, match="window_past = true .* needs window > 0"):
        tiny(window_past=True)


def test_window_schedule_sets_each_layers_mask():
    m = tiny(window=16, window_start=4, window_pattern="LSSL", doc_causal=True, bos_id=0)
    idx = batch(B=2, T=20).clamp(min=1)
    idx[:, 5] = 0
    for progress, long in [(0.0, 4), (0.5, 10), (1.0, 16), (2.0, 16), (-1.0, 4)]:
        m.set_progress(progress)
        assert m.window == long == window_at(m.cfg, progress) and m.windows.tolist() == [long, long // 2]
        for mask, kind in zip(layer_masks(m.cfg, idx, m.windows), "LSSL"):
            expected = model.masks.attention_mask(idx, torch.tensor(long if kind == "L" else long // 2), True, 0)
            assert torch.equal(mask, expected)
    assert tiny(window=16, window_start=4).window == 16  # a fresh model (a loaded checkpoint): the final window
    # the records' 12-letter pattern on 4 layers, "LS" on 6: repeated or cut, so n_layer can change alone
    assert [tiny(window=16, window_pattern=p, n_layer=n).cfg.layer_windows
            for p, n in [("LSSSLSSLSSSL", 4), ("LS", 6), ("", 3)]] == ["LSSS", "LSLSLS", "LLL"]
    assert tiny(window=16, window_pattern="S" * 4, window_start=1).windows.tolist() == [16, 8]
    m = tiny(window=16, window_pattern="S" * 4, window_start=1)
    m.set_progress(0.0)
    assert m.windows.tolist() == [1, 1]  # a short window never reaches 0 (a query must see itself)


def test_window_stages_step_by_equal_stages_then_hold_the_final_window_past_the_end():
    """window_stages = [8, 12, 14] by thirds, `window` 16 from progress 1 on (a schedule's extension steps); with
    window_block = 4 the S layers get half of the L layers' whole blocks of 4 tokens: 8, 12 and 14 -> 4, 16 -> 8
    (a window of 4, one block, would leave them none: refused)."""
    m = tiny(window=16, window_stages=[8, 12, 14], window_block=4, window_pattern="LS")
    windows = []
    for progress in (0.0, 0.33, 1 / 3, 0.66, 2 / 3, 0.99, 1.0, 1.5):
        m.set_progress(progress)
        windows.append(m.windows.tolist())
    assert windows == [[8, 4], [8, 4], [12, 4], [12, 4], [14, 4], [14, 4], [16, 8], [16, 8]]
    assert tiny(window=16, window_stages=[8, 12]).window == 16  # a fresh model (a loaded checkpoint): the final
    for bad, needle in [({"window_stages": [8, 4]}, "must be rising windows > 0"),
                        ({"window_stages": [8, 20]}, "the last at most window=16"),
                        ({"window_stages": [8], "window_start": 4}, "replaces window_start=4"),
                        ({"window_stages": [4], "window_block": 4}, "at most half of the smallest window, 4")]:
        with pytest.raises(ValueError, match=needle):
            tiny(window=16, **bad)


def test_a_widened_eval_takes_the_last_window_widens_the_long_layers_and_gives_both_back():
    """eval.final_window's model side: inside the block the L layers attend 24 tokens, the S layers and YaRN take
    the run's last window (16, so 8 and 16) even before the schedule reached it (record 46's cut run), and leave
    it after (the host's copy of the window stays the schedule's); with L layers only and no YaRN that is the model
    whose window is 24."""
    m = tiny(window=16, window_stages=[4, 8], window_pattern="LS", rotary=True, yarn=True)
    m.set_progress(1.0)
    with m.widened(24):
        assert (m.windows.tolist(), m.yarn_window.item(), m.window) == ([24, 8], 16, 16)
    assert (m.windows.tolist(), m.yarn_window.item()) == ([16, 8], 16)
    m.set_progress(0.9)  # the last stage's window, 8: the extension's 16 not yet reached
    with m.widened(24):
        assert (m.windows.tolist(), m.yarn_window.item(), m.window) == ([24, 8], 16, 8)
    assert (m.windows.tolist(), m.yarn_window.item(), m.window) == ([8, 4], 8, 8)
    with m.widened(0):
        assert m.windows.tolist() == [8, 4]
    idx = batch(B=2, T=40)
    narrow, wide = tiny(window=16, block_size=64), tiny(window=24, block_size=64)
    with torch.no_grad():
        before = narrow(idx)[0]
        with narrow.widened(24):
            assert torch.equal(narrow(idx)[0], wide(idx)[0]) and not torch.equal(narrow(idx)[0], before)
        assert torch.equal(narrow(idx)[0], before)


def test_a_model_saved_at_an_evals_windows_loads_with_them_and_trains_on_at_the_schedules():
    """checkpoint.pt's evaluator scores what the run's final eval did: the windows are in the state dict (train.py
    saves inside `widened`); the next training step sets the schedule's again."""
    options = dict(window=16, window_stages=[4, 8], window_pattern="LS", rotary=True, yarn=True, block_size=64)
    m, idx = tiny(**options), batch(B=2, T=40)
    m.set_progress(0.5)
    with m.widened(24), torch.no_grad():
        state = {k: v.clone() for k, v in m.state_dict().items()}
        want = m.eval()(idx)[0]
    loaded = get_model({**TINY, **options})
    loaded.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], want) and not torch.equal(get_model({**TINY, **options})(idx)[0], want)
    assert loaded.flops_per_token(40) == m.flops_per_token(40, window=24)  # counted at the window it holds
    loaded.set_progress(0.5)
    assert torch.equal(loaded.windows, m.windows) and torch.equal(loaded.yarn_window, m.yarn_window)


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


@pytest.mark.skipif(model.masks.flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("window, doc_causal", [(5, True), (None, True), (7, False), (13, True), (None, False)])
def test_flex_block_mask_tiles_follow_the_dense_mask(window, doc_causal):
    # 8-token tiles over 45 tokens (a ragged last tile), so every kind of tile occurs; compiled FlexAttention
    # skips tiles left out and runs full tiles without the mask, so both must be exactly right
    T, block = 45, 8
    idx = batch(B=2, T=T, vocab=50, seed=6).clamp(min=1)
    idx[0, 10] = idx[0, 11] = idx[1, 3] = idx[1, 25] = 0
    dense = model.masks.attention_mask(idx, window_tensor(window), doc_causal, 0)[:, 0]
    n = -(-T // block)
    padded = torch.zeros(2, n * block, n * block, dtype=torch.bool)
    padded[:, :T, :T] = dense
    tiles = padded.view(2, n, block, n, block).transpose(2, 3)
    real = torch.zeros(n * block, dtype=torch.bool)
    real[:T] = True
    real_pairs = (real[:, None] & real[None, :]).view(n, block, n, block).transpose(1, 2)
    some, every = tiles.any(dim=(-1, -2)), (tiles | ~real_pairs).all(dim=(-1, -2))
    bm = model.masks.flex_block_mask(idx, window_tensor(window), doc_causal, 0, block=block)
    # without documents one mask serves every row of the batch
    full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices).expand_as(some)
    partial = _listed(bm.kv_num_blocks, bm.kv_indices).expand_as(some)
    assert bm.seq_lengths == (T, T) and not (full & partial).any()
    assert torch.equal(full, every)                     # no pair of a full tile is masked
    assert not (some & ~(full | partial)).any()         # no allowed pair lies in a skipped tile
    if not doc_causal:
        assert torch.equal(partial, some & ~every)      # exact without documents
    assert (partial & ~some).sum() <= 0.1 * partial.sum()  # with them: a bound, nearly tight


@pytest.mark.skipif(model.masks.flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("window, doc_causal", [(5, True), (None, True), (7, False)])
def test_flex_mask_mod_equals_the_sdpa_fallback_mask(window, doc_causal):
    idx = batch(B=2, T=40, vocab=50, seed=6).clamp(min=1)
    idx[0, 10] = idx[1, 3] = idx[1, 25] = 0
    q, k, v = torch.randn(3, 2, 2, 40, 16, generator=torch.Generator().manual_seed(7)).unbind(0)
    block_mask = model.masks.flex_block_mask(idx, window_tensor(window), doc_causal, 0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        flex = model.masks.flex_attention(q, k, v, block_mask=block_mask, scale=0.3)
    mask = model.masks.attention_mask(idx, window_tensor(window), doc_causal, 0)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


@pytest.mark.skipif(model.masks.flex_attention is None, reason="no FlexAttention in this torch")
def test_flex_gets_one_dtype_under_bf16_autocast(monkeypatch):
    # value embeddings (not autocast) made v fp32 beside bf16 q and k: FlexAttention of torch 2.6 refuses that
    m = tiny(attention="flex", window=8, doc_causal=True, bos_id=0, value_embeds=1, rotary=True, qk_norm=True)
    idx = batch(B=2, T=32).clamp(min=1)
    idx[:, 0] = 0
    monkeypatch.setattr(model.masks, "flex_available", lambda device: True)  # the CUDA path (forward only on CPU)
    seen, flex = [], model.masks.flex_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex(q, k, v, **kwargs)
    monkeypatch.setattr(model.attention, "flex_attention", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        m(idx)
    assert seen == [(torch.bfloat16,) * 3] * TINY["n_layer"]


def test_flex_on_cpu_warns_once():
    m = tiny(attention="flex", window=4)
    model.masks._warned_fallback = False
    with pytest.warns(UserWarning, match="attention='flex' has no backward on cpu") as record:
        m(batch())
        m(batch())
    assert len([w for w in record if "attention='flex'" in str(w.message)]) == 1


def test_no_mask_is_built_for_the_layers_without_attention(monkeypatch):
    built, build = [], model.masks.attention_mask
    monkeypatch.setattr(model.masks, "attention_mask", lambda idx, w, *a: built.append(int(w)) or build(idx, w, *a))
    m = tiny(window=8, window_pattern="LSSL", no_attention=[1, 2])
    masks = layer_masks(m.cfg, batch(), m.windows)
    assert built == [8] and masks[1] is None and masks[2] is None and masks[0] is masks[3]
