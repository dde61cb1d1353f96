"""Packages only some features use (wandb, datasets, matplotlib, scipy): imported by those features alone, and a
missing one is named in one line with the fix, so a node with only torch, numpy and tiktoken trains and checks."""
from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_optional(module: str, feature: str, error: type[Exception] = ImportError) -> ModuleType:
    """`module` imported, or `error` saying that `feature` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise  # the package is there but broken: its own traceback says why
        package = {"yaml": "pyyaml"}.get(e.name, e.name)
        raise error(f"{feature} needs the Python package {package}, which {sys.executable} lacks: "
                    f"pip install {package} (requirements.txt pins it; on a node without network, "
                    f"bash run.sh wheels: README \"Offline nodes\")") from None
