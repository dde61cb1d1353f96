"""Sample text from a trained checkpoint.

    python -m scripts.sample runs/<run_id>/checkpoint.pt --prompt "The meaning of life" --tokens 200
    python -m scripts.sample runs/<run_id> --prompt "def "     # the checkpoint that run saved
    python -m scripts.sample ckpt.pt --temperature 0            # greedy
    python -m scripts.sample ckpt.pt --tokenizer gpt2 --top-k 50 --seed 1

The tokenizer is --tokenizer, else the one named in the meta.json beside the training shards
(the checkpoint config's data.train glob), as written by data.prepare. One whose vocabulary is not the
model's is refused (its ids would mean other text than the model learned) unless --force is given.
"""
from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import torch

from data.meta import META, MetaError, read_meta
from data.tokenizer import TokenizerError, eot_token, get_tokenizer
from model.config import padded
from model.generate import generate
from trainer import ROOT
from trainer.checkpoint import CheckpointError, load_checkpoint
from trainer.runs import saved_checkpoint, saved_config
from util.plural import plural


RUNS_NAMED = 5  # a folder of runs: the message names its newest runs up to this many


class SampleError(ValueError):
    """A tokenizer or run folder that cannot be used for sampling; the message says which and how to fix it."""


def tokenizer_name(config: dict, override: str | None = None) -> str:
    """--tokenizer if given, else the "tokenizer" of the meta.json next to the config's training shards (a relative
    glob read from here, else from this checkout, where run.sh trains)."""
    if override:
        return override
    train = config.get("data", {}).get("train")
    if not isinstance(train, str) or not train:
        raise SampleError("the checkpoint's config has no data.train glob to find meta.json by; "
                          "pass --tokenizer NAME")
    if not glob.glob(train) and glob.glob(str(ROOT / train)):
        train = str(ROOT / train)
    folder = min({Path(f).parent for f in glob.glob(train)}, default=Path(train).parent)
    try:
        return read_meta(folder, missing_ok=False)["tokenizer"]
    except MetaError as e:
        why = e.problem
    except (OSError, KeyError) as e:
        why = f"{type(e).__name__}: {e}"
    raise SampleError(f"{folder / META}: cannot read the tokenizer name from it ({why}); the data.train shards "
                      f"{train!r} have no usable meta.json — pass --tokenizer NAME")


def run_checkpoint(folder: Path) -> Path:
    """The checkpoint a run folder's run saved (trainer/runs.py `saved_checkpoint` says where); a SampleError that
    says why there is none: a folder of runs, a run that saves none, or one that has not saved yet."""
    try:
        path = saved_checkpoint(folder)
        if path.is_file():
            return path
        saved = saved_config(folder)
    except (OSError, ValueError) as e:  # ValueError: JSON or TOML that does not parse
        raise SampleError(f"{folder}: cannot read where its run saved the checkpoint ({e}); pass the "
                          f"checkpoint.pt itself") from None
    runs = sorted(folder.glob("*/config.toml"), key=lambda c: c.stat().st_mtime, reverse=True)
    if runs and not (folder / "config.toml").is_file():
        names = ", ".join(c.parent.name for c in runs[:RUNS_NAMED]) + (", ..." if len(runs) > RUNS_NAMED else "")
        raise SampleError(f"{folder}: a folder of {plural(len(runs), 'run')} ({names}), not a run; pass one of them, "
                          f"e.g. the newest: {runs[0].parent}")
    if not saved.get("train", {}).get("save_checkpoint", True):
        raise SampleError(f"{folder}: its run saves no checkpoint (train.save_checkpoint = false in its config.toml), "
                          f"so there is nothing to sample; train it again with train.save_checkpoint = true")
    raise SampleError(f"{folder}: its run saved no checkpoint at {path} (yet); train it to its first save "
                      f"(the end of the run, or train.checkpoint_every_s), or pass a checkpoint.pt")


def usable(device: str) -> None:
    """Raise SampleError where torch cannot place a tensor on `device` (no such device, or no backend for it)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as e:  # a CPU build's cuda: AssertionError
        why = str(e).splitlines()[0][:160]
        raise SampleError(f"--device {device}: torch cannot use it here ({why}); pass --device cpu") from None


def main(argv: list[str] | None = None) -> int:
    """Command line: print the prompt followed by the sampled continuation."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path,
                    help="a checkpoint.pt written by train.py, or a run folder (runs/<run_id>): the one its run saved")
    ap.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    ap.add_argument("--tokens", type=int, default=200, help="number of tokens to generate (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only (default: all)")
    ap.add_argument("--seed", type=int, default=None, help="fixes the sample (default: a fresh one each run)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer name or .tiktoken path (default: from meta.json)")
    ap.add_argument("--force", action="store_true",
                    help="sample even with a tokenizer whose vocabulary size is not the model's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model runs (default: cuda where there is a GPU, else cpu; here %(default)s)")
    args = ap.parse_args(argv)
    if args.tokens < 0 or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        ap.error("--tokens and --temperature must be >= 0 and --top-k >= 1")
    try:
        usable(args.device)
        checkpoint = run_checkpoint(args.checkpoint) if args.checkpoint.is_dir() else args.checkpoint
        model, config = load_checkpoint(checkpoint, args.device)
        enc = get_tokenizer(tokenizer_name(config, args.tokenizer))
        # the model's vocabulary may be the tokenizer's padded (the speedrun's 50,304 over GPT-2's 50,257)
        if not enc.n_vocab <= model.cfg.vocab_size <= padded(enc.n_vocab) and not args.force:
            raise SampleError(f"tokenizer {enc.name!r} has {enc.n_vocab} ids but the model was trained on "
                              f"{model.cfg.vocab_size}: another tokenizer's ids mean other text, so the sample "
                              f"would be garbage; pass the model's tokenizer (the meta.json beside its training "
                              f"shards names it), or --force to sample anyway")
        # A new document starts after <|endoftext|>, so an empty prompt conditions on that token alone.
        ids = enc.encode(args.prompt, allowed_special="all") if args.prompt else [eot_token(enc)]
        if max(ids) >= model.cfg.vocab_size:
            raise SampleError(f"tokenizer {enc.name!r} gives id {max(ids)} but the model has only "
                              f"{model.cfg.vocab_size} ids; pass the tokenizer the model was trained with")
    except (CheckpointError, SampleError, TokenizerError) as e:
        print(f"sample: {e}", file=sys.stderr)
        return 2
    generator = torch.Generator(args.device)
    if args.seed is None:
        generator.seed()
    else:
        generator.manual_seed(args.seed)
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    out = generate(model, idx, args.tokens, args.temperature, args.top_k,
                   vocab_size=min(enc.n_vocab, model.cfg.vocab_size), generator=generator)
    print(args.prompt + enc.decode(out[0, len(ids):].tolist()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C while it samples: nothing to save or say
        sys.exit(130)
