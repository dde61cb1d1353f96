"""A wheel folder for a node without network: `bash run.sh wheels` here, copy the folder there, run as usual.

    bash run.sh wheels                                    # Python 3.12, manylinux x86_64, torch left out
    bash run.sh wheels --python-version 3.11 --have numpy,scipy,matplotlib,pyarrow --without wandb,datasets
    bash run.sh wheels --torch                            # for a node whose Python has no torch >= 2.6

It downloads requirements.txt and everything they need, built for the target's Python and platform, and writes
the folder's own requirements.txt: the lines the node is to install. run.sh's setup (and scripts/gpu_check.sh)
installs from a wheel folder with no index when one is there. --have names what the node's Python already has:
those stay requirements (the node's own copies satisfy them) but their wheels are left out of the folder.
--without drops a feature's package altogether (wandb, datasets: only log.wandb and hub/jsonl/parquet corpora use
them). Needs only this Python's pip.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

from trainer import ROOT

# pip matches a manylinux tag exactly, so name every glibc a node may have: 2.17 (CentOS 7) and later
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def project(line: str) -> str:
    """The normalised project name of a requirement line ("tomli-w>=1.0  # why" -> "tomli-w")."""
    return normalise(re.split(r"[\s<>=!~;\[#]", line.strip(), maxsplit=1)[0])


def normalise(name: str) -> str:
    """PEP 503's form of a project name, as wheel file names and --have spell it alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    """The project a wheel file is of (its name's first dash-separated field)."""
    return normalise(path.name.split("-", 1)[0])


def names(arg: str) -> set[str]:
    """A comma- or space-separated list of project names, normalised."""
    return {normalise(n) for n in re.split(r"[,\s]+", arg) if n}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="bash run.sh wheels", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--python-version", default="3.12", help="the node's Python, major.minor")
    p.add_argument("--platform", action="append", metavar="TAG",
                   help="a wheel platform tag the node takes (repeat it); default: manylinux x86_64, glibc >= 2.17")
    p.add_argument("--have", default="", metavar="NAMES", help="projects the node's Python has already")
    p.add_argument("--without", default="", metavar="NAMES", help="requirements to leave out (wandb, datasets)")
    p.add_argument("--torch", action="store_true", help="include torch (for a node without torch >= 2.6)")
    p.add_argument("--out", type=Path, default=ROOT / "wheels", help="the wheel folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Fill the wheel folder; 0 on success, pip's status otherwise."""
    args = parse_args(argv)
    have, without = names(args.have), names(args.without)
    if not args.torch:
        have |= {"torch", "triton"}  # CUDA torch brings the Triton it was built with
    lines = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    requirements = [line for line in lines if line and not line.startswith("#")]
    wanted = [line for line in requirements if project(line) not in without]
    unknown = without - {project(line) for line in requirements}
    if unknown:
        sys.exit(f"run.sh wheels: --without {','.join(sorted(unknown))}: not in requirements.txt")
    # the node installs these; what it has satisfies a line without a wheel, so download only the rest
    fetch = [line for line in wanted if project(line) not in have]
    out = args.out
    if out.exists():
        shutil.rmtree(out)  # a folder of another target's wheels would mix with this one's
    out.mkdir(parents=True)
    manifest = out / "requirements.txt.partial"
    manifest.write_text("".join(f"{line.split('#')[0].strip()}\n" for line in fetch))
    platforms = args.platform or PLATFORMS
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
           "--implementation", "cp", "--python-version", args.python_version,
           *(x for tag in platforms for x in ("--platform", tag)), "-d", str(out), "-r", str(manifest)]
    print(f"[run.sh wheels] Python {args.python_version}, {len(platforms)} platform tags: downloading "
          f"{len(fetch)} requirements and what they need into {out}", flush=True)
    rc = subprocess.call(cmd)
    if rc:
        print(f"run.sh wheels: pip download failed (exit {rc}); see its message above", file=sys.stderr)
        return rc
    dropped = [p for p in out.glob("*.whl") if wheel_project(p) in have]
    for p in dropped:  # a dependency the node has: its own copy is used there
        p.unlink()
    (out / "requirements.txt").write_text("".join(f"{line.split('#')[0].strip()}\n" for line in wanted
                                                  if project(line) not in {"torch", "triton"} or args.torch))
    manifest.unlink()
    wheels = sorted(out.glob("*.whl"))
    size = sum(p.stat().st_size for p in wheels)
    print(f"[run.sh wheels] {len(wheels)} wheels, {size / 2**20:.1f} MiB, in {out}"
          + (f" (left out, the node has them: {', '.join(sorted({wheel_project(p) for p in dropped}))})"
             if dropped else "")
          + f"\n  copy {out.name}/ into the repository on the node; there `bash run.sh ...` and "
          f"`bash scripts/gpu_check.sh` install from it, with no index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
