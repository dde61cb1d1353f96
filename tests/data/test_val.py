"""The validation reader (data.val): every target scored once on any world size, the holdout tail, the recorded
batches.

Most tests use tests.data.coded's shards, whose every window maps back to (file, start)."""
import json

import numpy as np
import pytest
import torch

from data.loader import TokenLoader
from data.val import PAD_TARGET, val_batches
from data.shards import ShardError, write_shard
from tests import stream_digests
from tests.data.coded import RECORDED, B, L, STRIDE, T, coded_shards, interleave, stream


def test_holdout_is_never_trained_on_and_is_the_val_tail(tmp_path):
    coded_shards(tmp_path, [30 * L, 20 * L + 9])
    files, holdout = str(tmp_path / "*.bin"), 100
    cut = STRIDE + 20 * L + 9 - holdout
    seen = {w for s in stream(TokenLoader(files, B, T, holdout_tokens=holdout), 60) for w in s}
    assert max(s + L for f, s in seen if f == 1) <= cut % STRIDE
    assert len(seen) == 30 + (20 * L + 9 - holdout) // L
    val = list(val_batches(files, 4, T, holdout, tail_tokens=holdout))
    assert int(val[0][0][0, 0]) == cut - 1  # the last trained token: only the input of the first target
    assert torch.cat([y[y != PAD_TARGET] for _, y in val]).tolist() == list(range(cut, cut + holdout))


def test_val_batches_score_every_token_once_in_the_same_sequences_for_any_world_size(tmp_path):
    coded = np.concatenate(coded_shards(tmp_path, [150, 100, 400]))[:501]  # 500 targets, read across file ends
    files = str(tmp_path / "*.bin")
    for world in (1, 2, 3):
        ranks = [list(val_batches(files, 4, T, 500, rank=r, world_size=world)) for r in range(world)]
        assert len({len(r) for r in ranks}) == 1  # the same calls on every rank,
        assert {(x.shape, x.stride(), y.shape, y.stride()) for r in ranks for x, y in r} == {  # of one layout
            ((4, T), (T, 1), (4, T), (T + 1, 1))}
        rows = interleave([[list(zip(x, y)) for x, y in r] for r in ranks])  # sequences in stream order
        x, y = torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])
        scored = y != PAD_TARGET
        # sequence k: inputs are tokens [k*T, (k+1)*T), each target the token after its input, so the last
        # target of a sequence is the first input of the next; padding is ignored targets after token 500
        assert y[scored].tolist() == coded[1:].tolist()
        assert scored.flatten().tolist() == [True] * 500 + [False] * (len(rows) * T - 500)
        assert x.flatten()[:501].tolist() == coded.tolist() and not x.flatten()[501:].any()  # padding inputs: 0


@pytest.mark.parametrize("name", sorted(stream_digests.VAL))


def test_the_val_batches_are_the_recorded_ones(digest_data, name):
    assert stream_digests.val_digest(digest_data, name) == RECORDED["val"][name]


def test_val_ids_beyond_the_vocabulary_are_refused_before_any_batch(tmp_path):
    """The validation stream is checked whole when it is opened (every rank names the same first bad token),
    the holdout tail too; a meta.json that vouches for the ids is trusted, as for training."""
    path = tmp_path / "big_train_000000.bin"
    tokens = np.arange(400) % 50
    tokens[[350, 390]] = 12345
    write_shard(path, tokens)
    val_batches([path], B, T, 300, vocab_size=50)  # the first 301 tokens: clean
    for kw in ({"num_tokens": 360}, {"num_tokens": 100, "tail_tokens": 100}):
        with pytest.raises(ShardError, match=rf"{path}: token id 12345 at token 350 is >= vocab_size 50"):
            val_batches([path], B, T, vocab_size=50, **kw)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))  # it lists no shard: vouches for none
    with pytest.raises(ShardError, match="at token 350"):
        val_batches([path], B, T, 360, vocab_size=50)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50, "shards": [{"file": path.name, "tokens": 400}]}))
    assert max(int(y.max()) for _, y in val_batches([path], B, T, 360, vocab_size=50)) == 12345
