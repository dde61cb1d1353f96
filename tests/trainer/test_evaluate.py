"""The val loss counts what the speedrun records count: every target once, each seeing only its document's
prefix inside its eval sequence, up to the attention window; the same number under 1 and 2 ranks; and what an
eval says while it runs."""
import json
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import trainer.evaluate
from data.shards import write_shard
from model import get_model
from tests.helpers import VOCAB, growing_window_run, run, tiny_args, tiny_data, torchrun
from trainer.config import ConfigError, parse_args
from trainer.state import Hooks

BOS, WINDOW, EVAL_LEN = 256, 6, 48
# 4 sequences of 48 and one of 20; in eval batches of 2 rows, under 2 ranks rank 1's last batch is padding only
EVAL_TOKENS = 4 * EVAL_LEN + 20
# rotary, so that eval sequences may be longer than block_size = train.seq_len; a window shorter than most
# documents, so that it binds
MODEL = ["--model.rotary=true", "--model.doc_causal=true", f"--model.bos_id={BOS}", f"--model.window={WINDOW}",
         "--model.norm=rmsnorm", "--model.qk_norm=true", "--model.activation=relu2", "--model.tie_embeddings=false",
         "--model.logit_softcap=15.0", "--model.value_embeds=1", "--model.unet_skips=true",
         "--model.block_size=16", "--train.seq_len=16"]
EVAL = [f"--eval.seq_len={EVAL_LEN}", "--eval.batch_size=2", f"--eval.tokens={EVAL_TOKENS}", "--train.max_steps=3"]


def val_documents(n: int, rng: np.random.Generator) -> np.ndarray:
    """n tokens of documents of 1 to 30 tokens, each opened by BOS (bytes-tokenizer ids)."""
    tokens, starts = rng.integers(0, BOS, size=n), np.cumsum(rng.integers(1, 31, size=n))
    tokens[0], tokens[starts[starts < n]] = BOS, BOS
    return tokens


def direct_val_loss(model: torch.nn.Module, stream: np.ndarray) -> float:
    """Token by token: the loss of target i + 1 from a forward over only the inputs it may depend on.

    Input i sees the inputs of its document (from the last BOS at or before it) inside its eval sequence
    [i // EVAL_LEN * EVAL_LEN, ...), at most WINDOW - 1 back in every layer: so after n_layer layers its output
    depends on inputs down to n_layer * (WINDOW - 1) back, and a fresh sequence starting there computes it exactly.
    """
    reach, losses = model.cfg.n_layer * (WINDOW - 1), []
    with torch.no_grad():
        for i in range(len(stream) - 1):
            first = i // EVAL_LEN * EVAL_LEN
            docs = [j for j in range(first, i + 1) if stream[j] == BOS]
            context = stream[max(docs[-1] if docs else first, i - reach):i + 1]
            logits, _ = model(torch.tensor(context)[None])
            losses.append(float(F.cross_entropy(logits[0, -1], torch.tensor(int(stream[i + 1])))))
    return float(np.mean(losses))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tiny_data(tmp_path_factory.mktemp("data"))
    stream = val_documents(300, np.random.default_rng(0))
    write_shard(folder / "test_val_000000.bin", stream)  # replaces tiny_data's random val shard
    cuts = stream[EVAL_LEN:EVAL_TOKENS:EVAL_LEN]
    assert (cuts != BOS).any() and (stream[:EVAL_TOKENS] == BOS).sum() > 8  # documents cut by the sequences
    return folder, stream[:EVAL_TOKENS + 1]


@pytest.mark.parametrize("world", [1, 2])
def test_val_loss_is_each_target_seeing_its_document_up_to_the_window(data, tmp_path, world):
    folder, stream = data
    argv = tiny_args(folder, tmp_path, "eval", *MODEL, *EVAL, "--train.parallel=fsdp")
    if world == 1:
        run([sys.executable, *argv])
    else:
        torchrun(argv, nproc=world)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["world_size"] == world and summary["steps"] == 3
    ckpt = torch.load(tmp_path / "eval" / "checkpoint.pt", weights_only=True)
    model = get_model(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    model.eval()
    assert summary["final_val_loss"] == pytest.approx(direct_val_loss(model, stream), abs=1e-5)


def test_eval_longer_than_the_position_table_is_refused_and_rotary_takes_any_length():
    base = ["--config", "configs/tiny.toml", "--data.train=x", "--eval.seq_len=128"]
    with pytest.raises(ConfigError, match=r"eval.seq_len = 128 is longer than model.block_size = 64, the size of "
                                          r"the learned position table \(model.rotary = false\); lower eval.seq_len"):
        parse_args(base)
    cfg = parse_args([*base, "--model.rotary=true", "--model.vocab_size=257"])
    torch.manual_seed(0)
    model = get_model(cfg.to_dict())
    assert model(torch.zeros((1, 128), dtype=torch.long))[0].shape == (1, 128, 257)
    with pytest.raises(ConfigError, match="eval.seq_len must be >= 0"):
        parse_args([*base, "--eval.seq_len=-1"])


def test_loss_skips_ignored_targets_so_sum_over_count_is_exact():
    torch.manual_seed(0)
    model = get_model(dict(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, VOCAB, (2, 16))
    y = torch.randint(0, VOCAB, (2, 16))
    y[1, 5:] = -100
    with torch.no_grad():
        logits, _ = model(x)
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        _, loss = model(x, y)
        _, nothing = model(x, torch.full_like(y, -100))
    assert float(loss) * int((y != -100).sum()) == pytest.approx(float(per_token.sum()), rel=1e-6)
    assert torch.isnan(nothing)


def test_speedrun_configs_cut_the_val_set_as_the_records_do():
    for name in ("speedrun_8xh100", "speedrun_1gpu"):
        cfg = parse_args(["--config", f"configs/{name}.toml"])
        e, m = cfg.eval, cfg.model
        # 40 sequences of 4 x 64K, one a forward: 5 per rank on 8 GPUs, with no padding
        assert (e.tokens, e.seq_len, e.batch_size) == (10_485_760, 4 * 64 * 1024, 1) and e.tokens % e.seq_len == 0
        assert m.rotary and m.doc_causal and m.window and e.target_loss == 3.28


# 2,048 targets in sequences of 64, 4 rows a batch: 8 batches; one target: one batch, and "1 token"
@pytest.mark.parametrize("tokens, start_line, batches", [(2048, "eval of 2,048 tokens: 8 batches", 8),
                                                          (1, "eval of 1 token: 1 batch", 1)])
def test_an_eval_says_when_it_starts_and_how_far_it_got(tmp_path, monkeypatch, capsys, tokens, start_line, batches):
    run = growing_window_run(tmp_path, "--data.val=holdout", f"--eval.tokens={tokens}")
    monkeypatch.setattr(trainer.evaluate, "EVAL_PROGRESS_S", 0.0)  # a progress line after every batch
    try:
        val = trainer.evaluate.eval_and_record(run, on_clock=False)
    finally:
        run.loader.close()
        run.log.close()
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"step 0 | {start_line} per rank")
    progress = [line.split(",")[0] for line in lines[start + 1:] if line.startswith("eval: ")]
    assert progress == [f"eval: {k}/{batches} batches" for k in range(1, batches + 1)]
    assert f"step 0 | val loss {val:.4f}" in lines[-1]


def test_an_eval_scores_its_loss_a_chunk_at_a_time_and_keeps_no_logits(tmp_path, monkeypatch):
    """train.py's evals take GPT.scored_loss, never the whole [B, T, V] logits an evaluator of the checkpoint gets:
    those of the speedrun's 262,144-token eval sequences would be 50 GB."""
    from model.gpt import GPT

    run = growing_window_run(tmp_path, "--data.val=holdout", "--eval.tokens=2048")
    scored, whole = [], GPT.logits
    monkeypatch.setattr(GPT, "scored_loss", lambda self, x, y: scored.append(y.numel()) or torch.tensor(1.0))
    monkeypatch.setattr(GPT, "logits", lambda self, x, *a: whole(self, x, *a) if x.dim() == 2 else pytest.fail(
        "the eval made the logits of whole rows"))
    try:
        trainer.evaluate.eval_and_record(run, on_clock=False)
    finally:
        run.loader.close()
        run.log.close()
    assert sum(scored) == 8 * 4 * 64  # every batch's targets, padding included


class Scored(Hooks):
    """Evals that score the given losses in turn, without reading the model."""

    def __init__(self, losses: list[float]):
        self.losses = iter(losses)

    def evaluate(self, stage, run) -> float:
        return next(self.losses)


@pytest.mark.parametrize("target_time, scores, timed", [
    ("first_eval", [1.0, 1.0, 9.0], "step 5"), ("end", [1.0, 1.0, 9.0], None), ("end", [9.0, 9.0, 1.0], "end")])
def test_under_target_time_end_only_the_final_eval_times_the_run(tmp_path, target_time, scores, timed):
    """Evals at steps 5, 10 and 15 (the last, the final one) scoring `scores` against a target of 2: "first_eval"
    times the first under it; "end" the whole run, only where the final eval is under it, whatever the evals along
    the way scored."""
    import train

    run = growing_window_run(tmp_path, "--data.val=holdout", "--eval.tokens=2048", "--train.max_steps=15",
                             "--eval.every_steps=5", "--eval.target_loss=2", f"--eval.target_time={target_time}")
    run.hooks = Scored(scores)
    train.finish(run, train.train(run))
    summary = json.loads((tmp_path / "runs" / "w" / "summary.json").read_text())
    evals = [json.loads(line) for line in (tmp_path / "runs" / "w" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [(e["step"], e["val_loss"]) for e in evals] == list(zip((5, 10, 15), scores))
    got = summary["time_to_target_s"]
    if timed == "step 5":
        # the eval reads the clock twice, a few statements apart (its time, then its record): 0.1 s holds them
        assert got == pytest.approx(evals[0]["elapsed_s"], abs=0.1) and got < evals[1]["elapsed_s"]
    else:
        assert got == (summary["train_time_s"] if timed == "end" else None)


class Slow(Scored):
    """Scored evals that each take 0.3 s; `windows` holds the model's attention window at each."""

    def __init__(self, losses: list[float]):
        super().__init__(losses)
        self.windows = []

    def evaluate(self, stage, run) -> float:
        self.windows.append(run.model.module.window)
        time.sleep(0.3)
        return super().evaluate(stage, run)


@pytest.mark.parametrize("timing", ["exclude_warmup", "from_first_forward"])
def test_an_eval_at_start_scores_the_untrained_model_and_is_timed_as_any_eval(tmp_path, timing):
    """eval.at_start: an eval before step 1, logged at step 0 with no tokens, at step 0's attention window (a new
    model has the final one); off the clock under exclude_warmup, on it under from_first_forward, as the evals at
    steps 5 and 10 are."""
    import train

    run = growing_window_run(tmp_path, "--data.val=holdout", "--eval.tokens=2048", "--train.max_steps=10",
                             "--eval.every_steps=5", "--eval.at_start=true", f"--train.timing={timing}")
    run.hooks = hooks = Slow([9.0, 5.0, 4.0])
    assert run.model.module.window == 40
    train.finish(run, train.train(run))
    assert hooks.windows[0] == 8
    evals = [json.loads(line) for line in (tmp_path / "runs" / "w" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [(e["step"], e["tokens"], e["val_loss"]) for e in evals] == [(0, 0, 9.0), (5, 5 * 512, 5.0),
                                                                        (10, 10 * 512, 4.0)]
    if timing == "exclude_warmup":  # the clock ran only between its start and the eval's pause
        assert evals[0]["elapsed_s"] < 0.3
    else:
        assert evals[0]["elapsed_s"] >= 0.3 and evals[1]["elapsed_s"] >= 0.6


def test_an_eval_at_start_that_spends_the_budget_or_reaches_the_target_ends_the_run_as_any_eval(tmp_path):
    """On the clock (from_first_forward), a first eval that outlasts the budget is followed by no step, and one
    at the target stops the run under eval.stop_at_target."""
    import train
    from trainer.state import StopReason

    for extra, scores, why in ((["--train.budget_s=0.2"], [9.0], StopReason.BUDGET),
                               (["--eval.target_loss=10", "--eval.stop_at_target=true"], [9.0], StopReason.TARGET)):
        run = growing_window_run(tmp_path / why.name, "--data.val=holdout", "--eval.tokens=2048",
                                 "--eval.at_start=true", "--train.timing=from_first_forward", "--train.max_steps=10",
                                 *extra)
        run.hooks = Slow(scores)
        status = train.train(run)
        run.loader.close()
        run.log.close()
        assert (status, run.progress.step) == (why, 0)
