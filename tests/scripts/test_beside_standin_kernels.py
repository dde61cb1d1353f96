"""The kernels stand-in: FA3's varlen attention as the records call it, by FlexAttention, against float64."""
import math

import pytest
import torch

from scripts.beside.standin import kernels

HEADS, DIM = 2, 16


def reference(q, k, v, lengths: list[int], window: int, scale: float) -> torch.Tensor:
    """Attention in float64 with the mask spelled out from the documents' lengths: query i of a document sees
    keys max(start, i - window) .. i of it."""
    tokens = q.size(0)
    allowed = torch.zeros(tokens, tokens, dtype=torch.bool)
    start = 0
    for n in lengths:
        for i in range(start, start + n):
            allowed[i, max(start, i - window) if window >= 0 else start:i + 1] = True
        start += n
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, -math.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


def ragged(lengths: list[int], pad_to: int | None = None, repeat_zero: bool = False):
    """q, k, v for one row of documents of these lengths, and their cu_seqlens as the records build them: padded
    with the row's length (training) or with the first offset repeated (validation's table)."""
    tokens = sum(lengths)
    gen = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(3))
    offsets = [0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()]
    if repeat_zero:
        offsets = [0, *offsets]
    offsets += [tokens] * ((pad_to or len(offsets)) - len(offsets))
    return q, k, v, torch.tensor(offsets, dtype=torch.int32)


CASES = [([128], -1), ([50, 200, 6, 1, 127], 40), ([256], 0), ([100, 156], 300), ([7, 249], 64)]


@pytest.mark.parametrize("lengths,window", CASES)
def test_flex_forward_matches_float64(lengths, window):
    q, k, v, cu = ragged(lengths, pad_to=16)
    attend = kernels.get_kernel(kernels.PROVIDES).flash_attn_interface.flash_attn_varlen_func
    with torch.no_grad():  # FlexAttention's CPU path: forward only
        out = attend(q, k, v, cu, cu, 256, 256, causal=True, softmax_scale=0.12, window_size=(window, 0))
    assert out.shape == q.shape
    assert (out.double() - reference(q, k, v, lengths, window, 0.12)).abs().max() < 1e-5


def test_the_validation_table_with_a_repeated_offset_gives_the_same_documents():
    q, k, v, cu = ragged([60, 68], repeat_zero=True)
    with torch.no_grad():
        out = kernels.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, softmax_scale=0.2, window_size=(32, 0))
    assert (out.double() - reference(q, k, v, [60, 68], 32, 0.2)).abs().max() < 1e-5


@pytest.mark.parametrize("lengths,window", CASES[1:3])
def test_the_dense_path_gives_float64s_gradients(lengths, window):
    q, k, v, cu = ragged(lengths, pad_to=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = kernels.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, softmax_scale=0.12, window_size=(window, 0))
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference(q64, k64, v64, lengths, window, 0.12), (q64, k64, v64), dy.double())
    assert (out.double() - reference(q, k, v, lengths, window, 0.12)).abs().max() < 1e-5
    for got, exact in zip(grads, want):
        assert (got.double() - exact).abs().max() < 1e-5


def test_it_compiles_in_one_graph_and_matches():
    q, k, v, cu = ragged([30, 98, 128], pad_to=8)

    def attention(q, k, v, cu):
        return kernels.flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True, softmax_scale=0.12,
                                              window_size=(64, 0))

    # One graph, as the records compile their model. Inductor's CPU template for flex refuses this lowering
    # (torch 2.13), so the graph runs through AOTAutograd here; the GPU command compiles it with Triton.
    compiled = torch.compile(attention, dynamic=False, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(q, k, v, cu)
    assert (out.double() - reference(q, k, v, [30, 98, 128], 64, 0.12)).abs().max() < 1e-5


def test_what_it_does_not_provide_is_refused():
    q, k, v, cu = ragged([128])
    with pytest.raises(NotImplementedError, match="only causal self-attention"):
        kernels.flash_attn_varlen_func(q, k, v, cu, cu, causal=False)
    with pytest.raises(NotImplementedError, match="window_size=\\(8, 8\\)"):
        kernels.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, window_size=(8, 8))
    with pytest.raises(ModuleNotFoundError, match="provides 'varunneal/flash-attention-3' only"):
        kernels.get_kernel("kernels-community/activation")
