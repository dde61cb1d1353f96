"""Download pre-tokenized FineWeb-10B GPT-2 shards (llm.c format) from the Hugging Face hub.

    python -m scripts.fetch_fineweb --shards 8 --out shards/fineweb10B

Gets fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_0000NN.bin (1e8 tokens, ~200 MB
each) of the dataset repo kjj0/fineweb10B-gpt2 (the files modded-nanogpt uses). Files already present and
valid are kept; every file is validated with open_shard.
"""
from __future__ import annotations

import argparse
import socket
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, hf_hub_download


from data.shards import ShardError, open_shard

REPO = "kjj0/fineweb10B-gpt2"
PROBE_TIMEOUT_S = 5.0  # huggingface_hub retries an unreachable host for ~25 s; one short probe answers first


class FetchError(RuntimeError):
    """The shards cannot be fetched; the message says why and what to do instead."""


def shard_names(n_train: int) -> list[str]:
    """The val shard and the first `n_train` train shards, as named in the repo."""
    return ["fineweb_val_000000.bin", *(f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1))]


def invalid_reason(path: Path) -> str | None:
    """Why `path` is not a usable shard (missing, corrupt), or None if it is one."""
    if not path.exists():
        return f"{path}: missing"
    try:
        open_shard(path, fmt="header")
    except ShardError as e:
        return str(e)
    return None


def fetch(n_train: int, out: Path) -> list[Path]:
    """Download the shards that `out` lacks (or holds corrupt); return all their paths."""
    todo = {name: why for name in shard_names(n_train) if (why := invalid_reason(out / name))}
    for why in todo.values():
        print(f"fetch: {why}", file=sys.stderr)
    if todo:
        _check_reachable(constants.ENDPOINT, constants.HF_HUB_OFFLINE, sorted(todo), out)
    for name in todo:
        # A corrupt local copy may look current to the hub's local metadata: force a fresh download.
        hf_hub_download(REPO, name, repo_type="dataset", local_dir=out, force_download=(out / name).exists())
        if (bad := invalid_reason(out / name)) is not None:
            raise FetchError(f"{out / name}: downloaded but not a valid shard: {bad}")
    print(f"fetch: {len(todo)} downloaded, {n_train + 1 - len(todo)} already present in {out}", file=sys.stderr)
    return [out / name for name in shard_names(n_train)]


def _check_reachable(endpoint: str, offline: bool, names: list[str], out: Path) -> None:
    fix = (f"copy {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} into {out} from a machine with "
           f"network (where this same command fetches them), or prepare shards with python -m data.prepare")
    if offline:
        raise FetchError(f"HF_HUB_OFFLINE is set and {out} lacks {len(names)} shard(s); unset it, or {fix}")
    host, port, via = first_hop(endpoint)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise FetchError(f"cannot reach {endpoint}{via} ({e}); no network? Set HF_ENDPOINT to a mirror, "
                         f"or {fix}") from None


def first_hop(endpoint: str) -> tuple[str, int, str]:
    """(host, port, note) of the first connection a download of `endpoint` makes: its proxy when one is set for
    it (HTTPS_PROXY, ..., as huggingface_hub honours them), else the endpoint itself."""
    url, proxies = urlparse(endpoint), urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        p = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        port = p.port or (443 if p.scheme == "https" else 80)
        return p.hostname, port, f" through the proxy {p.hostname}:{port}"
    return url.hostname, url.port or (443 if url.scheme == "https" else 80), ""


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.fetch_fineweb`."""
    p = argparse.ArgumentParser(prog="python -m scripts.fetch_fineweb", description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=8, help="number of train shards (1e8 tokens each; 103 exist)")
    p.add_argument("--out", type=Path, default=Path("shards/fineweb10B"))
    args = p.parse_args(argv)
    if args.shards < 0:
        p.error("--shards must be >= 0")
    try:
        fetch(args.shards, args.out)
    except FetchError as e:
        sys.exit(f"fetch: error: {e}")


if __name__ == "__main__":
    main()
