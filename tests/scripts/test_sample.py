"""Sampling: a real tiny GPT saved as train.py's checkpoint.pt, the real byte tokenizer, the CLI in a subprocess."""
import base64
import json
import sys

import pytest
import torch

from data.tokenizer import get_tokenizer
from model import get_model
from model.generate import generate
from scripts.sample import SampleError, main, tokenizer_name
from tests.helpers import make_shards, run, tiny_args, tiny_data, train_args
from trainer.checkpoint import CheckpointError, load_checkpoint

TINY = {"vocab_size": 257, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint.pt in the contract form, with byte-tokenized train shards and their meta.json."""
    shards = tmp_path / "shards"
    make_shards(shards, [64], vocab=257, pattern="demo_train_{:06d}.bin")
    (shards / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 257}))
    config = {"data": {"train": str(shards / "demo_train_*.bin")}, "model": dict(TINY), "train": {}}
    torch.manual_seed(0)
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    torch.save({"config": config, "model": get_model(config).state_dict(), "step": 7}, path)
    return path


def sample_cli(path, *args, check=True):
    return run([sys.executable, "-m", "scripts.sample", str(path), *map(str, args)], timeout=120, check=check,
               env={"PYTHONIOENCODING": "utf-8"})


def test_cli_prints_prompt_then_the_seeded_sample(checkpoint):
    printed = sample_cli(checkpoint, "--prompt", "Hello", "--tokens", 20, "--top-k", 50, "--temperature", 0.9,
                         "--seed", 3).stdout
    # The same sample in-process, from a generator seeded alike: the seed alone fixes the output.
    model, _ = load_checkpoint(checkpoint)
    enc = get_tokenizer("bytes")
    prompt = torch.tensor([enc.encode("Hello")])
    out = generate(model, prompt, 20, 0.9, 50, vocab_size=257, generator=torch.Generator().manual_seed(3))
    assert out.shape == (1, 5 + 20) and torch.equal(out[:, :5], prompt)
    assert printed == "Hello" + enc.decode(out[0, 5:].tolist()) + "\n"


def test_greedy_and_top_k_use_a_sliding_window_of_block_size(checkpoint):
    model, _ = load_checkpoint(checkpoint)
    prompt = torch.tensor([[72, 101, 108]])
    greedy = generate(model, prompt, 12, temperature=0)  # 15 tokens from a model that sees at most 8
    assert torch.equal(generate(model, prompt, 12, temperature=1.0, top_k=1), greedy)
    sampled = generate(model, prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    for t in range(3, 15):
        with torch.no_grad():
            g_logits = model(greedy[:, max(0, t - 8):t])[0][0, -1]
            s_logits = model(sampled[:, max(0, t - 8):t])[0][0, -1]
        assert greedy[0, t] == g_logits.argmax()
        assert sampled[0, t] in torch.topk(s_logits, 3).indices


def test_vocab_size_limits_the_sampled_ids(checkpoint):
    model, _ = load_checkpoint(checkpoint)
    out = generate(model, torch.tensor([[1, 2]]), 30, vocab_size=10, generator=torch.Generator().manual_seed(0))
    assert out[0, 2:].max() < 10


def test_tokenizer_name_flag_then_meta_json(checkpoint, tmp_path):
    _, config = load_checkpoint(checkpoint)
    assert tokenizer_name(config) == "bytes"
    assert tokenizer_name(config, "gpt2") == "gpt2"
    (tmp_path / "shards" / "demo_train_000000.bin").unlink()  # no shard left: the glob's folder is still searched
    assert tokenizer_name(config) == "bytes"
    (tmp_path / "shards" / "meta.json").unlink()
    with pytest.raises(SampleError, match=r"meta.json: cannot read the tokenizer name .* pass --tokenizer NAME"):
        tokenizer_name(config)
    with pytest.raises(SampleError, match="no data.train glob"):
        tokenizer_name({"model": TINY})


def test_a_run_folder_samples_from_the_checkpoint_its_run_saved(checkpoint, tmp_path, capsys):
    args = ["--prompt", "Hi", "--tokens", 8, "--seed", 1]
    assert main([str(checkpoint), *map(str, args)]) == 0
    want = capsys.readouterr().out
    folder = checkpoint.parent  # holds checkpoint.pt only, as a run killed before it wrote config.toml
    assert main([str(folder), *map(str, args)]) == 0 and capsys.readouterr().out == want
    # moved since (or trained from another folder): summary.json names a path that is not there now; its own is
    (folder / "summary.json").write_text(json.dumps({"checkpoint_path": f"runs/{folder.name}/checkpoint.pt"}))
    assert main([str(folder), *map(str, args)]) == 0 and capsys.readouterr().out == want
    (folder / "summary.json").unlink()
    # elsewhere, as train.checkpoint_path puts it: config.toml names it, summary.json (once finished) too
    elsewhere = tmp_path / "out" / "named.pt"
    elsewhere.parent.mkdir()
    checkpoint.rename(elsewhere)
    (folder / "config.toml").write_text(f'[train]\ncheckpoint_path = "{elsewhere}"\n')
    assert main([str(folder), *map(str, args)]) == 0 and capsys.readouterr().out == want
    (folder / "config.toml").write_text('[train]\ncheckpoint_path = ""\n')
    (folder / "summary.json").write_text(json.dumps({"checkpoint_path": str(elsewhere)}))
    assert main([str(folder), *map(str, args)]) == 0 and capsys.readouterr().out == want
    (folder / "summary.json").unlink()
    assert main([str(folder), *map(str, args)]) == 2
    assert capsys.readouterr().err == (f"sample: {folder}: its run saved no checkpoint at {folder / 'checkpoint.pt'} "
                                       f"(yet); train it to its first save (the end of the run, or "
                                       f"train.checkpoint_every_s), or pass a checkpoint.pt\n")


def test_a_run_that_saves_no_checkpoint_and_a_folder_of_runs_say_so(tmp_path, capsys):
    # both said "saved no checkpoint at .../checkpoint.pt (yet); train it to its first save", which never comes
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    run([sys.executable, *tiny_args(data, runs, "off", "--train.max_steps=2", "--train.save_checkpoint=false")])
    run([sys.executable, *tiny_args(data, runs, "on", "--train.max_steps=2")])
    assert main([str(runs / "off")]) == 2
    assert capsys.readouterr().err == (f"sample: {runs / 'off'}: its run saves no checkpoint (train.save_checkpoint = "
                                       f"false in its config.toml), so there is nothing to sample; train it again "
                                       f"with train.save_checkpoint = true\n")
    assert main([str(runs)]) == 2
    assert capsys.readouterr().err == (f"sample: {runs}: a folder of 2 runs (on, off), not a run; pass one of them, "
                                       f"e.g. the newest: {runs / 'on'}\n")


def test_bad_checkpoints_are_named(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list.pt: expected a dict with keys 'config' and 'model'"):
        load_checkpoint(tmp_path / "list.pt")
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["config"]["model"]["n_embd"] = 32
    torch.save(ckpt, tmp_path / "mismatch.pt")
    with pytest.raises(CheckpointError, match="mismatch.pt: its config and weights do not make a model"):
        load_checkpoint(tmp_path / "mismatch.pt")
    # a run's summary.json named by mistake: torch's own text would advise weights_only=False, which runs a file's code
    (tmp_path / "summary.json").write_text('{"run_id": "r"}')
    with pytest.raises(CheckpointError, match=r"summary.json: cannot be loaded as a checkpoint: it is not a file "
                                              r"torch.save wrote") as e:
        load_checkpoint(tmp_path / "summary.json")
    assert "weights_only" not in str(e.value)


def test_a_device_torch_cannot_use_is_named(checkpoint, capsys):
    for device in ("bogus", *(() if torch.cuda.is_available() else ("cuda",))):
        assert main([str(checkpoint), "--device", device]) == 2
        assert capsys.readouterr().err.startswith(f"sample: --device {device}: torch cannot use it here (")


def test_cli_without_a_tokenizer_says_what_to_pass(checkpoint, tmp_path):
    (tmp_path / "shards" / "meta.json").unlink()
    proc = sample_cli(checkpoint, "--tokens", 2, check=False)
    assert proc.returncode == 2 and "pass --tokenizer NAME" in proc.stderr
    # An empty prompt starts a document: the sample conditions on <|endoftext|> (256 in the byte tokenizer).
    out = sample_cli(checkpoint, "--tokens", 6, "--tokenizer", "bytes", "--seed", 0).stdout
    model, _ = load_checkpoint(checkpoint)
    want = generate(model, torch.tensor([[256]]), 6, 0.8, vocab_size=257, generator=torch.Generator().manual_seed(0))
    assert out == get_tokenizer("bytes").decode(want[0, 1:].tolist()) + "\n"


def test_a_tokenizer_larger_than_the_model_is_refused(checkpoint, tmp_path, capsys):
    # 256 bytes plus two merges: "ll" gets id 257, one past the tiny model's 257 ids.
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll"]
    rank_file = tmp_path / "big.tiktoken"
    rank_file.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    assert main([str(checkpoint), "--prompt", "hello", "--tokenizer", str(rank_file), "--force"]) == 2
    assert "tokenizer 'big' gives id 257 but the model has only 257 ids" in capsys.readouterr().err


def test_a_tokenizer_of_another_vocabulary_is_refused_unless_forced(tmp_path):
    # a 32,000-id model (the hackathon's vocabulary) sampled through the 257-id byte tokenizer
    config = {"data": {"train": str(tmp_path / "none_*.bin")}, "model": {**TINY, "vocab_size": 32000}}
    path = tmp_path / "checkpoint.pt"
    torch.save({"config": config, "model": get_model(config).state_dict(), "step": 1}, path)
    proc = sample_cli(path, "--tokenizer", "bytes", "--tokens", 4, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == ("sample: tokenizer 'bytes' has 257 ids but the model was trained on 32000: another "
                           "tokenizer's ids mean other text, so the sample would be garbage; pass the model's "
                           "tokenizer (the meta.json beside its training shards names it), or --force to sample "
                           "anyway\n")
    out = sample_cli(path, "--tokenizer", "bytes", "--tokens", 4, "--prompt", "ab", "--force", "--seed", 0).stdout
    assert out.startswith("ab") and len(out.encode()) > 3  # ids below 257 only: bytes the tokenizer can decode


def test_a_model_over_the_tokenizers_padded_vocabulary_samples_without_force(tmp_path, capsys):
    """The speedrun's 50,304 ids over GPT-2's 50,257: here 384 over the bytes' 257; only its ids are sampled."""
    config = {"data": {"train": str(tmp_path / "none_*.bin")}, "model": {**TINY, "vocab_size": 384}}
    path = tmp_path / "checkpoint.pt"
    torch.save({"config": config, "model": get_model(config).state_dict(), "step": 1}, path)
    assert main([str(path), "--tokenizer", "bytes", "--tokens", "8", "--prompt", "ab", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    config["model"]["vocab_size"] = 385  # past the padding: another tokenizer's
    torch.save({"config": config, "model": get_model(config).state_dict(), "step": 1}, path)
    assert main([str(path), "--tokenizer", "bytes", "--tokens", "8"]) == 2
    assert "tokenizer 'bytes' has 257 ids but the model was trained on 385" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_and_leaderboard_read_a_real_training_run(tmp_path):
    shards = tmp_path / "shards"
    make_shards(shards, [20_000], vocab=257, pattern="demo_train_{:06d}.bin")
    make_shards(shards, [4_096], vocab=257, seed=1, pattern="demo_val_{:06d}.bin")
    (shards / "meta.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 257, "eot_token": 256}))
    run([sys.executable, *train_args(shards, tmp_path / "runs", "r1", "--train.max_steps=3", "--eval.tokens=2048")],
        timeout=300)
    out = sample_cli(tmp_path / "runs" / "r1" / "checkpoint.pt", "--prompt", "import os", "--tokens", 8).stdout
    assert out.startswith("import os") and len(out) > len("import os\n")
    summary = json.loads((tmp_path / "runs" / "r1" / "summary.json").read_text())
    assert summary["checkpoint_path"] == str(tmp_path / "runs" / "r1" / "checkpoint.pt")
    # the run folder stands for the checkpoint its run saved: the same seeded sample
    args = ("--prompt", "import os", "--tokens", 8, "--seed", 2)
    assert sample_cli(tmp_path / "runs" / "r1", *args).stdout == sample_cli(summary["checkpoint_path"], *args).stdout
    table = run([sys.executable, "-m", "scripts.leaderboard", str(tmp_path / "runs")]).stdout.splitlines()
    cells = table[1].split()
    assert cells[:2] + cells[3:6] == ["tiny", "tiny", "1", "r1", "0"]  # track, config, runs, run ids, reached


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for default in ["(default: start a new document)", "(default: 200)", "(default: 0.8)", "(default: all)",
                    "(default: a fresh one each run)", "(default: from meta.json)", "(default: cuda where there is"]:
        assert default in text, default


def test_ctrl_c_while_sampling_ends_quietly(checkpoint):
    import os
    import signal
    import subprocess
    import time

    from tests.helpers import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "scripts.sample", str(checkpoint), "--tokens", "10000000"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(10)  # torch imported, sampling
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "", err[-2000:]
