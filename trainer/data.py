"""The config's data section made concrete: its files, the meta.json beside them (checked against the model
keys), and the training and validation loaders train.py builds from them."""
from __future__ import annotations

import os
import sys
from glob import glob
from pathlib import Path
from typing import Iterator

import torch

from data.loader import TokenLoader, val_batches
from data.meta import META, MetaError, read_meta
from trainer.config import Config, ConfigError
from trainer.distributed import Dist


def resolve_data(cfg: Config) -> tuple[list[str], list[str], dict]:
    """Sorted train and val files, and the meta.json beside the train files ({} if none).

    Fills model.vocab_size from meta.json when it is 0; checks model.bos_id against it for doc_causal.
    """
    files = sorted(glob(cfg.data.train))
    if not files:
        raise ConfigError(f"data.train = {cfg.data.train!r} matches no file; point it at your token shards "
                          f"(python -m data.prepare writes them) or pass --data_dir")
    val_files = files if cfg.data.val == "holdout" else sorted(glob(cfg.data.val)) if cfg.data.val else []
    if cfg.data.val and not val_files:
        raise ConfigError(f"data.val = {cfg.data.val!r} matches no file; give a glob of validation shards, "
                          f"'holdout' (the tail of the train data) or '' (no evals)")
    folder = Path(files[0]).parent
    try:
        meta = read_meta(folder)
    except MetaError as e:
        raise ConfigError(str(e)) from None
    _apply_meta(cfg, meta, folder / META)
    return files, val_files, meta


def _apply_meta(cfg: Config, meta: dict, meta_path: Path) -> None:
    """Warn about an unfinished data.prepare; fill model.vocab_size = 0 from `meta`; check model.bos_id."""
    if meta.get("complete") is False and os.environ.get("RANK", "0") == "0":  # once, not once per rank
        print(f"train.py: warning: {meta_path} says data.prepare has not finished there; training on the shards "
              f"it wrote so far (re-run data.prepare with the same arguments to finish them)", file=sys.stderr)
    if cfg.model.vocab_size == 0:
        if "vocab_size" not in meta:
            raise ConfigError(f"model.vocab_size = 0 means 'read meta.json', but {meta_path} has no vocab_size; "
                              f"set --model.vocab_size=N")
        cfg.model.vocab_size = int(meta["vocab_size"])
    m = cfg.model
    if m.doc_causal and meta.get("eot_token", m.bos_id) != m.bos_id:
        raise ConfigError(f"model.doc_causal splits documents at model.bos_id = {m.bos_id}, but {meta_path} says "
                          f"the token before each document is eot_token = {meta['eot_token']}; set "
                          f"--model.bos_id={meta['eot_token']}")
    if m.doc_causal and not 0 <= m.bos_id < m.vocab_size:
        raise ConfigError(f"model.doc_causal: model.bos_id = {m.bos_id} is not a token of the vocabulary "
                          f"(model.vocab_size = {m.vocab_size}), so no document would ever end; set "
                          f"model.bos_id to the data's document token or turn model.doc_causal off")


def train_loader(cfg: Config, d: Dist, files: list[str], meta: dict) -> TokenLoader:
    """This rank's training stream over `files` (resolve_data's, with its `meta`) as the config says."""
    t, data = cfg.train, cfg.data
    bos_id = meta.get("eot_token", cfg.model.bos_id) if data.bos_aligned else None
    return TokenLoader(files, t.batch_size, t.seq_len, rank=d.rank, world_size=d.world_size, seed=data.seed,
                       bos_id=bos_id, device=d.device, fmt=data.format, raw_dtype=data.raw_dtype,
                       vocab_size=cfg.model.vocab_size if data.vocab_check else None,
                       holdout_tokens=cfg.eval.tokens if data.val == "holdout" else 0,
                       shuffle=data.shuffle, shuffle_shards=data.shuffle_shards)


def val_loader(cfg: Config, d: Dist, val_files: list[str]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's fixed validation batches (opening them validates the val set: too few tokens is an error)."""
    e = cfg.eval
    return val_batches(val_files, e.batch_size or cfg.train.batch_size, e.seq_len or cfg.train.seq_len, e.tokens,
                       rank=d.rank, world_size=d.world_size, device=d.device, fmt=cfg.data.format,
                       raw_dtype=cfg.data.raw_dtype, tail_tokens=e.tokens if cfg.data.val == "holdout" else 0)
