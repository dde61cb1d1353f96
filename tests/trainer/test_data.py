"""trainer/data.py: the files a config names, what meta.json fills in or refuses, and the eval set's size."""
import json

import numpy as np
import pytest

from data.shards import open_shard
from tests.helpers import ROOT, make_shards, short_docs_data
from trainer.config import ConfigError, parse_args
from trainer.data import resolve_data, train_loader
from trainer.distributed import Dist

TINY = str(ROOT / "configs" / "tiny.toml")


def shards(folder, meta=None):
    """Two train shards and a val shard of 257 ids in `folder`, with `meta` as its meta.json (none if None)."""
    make_shards(folder, [5000, 4000], vocab=257)
    make_shards(folder, [3000], vocab=257, pattern="test_val_{:06d}.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return [f"--data.train={folder}/*_train_*.bin", f"--data.val={folder}/*_val_*.bin"]


def test_the_files_are_sorted_and_holdout_scores_the_tail_of_the_train_files(tmp_path):
    data = shards(tmp_path, {"vocab_size": 257})
    files, val_files, meta = resolve_data(parse_args(["--config", TINY, *data]))
    assert files == [tmp_path / "test_train_000000.bin", tmp_path / "test_train_000001.bin"]
    assert val_files == [tmp_path / "test_val_000000.bin"] and meta == {"vocab_size": 257}
    cfg = parse_args(["--config", TINY, data[0], "--data.val=holdout"])
    assert resolve_data(cfg)[1] == files and cfg.holdout_tokens == cfg.eval.tokens > 0


def test_vocab_size_0_reads_meta_json_and_a_value_that_is_no_vocabulary_is_refused(tmp_path):
    cfg = parse_args(["--config", TINY, *shards(tmp_path / "ok", {"vocab_size": 257}), "--model.vocab_size=0"])
    resolve_data(cfg)
    assert cfg.model.vocab_size == 257
    for bad in (0, -5, "257", 257.0):
        folder = tmp_path / f"bad{bad}"
        cfg = parse_args(["--config", TINY, *shards(folder, {"vocab_size": bad}), "--model.vocab_size=0"])
        with pytest.raises(ConfigError, match=rf"{folder / 'meta.json'}: vocab_size = {bad!r} is not a positive "
                                              r"integer; re-run data.prepare there, or set --model.vocab_size=N"):
            resolve_data(cfg)


def test_a_val_glob_that_matches_nothing_is_named(tmp_path):
    cfg = parse_args(["--config", TINY, shards(tmp_path, {"vocab_size": 257})[0], f"--data.val={tmp_path}/*_vla_*.bin"])
    with pytest.raises(ConfigError, match=r"data.val = '.*_vla_\*.bin' matches no file; give a glob"):
        resolve_data(cfg)


def test_an_eval_tokens_left_at_its_default_fits_a_smaller_val_set_and_a_set_one_stays(tmp_path, capsys):
    make_shards(tmp_path, [5000], vocab=257)
    make_shards(tmp_path, [3000], vocab=257, pattern="test_val_{:06d}.bin")
    data = [f"--data.train={tmp_path}/*_train_*.bin", f"--data.val={tmp_path}/*_val_*.bin", "--model.vocab_size=257"]
    cfg = parse_args(["--config", "configs/cpu_gpt2.toml", *data])  # sets no eval.tokens
    resolve_data(cfg)
    assert cfg.eval.tokens == 2999  # every target: the first token is only an input
    assert capsys.readouterr().err == ("train.py: note: the validation data holds 3,000 tokens, fewer than "
                                       "eval.tokens' default (1,048,576 targets) needs: each eval scores all 2,999 "
                                       "of its targets (set eval.tokens to choose)\n")
    for pinned in (["--config", "configs/cpu_gpt2.toml", *data, "--eval.tokens=1048576"],  # an override
                   ["--config", TINY, *data]):  # the config file's own 7,734
        cfg = parse_args(pinned)
        before = cfg.eval.tokens
        resolve_data(cfg)
        assert cfg.eval.tokens == before and capsys.readouterr().err == ""


def test_the_prefix_table_comes_from_the_tokenizer_meta_json_names_and_without_one_needs_gpt2s_vocabulary(tmp_path):
    from trainer.data import prefix_targets

    cfg = parse_args(["--config", TINY, *shards(tmp_path / "bytes", {"tokenizer": "bytes", "vocab_size": 257}),
                      "--model.vocab_size=257", "--model.prefix_weight=0.25"])
    with pytest.raises(ConfigError, match=r"^model.prefix_weight = 0.25 trains each target's prefix token, the token "
                                          r"whose bytes are the longest proper prefix of its bytes, and the data's "
                                          r"tokenizer 'bytes' has none below model.vocab_size = 257 .*: set "
                                          r"model.prefix_weight = 0, or prepare the data with a tokenizer of longer "
                                          r"tokens \(e.g. gpt2\)$"):
        prefix_targets(cfg, resolve_data(cfg)[2])  # single bytes have no prefix token: the term would add nothing
    cfg = parse_args(["--config", TINY, *shards(tmp_path / "none"), "--model.vocab_size=257",
                      "--model.prefix_weight=0.25"])
    with pytest.raises(ConfigError, match=r"model.prefix_weight needs the data's tokenizer, which a meta.json .* "
                                          r"taken as GPT-2's, but model.vocab_size = 257, not 50257 "
                                          r"\(or up to the records' 50304\): prepare"):
        prefix_targets(cfg, resolve_data(cfg)[2])
    with pytest.raises(ConfigError, match=r"model.prefix_weight: unknown tokenizer 'nope'"):
        prefix_targets(cfg, {"tokenizer": "nope"})


def test_sorted_shards_read_in_order_each_token_once_in_rows_from_bos_the_ranks_taking_turns(tmp_path):
    """data.sorted_shards, record 46's order: the shards in sorted order every epoch, each front to back in rows that
    start at a document (BOS), the next row at the first BOS past the last (the rest of a cut document skipped),
    the ranks taking consecutive rows of each global batch."""
    data = short_docs_data(tmp_path / "docs", tokens=60_000, val_tokens=6_000, shard_tokens=20_000)
    order = ["--data.bos_aligned=true", "--data.shuffle=false", "--data.sorted_shards=true", "--data.seed=7"]
    cfg = parse_args(["--config", TINY, f"--data.train={data}/*_train_*.bin", f"--data.val={data}/*_val_*.bin",
                      *order])
    files, _, meta = resolve_data(cfg)
    tokens = {f: np.asarray(open_shard(f)) for f in files}
    bos, length, world, batch = meta["eot_token"], cfg.train.seq_len + 1, 2, cfg.train.batch_size

    def rows(world: int, steps: int) -> list[list[tuple]]:
        """Each rank's rows over `steps` global batches."""
        loaders = [train_loader(cfg, Dist(rank=r, world_size=world), files, meta) for r in range(world)]
        return [[row for _ in range(steps) for row in loader.next_places()] for loader in loaders]

    steps = 2 * sum(len(t) for t in tokens.values()) // (world * batch * length)  # past two epochs
    per_rank = rows(world, steps)
    glued = [row for s in range(steps) for mine in per_rank for row in mine[s * batch:(s + 1) * batch]]
    cfg.train.batch_size = world * batch
    assert rows(1, steps) == [glued]  # rank r takes rows [r * B, (r + 1) * B) of each global batch
    assert all(hi == lo + length for _, [(lo, hi)] in glued)  # one range a row: no document cut
    glued = [(f, lo) for f, [(lo, _)] in glued]
    places = [(files.index(f), start) for f, start in glued]
    ends = [i + 1 for i, (a, b) in enumerate(zip(places, places[1:])) if b < a]  # where the files start again
    assert len(ends) == 2
    first, second = glued[:ends[0]], glued[ends[0]:ends[1]]
    assert first == second  # the same order every epoch, whatever data.seed
    assert places[:ends[0]] == sorted(places[:ends[0]]) and {f for f, _ in first} == set(files)
    assert all(tokens[f][start] == bos for f, start in first)
    for (f, start), (g, nxt) in zip(first, first[1:]):  # no token twice, and only a cut document's rest skipped
        if f == g:
            assert nxt >= start + length and not (tokens[f][start + length:nxt] == bos).any()


def test_sorted_shards_need_the_sequential_stream(tmp_path):
    data = shards(tmp_path)
    with pytest.raises(ConfigError, match="data.sorted_shards reads each shard front to back in sorted order, but "
                                          "data.shuffle = true"):
        parse_args(["--config", TINY, *data, "--data.sorted_shards=true"])


def test_globs_that_match_no_token_file_or_the_val_set_or_another_tokenizers_val_are_refused(tmp_path):
    data = shards(tmp_path / "a", {"tokenizer": "bytes", "vocab_size": 257})
    for glob, matched in (("*", "meta.json"), ("*_train_*", None)):  # a folder named like a shard is no shard
        if matched is None:
            (tmp_path / "a" / "x_train_dir").mkdir()
        cfg = parse_args(["--config", TINY, f"--data.train={tmp_path / 'a' / glob}", data[1]])
        with pytest.raises(ConfigError, match=rf"data.train = '.*' matches (the folder .*x_train_dir|"
                                              rf"{tmp_path / 'a' / 'meta.json'}, data.prepare's description)"):
            resolve_data(cfg)
    (tmp_path / "a" / "x_train_dir").rmdir()
    cfg = parse_args(["--config", TINY, f"--data.train={tmp_path / 'a'}/*.bin", data[1]])
    with pytest.raises(ConfigError, match=r"both match .*a/test_val_000000.bin: the val loss would score tokens "
                                          r"trained on"):
        resolve_data(cfg)
    other = shards(tmp_path / "b", {"tokenizer": "gpt2", "vocab_size": 50257})
    cfg = parse_args(["--config", TINY, data[0], other[1]])
    with pytest.raises(ConfigError, match=r"the train shards' vocab_size is 257 \(.*a/meta.json\), the val "
                                          r"shards' 50257 \(.*b/meta.json\)"):
        resolve_data(cfg)
    resolve_data(parse_args(["--config", TINY, *data]))  # the same prepare's train and val: fine
    # the same tokenizer named another way (a path from elsewhere) is the same tokenizer
    same = shards(tmp_path / "c", {"tokenizer": "../bytes", "vocab_size": 257})
    resolve_data(parse_args(["--config", TINY, data[0], same[1]]))
