"""sha256 digests of the TokenLoader's and val_batches' streams: the batches and the resume state after each.

    python -m tests.stream_digests tests/data/loader_digests.json   # record them (from the loader in the tree)

The data is generated from fixed seeds, so a digest names a stream, not a set of files: a rewrite of the
loader that changes one token of one batch, or the state format, changes its digest.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

BATCHES = 2000  # per configuration: past many epoch ends in the small sets, one in the big one
BOS = 0
# folder -> (dtype per file, tokens per file, header); ids below 1000 (uint32 files: from 70,000 up)
FOLDERS = {
    "u16": (["<u2"] * 4, [9000, 40, 13000, 7003], True),
    "u32": (["<u4"] * 3, [6000, 11000, 5001], True),
    "raw": (["<u2"] * 3, [8000, 5003, 12000], False),
    "mixed": (["<u2", "<u4", "<u2"], [7000, 9001, 6000], True),
    "big": (["<u2"] * 2, [200_000, 200_003], True),
}
# name -> (folder, batch_size, seq_len, ranks of world_size, TokenLoader keywords, resume after this many batches)
CONFIGS = {
    "seq": ("u16", 4, 63, 1, {"shuffle": False}, 0),
    "seq_noseed": ("u16", 4, 63, 1, {"seed": None}, 0),
    "seq_bos": ("u16", 4, 63, 1, {"shuffle": False, "bos_id": BOS}, 0),
    "shuf": ("u16", 4, 63, 1, {}, 0),
    "shuf_seed7": ("u16", 3, 50, 1, {"seed": 7}, 0),
    "shuf_bos": ("u16", 4, 63, 1, {"bos_id": BOS}, 0),
    "shuf_k2": ("u16", 4, 63, 1, {"shuffle_shards": 2}, 0),
    "shuf_k2_bos": ("u16", 4, 63, 1, {"shuffle_shards": 2, "bos_id": BOS}, 0),
    "seq_w2": ("u16", 2, 63, 2, {"shuffle": False}, 0),
    "seq_bos_w2": ("u16", 2, 63, 2, {"shuffle": False, "bos_id": BOS}, 0),
    "shuf_w2": ("u16", 2, 63, 2, {}, 0),
    "shuf_bos_w2": ("u16", 2, 63, 2, {"bos_id": BOS}, 0),
    "shuf_k2_w2": ("u16", 2, 63, 2, {"shuffle_shards": 2}, 0),
    "shuf_bos_w3": ("u16", 1, 63, 3, {"bos_id": BOS}, 0),
    "seq_resume": ("u16", 4, 63, 1, {"shuffle": False}, 777),
    "seq_bos_resume": ("u16", 4, 63, 1, {"shuffle": False, "bos_id": BOS}, 777),
    "shuf_resume": ("u16", 4, 63, 1, {}, 777),
    "shuf_bos_resume": ("u16", 4, 63, 1, {"bos_id": BOS}, 777),
    "shuf_k2_resume_w2": ("u16", 2, 63, 2, {"shuffle_shards": 2}, 501),
    "seq_raw": ("raw", 4, 63, 1, {"shuffle": False, "fmt": "raw", "raw_dtype": "uint16"}, 0),
    "shuf_raw": ("raw", 4, 63, 1, {"fmt": "raw", "raw_dtype": "uint16"}, 0),
    "shuf_bos_raw": ("raw", 4, 63, 1, {"fmt": "raw", "raw_dtype": "uint16", "bos_id": BOS}, 0),
    "seq_u32": ("u32", 4, 63, 1, {"shuffle": False}, 0),
    "shuf_u32": ("u32", 4, 63, 1, {}, 0),
    "shuf_bos_u32": ("u32", 4, 63, 1, {"bos_id": BOS}, 0),
    "shuf_mixed": ("mixed", 4, 63, 1, {}, 0),
    "seq_bos_cut": ("u16", 4, 63, 1, {"shuffle": False, "bos_id": BOS, "doc_cut": 40}, 0),
    "seq_bos_cut_resume_w2": ("u16", 2, 63, 2, {"seed": None, "bos_id": BOS, "doc_cut": 40}, 777),
    "shuf_bos_mixed_w2": ("mixed", 2, 63, 2, {"bos_id": BOS}, 0),
    "seq_holdout": ("u16", 4, 63, 1, {"shuffle": False, "holdout_tokens": 500}, 0),
    "shuf_holdout": ("u16", 4, 63, 1, {"holdout_tokens": 500}, 0),
    "shuf_vocab": ("u16", 4, 63, 1, {"vocab_size": 1000}, 0),
    "shuf_big": ("big", 8, 31, 1, {}, 0),
    "shuf_bos_big_w2": ("big", 4, 31, 2, {"bos_id": BOS}, 0),
    "seq_big_resume": ("big", 8, 31, 1, {"shuffle": False}, 1500),
    "shuf_big_resume": ("big", 8, 31, 1, {"seed": 3}, 1500),
}
# name -> (folder, batch_size, seq_len, num_tokens, world_size, tail_tokens)
VAL = {
    "val": ("u16", 4, 63, 20_000, 1, 0),
    "val_w2": ("u16", 3, 50, 20_001, 2, 0),
    "val_tail": ("u16", 2, 63, 500, 1, 500),
    "val_u32_w3": ("u32", 2, 31, 5000, 3, 0),
}


def write_data(root: Path) -> None:
    """The folders of FOLDERS under root: documents of 3 to 300 tokens, each starting with BOS."""
    from data.shards import write_shard
    for name, (dtypes, sizes, header) in FOLDERS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(len(name))
        for i, (dtype, n) in enumerate(zip(dtypes, sizes)):
            tokens = rng.integers(1, 1000, size=n) + (70_000 if dtype == "<u4" else 0)
            starts = np.cumsum(rng.integers(3, 300, size=n))
            tokens[np.concatenate([[0], starts[starts < n]])] = BOS
            write_shard(folder / f"{name}_train_{i:06d}.bin", tokens, dtype=np.dtype(dtype), header=header)


def stream_digest(root: Path, name: str, batches: int = BATCHES) -> str:
    """The digest of configuration `name`: every rank's batches and states, rank by rank."""
    import torch
    from data.loader import TokenLoader
    folder, batch_size, seq_len, world, kwargs, resume = CONFIGS[name]
    h = hashlib.sha256()
    files = str(root / folder / "*.bin")
    for rank in range(world):
        def loader() -> TokenLoader:
            return TokenLoader(files, batch_size, seq_len, rank=rank, world_size=world, **kwargs)
        with loader() as first:
            for _ in range(resume):
                next(first)
            state = json.loads(json.dumps(first.state_dict()))  # plain types, as a checkpoint holds them
        with loader() as it:
            if resume:
                it.load_state_dict(state)
            for _ in range(batches - resume):
                x, y = next(it)
                assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (batch_size, seq_len)
                h.update(x.numpy().tobytes())
                h.update(y.numpy().tobytes())
                h.update(json.dumps(it.state_dict(), sort_keys=True).encode())
    return h.hexdigest()


def val_digest(root: Path, name: str) -> str:
    """The digest of val configuration `name`: every rank's batches, rank by rank."""
    from data.val import val_batches
    folder, batch_size, seq_len, num_tokens, world, tail = VAL[name]
    h = hashlib.sha256()
    for rank in range(world):
        for x, y in val_batches(str(root / folder / "*.bin"), batch_size, seq_len, num_tokens, rank=rank,
                                world_size=world, tail_tokens=tail):
            h.update(x.numpy().tobytes())
            h.update(y.numpy().tobytes())
    return h.hexdigest()


def main(out: str) -> None:
    """Record every digest into the JSON file `out`."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        write_data(Path(tmp))
        got = {"batches": BATCHES, "stream": {n: stream_digest(Path(tmp), n) for n in CONFIGS},
               "val": {n: val_digest(Path(tmp), n) for n in VAL}}
    Path(out).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
