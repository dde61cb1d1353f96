"""The config's data section made concrete: its files, the meta.json beside them (checked against the model
keys), and the training and validation loaders train.py builds from them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from data.loader import TokenLoader
from data.regions import match_files
from data.val import ValBatches, val_batches
from data.meta import META, MetaError, read_meta, vouches
from data.shards import open_shard
from model.config import padded
from data.tokenizer import TokenizerError, get_tokenizer, prefix_tokens
from trainer.config import Config, ConfigError
from trainer.distributed import Dist

GPT2_VOCAB = 50257  # FineWeb's shards come without a meta.json: their tokens are GPT-2's


def resolve_data(cfg: Config) -> tuple[list[Path], list[Path], dict]:
    """Sorted train and val files, and the meta.json beside the train files ({} if none).

    Fills model.vocab_size from meta.json when it is 0; checks model.bos_id against it for doc_causal; fits an
    eval.tokens left at its default to a smaller val set.
    """
    files = match_files(cfg.data.train)
    if not files:
        raise ConfigError(f"data.train = {cfg.data.train!r} matches no file; {_where_shards_come_from(cfg.data.train)}")
    val_files = files if cfg.data.holdout else match_files(cfg.data.val) if cfg.data.val else []
    if cfg.data.val and not val_files:
        raise ConfigError(f"data.val = {cfg.data.val!r} matches no file; give a glob of validation shards, "
                          f"'holdout' (the tail of the train data) or '' (no evals)")
    _check_token_files("data.train", cfg.data.train, files)
    _check_token_files("data.val", cfg.data.val, [] if cfg.data.holdout else val_files)
    both = sorted(set(files) & set(val_files)) if not cfg.data.holdout else []
    if both:
        raise ConfigError(f"data.train = {cfg.data.train!r} and data.val = {cfg.data.val!r} both match {both[0]}"
                          f"{' and more' if len(both) > 1 else ''}: the val loss would score tokens trained on; narrow "
                          f"data.train (e.g. DIR/*_train_*.bin), or set data.val = 'holdout' for a tail kept apart")
    meta = _meta_beside(files[0])
    _apply_meta(cfg, meta, Path(files[0]).parent / META)
    if val_files and not cfg.data.holdout:
        _check_same_tokenizer(meta, _meta_beside(val_files[0]), Path(files[0]).parent, Path(val_files[0]).parent)
    if val_files and not cfg.data.holdout and "eval.tokens" not in cfg.given:
        _fit_eval_tokens(cfg, val_files)
    return files, val_files, meta


def _meta_beside(file: Path) -> dict:
    try:
        return read_meta(Path(file).parent)
    except MetaError as e:
        raise ConfigError(str(e)) from None


def _check_token_files(key: str, pattern: str, files: list[Path]) -> None:
    """Refuse a glob that matches a folder or a meta.json: neither is a token file."""
    for path in files:
        if path.is_dir():
            raise ConfigError(f"{key} = {pattern!r} matches the folder {path}; give a glob of its token files, e.g. "
                              f"{str(path / '*_train_*.bin')!r}")
        if path.name == META:
            raise ConfigError(f"{key} = {pattern!r} matches {path}, data.prepare's description of its shards, not "
                              f"a token file; narrow the glob, e.g. {str(path.parent / '*_train_*.bin')!r}")


def _check_same_tokenizer(train: dict, val: dict, train_folder: Path, val_folder: Path) -> None:
    """Refuse train and val shards that the meta.json beside each says another tokenizer made (by its numbers: a
    tokenizer's name is as the user wrote it, a path one way or another)."""
    for key in ("vocab_size", "eot_token"):
        if key in train and key in val and train[key] != val[key]:
            raise ConfigError(f"the train shards' {key} is {train[key]!r} ({train_folder / META}), the val shards' "
                              f"{val[key]!r} ({val_folder / META}): the val loss would score another tokenizer's "
                              f"ids; point data.val at shards of the same data.prepare run")


def _where_shards_come_from(pattern: str) -> str:
    """How to get the shards a data.train glob names: FineWeb's (scripts/fetch_fineweb.py's names) are fetched."""
    if Path(pattern).name.startswith("fineweb_train_"):
        return (f"fetch the FineWeb shards with python -m scripts.fetch_fineweb --shards N --out "
                f"{Path(pattern).parent} (N train shards of 100M tokens each), or run bash run.sh on a GPU machine, "
                f"which fetches them")
    return "point it at your token shards (python -m data.prepare writes them) or pass --data_dir"


def _fit_eval_tokens(cfg: Config, val_files: list[Path]) -> None:
    """Lower eval.tokens to every target of `val_files` where they hold fewer than its default, saying so (rank 0).

    A small corpus's val shard is then scored whole instead of refused. Only the default gives way: a config that
    sets eval.tokens (every record's does) is scored on exactly that many, or refused by val_loader.
    """
    have = sum(len(open_shard(f, raw_dtype=cfg.data.raw_dtype, fmt=cfg.data.format)) for f in val_files)
    if have - 1 >= cfg.eval.tokens or have < 2:  # a target needs the token before it
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: note: the validation data holds {have:,} tokens, fewer than eval.tokens' default "
              f"({cfg.eval.tokens:,} targets) needs: each eval scores all {have - 1:,} of its targets (set "
              f"eval.tokens to choose)", file=sys.stderr)
    cfg.eval.tokens = have - 1


def _apply_meta(cfg: Config, meta: dict, meta_path: Path) -> None:
    """Warn about an unfinished data.prepare; fill model.vocab_size = 0 from `meta`; check model.bos_id."""
    if meta.get("complete") is False and os.environ.get("RANK", "0") == "0":  # once, not once per rank
        print(f"train.py: warning: {meta_path} says data.prepare has not finished there; training on the shards "
              f"it wrote so far (re-run data.prepare with the same arguments to finish them)", file=sys.stderr)
    if cfg.model.vocab_size == 0:
        if "vocab_size" not in meta:
            found = ("has no vocab_size" if meta_path.is_file() else
                     "is missing (data.prepare writes one beside its shards; shards made elsewhere have none)")
            raise ConfigError(f"model.vocab_size = 0 means 'read meta.json', but {meta_path} {found}; "
                              f"set --model.vocab_size=N, the vocabulary the shards were tokenized with")
        vocab = meta["vocab_size"]
        if type(vocab) is not int or vocab <= 0:
            raise ConfigError(f"{meta_path}: vocab_size = {vocab!r} is not a positive integer; re-run data.prepare "
                              f"there, or set --model.vocab_size=N, the vocabulary the shards were tokenized with")
        cfg.model.vocab_size = vocab
    model_cfg = cfg.model
    if model_cfg.doc_causal and meta.get("eot_token", model_cfg.bos_id) != model_cfg.bos_id:
        raise ConfigError(f"model.doc_causal splits documents at model.bos_id = {model_cfg.bos_id}, but {meta_path} "
                          f"says the token before each document is eot_token = {meta['eot_token']}; set "
                          f"--model.bos_id={meta['eot_token']}")
    if model_cfg.doc_causal and not 0 <= model_cfg.bos_id < model_cfg.vocab_size:
        raise ConfigError(f"model.doc_causal: model.bos_id = {model_cfg.bos_id} is not a token of the vocabulary "
                          f"(model.vocab_size = {model_cfg.vocab_size}), so no document would ever end; set "
                          f"model.bos_id to the data's document token or turn model.doc_causal off")


def prefix_targets(cfg: Config, meta: dict) -> list[int]:
    """model.prefix_weight's table, each token's prefix token (-1: none), from the tokenizer meta.json names; shards
    without a meta.json are taken as GPT-2's, as FineWeb's are."""
    name = meta.get("tokenizer")
    if name is None and not GPT2_VOCAB <= cfg.model.vocab_size <= padded(GPT2_VOCAB):
        raise ConfigError(f"model.prefix_weight needs the data's tokenizer, which a meta.json beside the train shards "
                          f"names (data.prepare writes one); without one the shards are taken as GPT-2's, but "
                          f"model.vocab_size = {cfg.model.vocab_size}, not {GPT2_VOCAB} (or up to the records' "
                          f"{padded(GPT2_VOCAB)}): prepare the data with data.prepare or set model.prefix_weight = 0")
    name = name or "gpt2"
    try:
        table = prefix_tokens(get_tokenizer(name), cfg.model.vocab_size)
    except TokenizerError as e:
        raise ConfigError(f"model.prefix_weight: {e}") from None
    if max(table) < 0:  # every prefix target left out: the run would train as without the key
        raise ConfigError(f"model.prefix_weight = {cfg.model.prefix_weight} trains each target's prefix token, the "
                          f"token whose bytes are the longest proper prefix of its bytes, and the data's tokenizer "
                          f"{name!r} has none below model.vocab_size = {cfg.model.vocab_size} (a single byte or a "
                          f"special token has none): set model.prefix_weight = 0, or prepare the data with a "
                          f"tokenizer of longer tokens (e.g. gpt2)")
    return table


def train_loader(cfg: Config, dist: Dist, files: list[Path], meta: dict) -> TokenLoader:
    """This rank's training stream over `files` (resolve_data's, with its `meta`) as the config says."""
    train, data = cfg.train, cfg.data
    bos_id = meta.get("eot_token", cfg.model.bos_id) if data.bos_aligned else None
    check = data.vocab_check and not _vouched(files, meta, cfg.model.vocab_size)  # meta.json read once
    seed = None if data.sorted_shards else data.seed  # TokenLoader's sequential stream takes no seed in sorted order
    return TokenLoader(files, train.batch_size, train.seq_len, rank=dist.rank, world_size=dist.world_size,
                       seed=seed, bos_id=bos_id, device=dist.device, fmt=data.format, raw_dtype=data.raw_dtype,
                       vocab_size=cfg.model.vocab_size if check else None, holdout_tokens=cfg.holdout_tokens,
                       shuffle=data.shuffle, shuffle_shards=data.shuffle_shards, doc_cut=data.doc_cut,
                       max_seq_len=train.longest_row)


def _vouched(files: list[Path], meta: dict, vocab_size: int) -> bool:
    """Whether `meta`, the meta.json resolve_data read beside the first file, vouches for all of `files`' ids: the
    loader then need not read it again to learn the same."""
    return vouches(meta, vocab_size, [Path(f).name for f in files]) and {Path(f).parent for f in files} == {
        Path(files[0]).parent}


def val_loader(cfg: Config, dist: Dist, val_files: list[Path]) -> ValBatches:
    """This rank's fixed validation batches (opening them validates the val set: too few tokens, or with
    data.vocab_check token ids beyond model.vocab_size, are an error)."""
    return val_batches(val_files, *cfg.eval_shape, cfg.eval.tokens, rank=dist.rank, world_size=dist.world_size,
                       device=dist.device, fmt=cfg.data.format, raw_dtype=cfg.data.raw_dtype,
                       tail_tokens=cfg.holdout_tokens,
                       vocab_size=cfg.model.vocab_size if cfg.data.vocab_check else None)
