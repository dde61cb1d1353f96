"""A record-like script, its log and its shards, made here in the formats of modded-nanogpt's records (code above
a line of 100 "=", then `step:S/N ...` lines; llm.c shards of GPT-2 ids whose documents open with 50256), for the
harness's tests: the real script needs CUDA and is not ours to copy."""
from pathlib import Path

import numpy as np

from data.shards import write_shard

BOS = 50256
# Our own stand-in for a record's script: its Hyperparameters and warm-up line in the form the harness reads,
# sized for a tiny shape of ours (2 x 160 tokens a micro-step, 8 micro-steps, stages x 1, 2, 3): the record's
# own micro-batches (an eighth of a step) need 300 tokens at least.
RECORD = '''import os  # a record-like script: é, to count offsets in bytes
from dataclasses import dataclass
import uuid

@dataclass
class Hyperparameters:
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 4 * 2560  # several val batches
    train_bs_schedule: tuple = (2 * 160 * 8, 4 * 160 * 8, 6 * 160 * 8)
    train_bs_extension: int = 6 * 160 * 8
    train_max_seq_len: int = 160
    val_batch_size: int = 8 * 320
    num_scheduled_iterations: int = 90  # steps of the schedule
    num_extension_iterations: int = 10
    num_iterations: int = num_scheduled_iterations + num_extension_iterations
    run_id: str = f"{uuid.uuid4()}"
    val_loss_every: int = 25
    block_size: int = 16
    ws_schedule: tuple = (1, 2, 3)
    ws_final: int = 4

args = Hyperparameters()
warmup_steps = 10
raise SystemExit("this stand-in of a record's script does not train")
'''


def record_script(folder: Path) -> Path:
    """RECORD as a file."""
    path = folder / "train_gpt.py"
    path.write_text(RECORD)
    return path


def record_log(path: Path, evals: dict[int, tuple[float, int]], steps: int, code: str = RECORD) -> Path:
    """A log as a record's run writes one: its code, a line of '=', the environment, then a line per step and per
    eval (`evals`: step -> (val loss, training ms)), and its peak memory."""
    lines = [code.rstrip("\n"), "=" * 100, "Running Python 3.12", "Running PyTorch 2.11", "=" * 100]
    for step in range(steps + 1):
        if step in evals:
            loss, ms = evals[step]
            lines.append(f"step:{step}/{steps} val_loss:{loss:.4f} train_time:{ms}ms step_avg:{ms / max(step, 1):.2f}ms")
        if step < steps:
            lines.append(f"step:{step + 1}/{steps} train_time:{(step + 1) * 10}ms step_avg:10.00ms")
    lines.append("peak memory allocated: 1234 MiB reserved: 2345 MiB")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def documents(lengths: list[int], seed: int = 0) -> np.ndarray:
    """Documents of these lengths, each opening with BOS, of random GPT-2 ids."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[BOS], rng.integers(0, BOS, n - 1)]) for n in lengths]
    return np.concatenate(docs).astype(np.uint16)


def record_shards(data: Path, train: list[list[int]], val_tokens: int) -> Path:
    """DATA/data/fineweb10B/ with a val shard of `val_tokens` and one train shard per list of document lengths."""
    folder = data / "data" / "fineweb10B"
    rng = np.random.default_rng(1)
    write_shard(folder / "fineweb_val_000000.bin", documents(list(rng.integers(50, 300, val_tokens // 50)))[:val_tokens],
                dtype=np.uint16)
    for i, lengths in enumerate(train, 1):
        write_shard(folder / f"fineweb_train_{i:06d}.bin", documents(lengths, seed=i), dtype=np.uint16)
    return data
