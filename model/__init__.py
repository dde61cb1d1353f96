"""The model package: `get_model(config)` builds the GPT from a run config or its model section."""
from __future__ import annotations

from model.gpt import GPT, GPTConfig, config_from_dict

__all__ = ["GPT", "GPTConfig", "get_model"]


def get_model(config: dict) -> GPT:
    """Build the GPT from the full resolved run config (its "model" section) or the model section alone."""
    section = config["model"] if isinstance(config.get("model"), dict) else config
    return GPT(config_from_dict(dict(section)))
