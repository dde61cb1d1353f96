"""get_model: the same GPT from a whole run config or from its model section alone."""
import torch

from model import GPTConfig, get_model
from tests.helpers import TINY_GPT as TINY


def test_get_model_takes_full_config_or_model_section():
    full = {"data": {"seq_len": 16}, "train": {"steps": 3}, "model": TINY}
    torch.manual_seed(0)
    a = get_model(full)
    torch.manual_seed(0)
    b = get_model(dict(TINY))
    assert a.cfg == b.cfg == GPTConfig(**TINY)
    x = torch.randint(0, TINY["vocab_size"], (4, 17))
    torch.testing.assert_close(a(x)[0], b(x)[0], atol=0, rtol=0)
