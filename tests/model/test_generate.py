"""generate: every row of a batch keeps its prompt and grows by the ids asked for, with no autograd graph; a seeded
generator fixes the sample. (Greedy, top-k and the sliding window are checked on a trained checkpoint in
tests/scripts/test_sample.py.)"""
import torch

from model import get_model
from model.generate import generate
from tests.helpers import TINY_GPT


def test_each_row_keeps_its_prompt_and_a_seed_fixes_the_sample():
    torch.manual_seed(0)
    model = get_model(TINY_GPT).eval()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def sample(seed):
        return generate(model, prompt, 5, temperature=2.0, generator=torch.Generator().manual_seed(seed))

    out = sample(0)
    assert out.shape == (2, 8) and torch.equal(out[:, :3], prompt) and not out.requires_grad
    assert torch.equal(sample(0), out) and not torch.equal(sample(1), out)
    assert out.max() < TINY_GPT["vocab_size"]  # the padded rows are never sampled
