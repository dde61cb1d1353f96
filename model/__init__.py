"""The model package: `get_model(config)` builds the GPT from a run config or its model section.

Importing the package costs no torch, so trainer/config.py can read model.config before train.py imports
torch: model.gpt loads on the first get_model() or `model.GPT`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model.config import GPTConfig, config_from_dict

if TYPE_CHECKING:
    from model.gpt import GPT

__all__ = ["GPT", "GPTConfig", "get_model"]


def get_model(config: dict) -> GPT:
    """Build the GPT from the full resolved run config (its "model" section) or the model section alone."""
    from model.gpt import GPT

    section = config["model"] if isinstance(config.get("model"), dict) else config
    return GPT(config_from_dict(dict(section)))


def __getattr__(name: str) -> Any:
    if name == "GPT":  # `from model import GPT` without importing torch with the package
        from model.gpt import GPT

        return GPT
    raise AttributeError(f"module 'model' has no attribute {name!r}")
