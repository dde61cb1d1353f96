"""train.bf16_stream (GPT.autocast_stream): under bf16 autocast the residual stream, the head and the training loss
stay bf16, as record 46's bf16 weights make them; evals still score fp32 logits; without autocast nothing changes.
CPU autocast stands in for the GPU's. Where CUDA's runs an op in fp32 that CPU's keeps in bf16 (the norms), the
model casts the output back, which CPU cannot show."""
import copy
import warnings

import pytest
import torch

import model.attention
import model.gpt
import model.masks
from tests.model.tiny import RECORDS, batch, tiny

# bf16's unit roundoff: a rounding to nearest errs by at most half of it, relative to the value
U = 2.0 ** -8
# Record 46's pieces on the residual stream: the smear, x0 mix, value tables from the first layers on and the others'
# values scaled, the U-net skips and the one skip connection, backout, YaRN, the attention gate; projections that
# start nonzero, so that every block's output reaches the loss
RECORD_46 = dict(RECORDS, smear=True, x0_mix_init=1.1, value_embed_skip=1, value_scale=True, skip_connection=[1, 3],
                 backout=2, yarn=True, attn_gate=True, zero_init_proj=False)
# the newer records' pieces that add to the stream or read it: MUDD (residual and values), the bigram table with
# its signs, the skip and value-embedding gates, XSA
NEWER = dict(RECORD_46, mudd=[1, 2], mudd_sources=[1], bigram_hash=50, bigram_signs=True, skip_gate=True,
             ve_gate=True, xsa=[1])
# GPT-2 (LayerNorm with biases, learned positions, a tied head, GELU), its loss with later tokens (record 53), and
# record 46's pieces with its float8 head (model.fp8_head; a float64 copy runs the same float8 head)
CONFIGS = {"gpt2": {}, "record_46": RECORD_46, "newer": NEWER,
           "mtp": dict(logit_softcap=15.0, mtp_weights=[1.0, 0.5, 0.25]),
           "record_46_fp8_head": dict(RECORD_46, fp8_head=True)}


def streamed(options: dict, on: bool = True):
    """A tiny GPT with `options`, its stream kept in autocast's dtype if `on` (what trainer/parallel.py sets)."""
    m = tiny(**options)
    m.autocast_stream = on
    return m


def stream_dtypes(m, idx: torch.Tensor, targets: torch.Tensor | None) -> set[torch.dtype]:
    """The dtypes of every tensor the blocks get (x, x0 and those of the value and bigram tables, a MUDD
    connection's values), of the smear's output, of the stream after the last block (backout's) and of the head's
    input, in one forward under CPU bf16 autocast."""
    seen = set()

    def note(_module, args, output=None):
        outputs = [] if output is None else [output]
        seen.update(a.dtype for a in [*args, *outputs] if isinstance(a, torch.Tensor) and a.is_floating_point())
    hooks = [module.register_forward_pre_hook(note) for module in [*m.blocks, m.norm_f, m.lm_head]]
    hooks += [m.smear.register_forward_hook(note)] if m.smear is not None else []
    fp8_head = model.gpt.fp8_head  # the float8 head reads lm_head's weight, not the module: its input noted here

    def noted_fp8_head(x, w):
        note(None, (x,))
        return fp8_head(x, w)
    model.gpt.fp8_head = noted_fp8_head
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(idx, targets)
    finally:
        model.gpt.fp8_head = fp8_head
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("on, dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["key", "no_key"])
def test_every_block_and_the_head_read_the_stream_in_bf16_under_the_key(options, on, dtype):
    # without the key the fp32 embedding and the fp32 scalars of shape [1] keep the stream fp32 under autocast
    x = batch(T=17)
    seen = stream_dtypes(streamed(options, on), x[:, :-1], x[:, 1:])
    assert seen == {torch.bfloat16} if on else torch.float32 in seen


@pytest.mark.skipif(model.masks.flex_attention is None, reason="no FlexAttention in this torch")
def test_the_stream_stays_bf16_through_flex_attention(monkeypatch):
    # the CUDA path on CPU, forward only (CPU has no flex backward), as tests/model/test_masks.py runs it
    monkeypatch.setattr(model.masks, "flex_available", lambda device: True)
    calls, flex = [], model.masks.flex_attention

    def spy(q, k, v, **kwargs):
        calls.append(q.dtype)
        return flex(q, k, v, **kwargs)
    monkeypatch.setattr(model.attention, "flex_attention", spy)
    idx = batch(B=2, T=32).clamp(min=1)
    idx[:, ::9] = 0  # documents apart (bos_id 0)
    m = streamed(dict(RECORD_46, attention="flex"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's own "called without torch.compile" notice
        seen = stream_dtypes(m, idx, None)
    assert seen == {torch.bfloat16} and calls == [torch.bfloat16] * m.cfg.n_layer


@pytest.mark.parametrize("options", [RECORD_46, {}], ids=["record_46", "gpt2"])
def test_the_stream_stays_bf16_where_autocast_runs_the_norms_in_fp32(monkeypatch, options):
    # CUDA's autocast may run rms_norm and layer_norm in fp32, CPU's keeps bf16: their fp32 outputs, as CUDA's,
    # must not turn the stream (the embedding's norm) or the head's input (the final norm) back to fp32
    for name in ("rms_norm", "layer_norm"):
        monkeypatch.setattr(torch.nn.functional, name,
                            lambda *a, _norm=getattr(torch.nn.functional, name), **k: _norm(*a, **k).float())
    x = batch(T=17)
    assert stream_dtypes(streamed(options), x[:, :-1], x[:, 1:]) == {torch.bfloat16}


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_loss_and_gradients_agree_with_float64_within_bf16s_rounding(options):
    """Bounds from U: the training loss rounds each token's cross-entropy once (U/2) and reads logits that carry
    the forward's roundings: within U of the loss. The gradient, as one vector, to first order adds the relative
    errors of the roundings on its path: its two factors', the stream's two additions in each block the backward
    crosses, the logits' and their softcap's; 2 + 2 n_layer + 2 of at most U/2 each. (Measured: at most 0.14 U for
    the loss and 1.7 U for the gradient, against 0.002 U and 1.0 U under autocast without the key.)"""
    m = streamed(options)
    ref = copy.deepcopy(m).double()  # no autocast for float64: it runs as it would without the key
    x = batch(T=17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = m(x[:, :-1], x[:, 1:])
    _, want = ref(x[:, :-1], x[:, 1:])
    loss.backward()
    want.backward()
    assert loss.dtype == torch.float32  # the per-token losses are bf16, their mean fp32
    assert abs(loss.double() - want) <= U * want
    grad, exact = (torch.cat([p.grad.double().flatten() for p in mod.parameters()]) for mod in (m, ref))
    n_layer = m.cfg.n_layer
    assert (grad - exact).norm() <= (2 + 2 * n_layer + 2) * U / 2 * exact.norm()


@pytest.mark.parametrize("on", [True, False], ids=["key", "no_key"])
def test_the_rotary_tables_are_bf16_where_the_stream_is(monkeypatch, on):
    # record 46's cos and sin tables are bf16 buffers, as its stream
    seen, real = [], model.attention.rotary

    def spy(x, freqs, gain=None, bf16_tables=False):
        seen.append(bf16_tables)
        return real(x, freqs, gain, bf16_tables)
    monkeypatch.setattr(model.attention, "rotary", spy)
    m = streamed(RECORD_46, on)
    x = batch(T=17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x[:, :-1], x[:, 1:])
    assert seen == [on] * 2 * len(m.cfg.attention_layers)


def test_the_training_loss_reads_bf16_logits_and_an_eval_fp32_ones(monkeypatch):
    # the record's eval casts its logits to fp32 for the loss; here an eval's chunks are scored as without the key
    m = streamed(RECORD_46)
    dtypes, logits = [], m.logits

    def spy(x, dtype=None):
        out = logits(x, dtype)
        dtypes.append(out.dtype)
        return out
    monkeypatch.setattr(m, "logits", spy)
    x = batch(T=17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x[:, :-1], x[:, 1:])
        with torch.no_grad():
            m(x[:, :-1], x[:, 1:], keep_logits=False)  # train.py's eval
        m(x[:, :-1])  # logits alone (sampling) stay fp32 too
    assert dtypes == [torch.bfloat16, torch.float32, torch.float32]


@pytest.mark.parametrize("options", CONFIGS.values(), ids=CONFIGS.keys())
def test_without_autocast_the_key_changes_nothing(options):
    # CPU runs fp32 (trainer/parallel.py's autocast): there the key's model is the plain one, bit for bit
    x = batch(T=17)
    results = []
    for on in (False, True):
        m = streamed(options, on)
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        results.append([loss, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))
