"""The smear and the bigram hash embedding (its rows, its sign patterns, its place in the blocks)."""
import math

import pytest
import torch

import model.embeddings
from model import get_model
from tests.helpers import TINY_GPT as TINY
from tests.model.tiny import batch, changed_positions, tiny


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
    assert changed_positions(smeared(no_attention=[0, 1, 2, 3]), x, x2) == [5, 6]
    assert changed_positions(smeared(), x, x2) == list(range(5, 12))  # with attention: later tokens, never earlier


def test_bigram_rows_follow_the_records_hash_and_keep_the_last_row_for_the_first_token():
    rows = 251520  # record 62's 5 x 50304
    idx = torch.tensor([[50256, 464, 2068, 50256, 0], [1, 0, 1, 1, 50255]])
    hashed = [[rows - 1] + [(36313 * now ^ 27191 * before) % (rows - 1) for before, now in zip(r, r[1:])]
              for r in idx.tolist()]
    assert model.embeddings.bigram_rows(idx, rows).tolist() == hashed
    assert hashed[1][1:4] == [27191, 36313, 36313 ^ 27191]  # (1, 0), (0, 1), (1, 1) by hand
    # the records hash in int32: their products stay below 2^31 for every id of a vocabulary under 59,000
    assert 36313 * 59_000 < 2 ** 31


def test_bigram_rows_spread_every_bigram_over_the_table_and_none_on_the_first_tokens_row():
    V, rows = 257, 1001  # 66,049 bigrams over 1,000 hashed rows: 66 each on average
    tokens = torch.arange(V)
    pairs = torch.stack(torch.meshgrid(tokens, tokens, indexing="ij"), dim=-1).view(-1, 2)  # (previous, current)
    counts = torch.bincount(model.embeddings.bigram_rows(pairs, rows)[:, 1], minlength=rows)
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
        rows = m.bigram.weight[model.embeddings.bigram_rows(idx, 100)]
    torch.testing.assert_close(seen["mixed"], 0.5 * seen["x"] + 2.0 * seen["x0"] + 0.3 * rows)


def test_bigram_table_reads_the_token_before_and_no_other():
    x = batch(B=2, T=12, seed=7)
    x2 = x.clone()
    x2[:, 5] = (x[:, 5] + 1) % 257
    m = tiny(bigram_hash=1000, no_attention=[0, 1, 2, 3], rotary=True)
    with torch.no_grad():
        m.bigram.weight.normal_()
    # no attention anywhere: a token sees the one before only through its bigram's row
    assert changed_positions(m, x, x2) == [5, 6]
    assert changed_positions(tiny(no_attention=[0, 1, 2, 3], rotary=True), x, x2) == [5]


@pytest.mark.parametrize("signs", [False, True])
def test_bigram_row_is_read_into_the_first_bigram_dim_channels_times_its_sign_pattern(signs):
    table = tiny(bigram_hash=100, bigram_dim=8, bigram_signs=signs).bigram
    idx = torch.tensor([[3, 5, 5, 200], [200, 5, 3, 3]])
    with torch.no_grad():
        table.weight.normal_()
        out = table(idx)
    assert table.weight.shape == (100, 8) and out.shape == (2, 4, 32) and not out[..., 8:].any()
    rows = model.embeddings.bigram_rows(idx, 100)
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
