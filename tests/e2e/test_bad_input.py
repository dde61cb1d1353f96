"""Bad input end to end: the CLIs refuse it before any work with one line naming the file or key and the fix.

The unit-level cases (every shard corruption, typo keys, wrong types, bad .tiktoken files, prepare's other
settings) live with their owners (test_shards, test_config, test_tokenizer, test_prepare); here are the
cases where the command line's behaviour adds something: a user running train.py or data.prepare sees
one line, not a traceback, and no training step runs on data that would fail later.
"""
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.shards import write_shard
from tests.helpers import ROOT, TRAIN, VOCAB, run, tiny_args, tiny_data, torchrun
from trainer.config import ConfigError, parse_args


def truncated(folder: Path) -> tuple[list[str], list[str]]:
    """A train shard two bytes short."""
    tiny_data(folder)
    path = folder / "test_train_000001.bin"
    path.write_bytes(path.read_bytes()[:-2])
    return [], [f"{path}: truncated", "re-create or re-download it"]


def id_beyond_vocab(folder: Path) -> tuple[list[str], list[str]]:
    """Token id 300 in every window of a 257-token vocabulary."""
    tiny_data(folder)
    tokens = np.arange(6000) % VOCAB
    tokens[10::50] = 300  # in every window, so in the first the shuffled stream takes: caught before the first step
    write_shard(folder / "test_train_000000.bin", tokens)
    return [], [f"{folder / 'test_train_000000.bin'}: token id 300 at token ", "is >= vocab_size 257", "re-tokenize"]


def shards_shorter_than_seq_len(folder: Path) -> tuple[list[str], list[str]]:
    """Train shards of 40 and 50 tokens for seq_len 64."""
    tiny_data(folder, train_sizes=(40, 50))
    return [], ["seq_len + 1 = 65 tokens is longer than every file", "lower seq_len or use bigger shards"]


def small_val_set(folder: Path) -> tuple[list[str], list[str]]:
    """1000 val tokens for eval.tokens = 2048."""
    tiny_data(folder, val_tokens=1000)  # tiny_args asks for eval.tokens = 2048
    return [], ["holds 1,000 tokens", "eval.tokens", "at most 999"]


def no_matching_file(folder: Path) -> tuple[list[str], list[str]]:
    """A typo in the train glob."""
    tiny_data(folder)
    return [f"--data.train={folder}/*_trian_*.bin"], [f"data.train = '{folder}/*_trian_*.bin' matches no file"]


def doc_mask_token_outside_the_vocabulary(folder: Path) -> tuple[list[str], list[str]]:
    """doc_causal with GPT-2's bos_id 50256 on 257-token data: the mask would silently be plain causal."""
    tiny_data(folder)
    return ["--model.doc_causal=true"], ["model.bos_id = 50256 is not a token of the vocabulary",
                                         "turn model.doc_causal off"]


def no_meta_json(folder: Path) -> tuple[list[str], list[str]]:
    """Shards without the meta.json that model.vocab_size = 0 reads."""
    tiny_data(folder)
    return ["--model.vocab_size=0"], [f"{folder / 'meta.json'} is missing (data.prepare writes one beside its "
                                      f"shards", "set --model.vocab_size=N"]


def fineweb_not_fetched(folder: Path) -> tuple[list[str], list[str]]:
    """FineWeb shards (fetch_fineweb's names) that were never fetched."""
    tiny_data(folder)
    return [f"--data.train={folder}/fw/fineweb_train_*.bin"], [
        f"fetch the FineWeb shards with python -m scripts.fetch_fineweb --shards N --out {folder / 'fw'} "]


CASES = {f.__name__: f for f in (truncated, id_beyond_vocab, shards_shorter_than_seq_len, small_val_set,
                                 no_matching_file, doc_mask_token_outside_the_vocabulary, no_meta_json,
                                 fineweb_not_fetched)}
@pytest.mark.parametrize("case", list(CASES))
def test_train_refuses_bad_data_before_the_first_step(tmp_path, case):
    extra, needles = CASES[case](tmp_path / "data")
    proc = run([sys.executable, *tiny_args(tmp_path / "data", tmp_path / "runs", "bad", *extra)], check=False,
               timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)
    metrics = tmp_path / "runs" / "bad" / "metrics.jsonl"
    assert not metrics.exists() or '"type": "train"' not in metrics.read_text(), "training ran on bad input"
    assert case == "id_beyond_vocab" or not (tmp_path / "runs").exists()  # only a batch read finds that one


@pytest.mark.parametrize("keys", [["--train.compile=true"], ["--optim.name=muon", "--optim.muon_compile=true"]])
def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused_in_one_line_before_the_first_step(tmp_path, keys):
    """Inductor builds its CPU kernels with a C++ compiler; a machine with Python alone has none (CXX names one
    that is not there)."""
    tiny_data(tmp_path / "data")
    proc = run([sys.executable, *tiny_args(tmp_path / "data", tmp_path / "runs", "cc", *keys)],
               env={"CXX": str(tmp_path / "no-such-g++")}, check=False, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    key = keys[-1].split("=")[0]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train.py: config error: {key[2:]} on CPU: inductor builds its kernels with a C++ compiler and found "
        f"none (it tried {tmp_path / 'no-such-g++'}); install g++ or clang++ (CXX names another), or set "
        f"{key}=false")
    assert not (tmp_path / "runs" / "cc" / "metrics.jsonl").exists()


def test_val_ids_beyond_the_vocabulary_stop_two_ranks_before_the_first_step(tmp_path):
    """The holdout val set (data.val = 'holdout': the last eval.tokens of the train data, which training never
    reads) holds an id the vocabulary lacks: refused at setup, in one line from the two ranks, not by the
    model's embedding lookup at the final eval."""
    data = tiny_data(tmp_path / "data")
    path = data / "test_train_000001.bin"
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=20000)
    tokens[-50] = 300  # in the last 2048 tokens (tiny_args' eval.tokens)
    write_shard(path, tokens)
    proc = torchrun(tiny_args(data, tmp_path / "runs", "oov", "--data.val=holdout"), check=False)
    assert proc.returncode != 0
    message = f"train.py: data error: {path}: token id 300 at token 19950 is >= vocab_size 257"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert f'File "{TRAIN}"' not in proc.stderr, proc.stderr[-3000:]  # no traceback from train.py itself
    metrics = tmp_path / "runs" / "oov" / "metrics.jsonl"
    assert not metrics.exists() or '"type": "train"' not in metrics.read_text(), "training ran on bad val data"


@pytest.mark.parametrize("override, key", [
    ("--train.budget_s=-5", "train.budget_s"),
    ("--train.max_steps=-1", "train.max_steps"),
    ("--eval.tokens=0", "eval.tokens"),
    ("--eval.every_s=-1", "eval.every_s"),
    ("--train.checkpoint_every_s=-10", "train.checkpoint_every_s"),
    ("--train.dist_timeout_s=0", "train.dist_timeout_s"),
])
def test_negative_or_zero_amounts_are_refused(override, key):
    argv = ["--config", str(ROOT / "configs" / "tiny.toml"), "--data.train=x", "--data.val=y"]
    if key == "train.max_steps":
        argv += ["--train.schedule=time", "--train.budget_s=60"]  # max_steps is only a bound here
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_args([*argv, override])


def test_a_missing_datasets_text_field_is_one_line(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": 1, "body": "some text"}]), folder / "part.parquet")
    proc = run([sys.executable, "-m", "data.prepare", "--dataset", str(folder), "--text-field", "content",
                "--tokenizer", "bytes", "--workers", "1", "--out", str(tmp_path / "out")], check=False, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    # datasets' own progress lines may come first; the error is the one last line
    assert proc.stderr.strip().splitlines()[-1] == (
        f"prepare: error: dataset '{folder}' has no column 'content'; available columns: ['body', 'id']. "
        f"Pass the right one with --text-field")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.bin"))


def test_a_meta_json_that_is_not_json_is_named(tmp_path):
    tiny_data(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    proc = run([sys.executable, *tiny_args(tmp_path, tmp_path / "runs", "meta", "--data.val=")], check=False,
               timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(tmp_path / "meta.json") in proc.stderr.strip().splitlines()[-1]


def test_the_speedrun_config_without_its_shards_says_how_to_fetch_them(tmp_path):
    proc = run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "speedrun_8xh100.toml")],
               check=False, cwd=tmp_path, timeout=240)  # a folder without shards/fineweb10B
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "train.py: config error: data.train = 'shards/fineweb10B/fineweb_train_*.bin' matches no file; fetch the "
        "FineWeb shards with python -m scripts.fetch_fineweb --shards N --out shards/fineweb10B (N train shards of "
        "100M tokens each), or run bash run.sh on a GPU machine, which fetches them"), proc.stderr[-3000:]
