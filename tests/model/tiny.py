"""What the model's tests share: a tiny GPT and a batch for it, the records' pieces on top, attention by hand,
train.py's step with a head that unties."""
import math

import torch

import model.layers
from model import get_model
from optim.groups import untie_head
from tests.helpers import MODERN_GPT as MODERN
from tests.helpers import TINY_GPT as TINY

RECORDS = dict(MODERN, attn_scale=0.12, norm_gain=False, embed_norm=True, x0_mix=True, rope_truncate=True,
               rope_base=1024.0, window=8, window_start=2, window_pattern="LSSL", doc_causal=True, bos_id=0)
def tiny(**overrides):
    torch.manual_seed(0)
    return get_model({**TINY, **overrides})


def batch(B=4, T=17, vocab=257, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def changed_positions(m, x, x2) -> list[int]:
    """Positions whose logits differ between inputs x and x2."""
    with torch.no_grad():
        diff = (m(x)[0] - m(x2)[0]).abs().amax(dim=(0, 2))
    return [t for t in range(x.size(1)) if diff[t] > 1e-5]


def hand_attention(att, x: torch.Tensor, scale: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of `att` on x [B, T, C] (logit scale `scale`, 0 = 1/sqrt(D); the allowed pairs `mask`), head
    by head, before the output projection: [B, H, T, D]."""
    B, T, C = x.shape
    H = att.cfg.n_head
    q, k, v = att.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
    logits = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(C // H))
    return logits.masked_fill(~allowed, -math.inf).softmax(-1) @ v


def joined(y: torch.Tensor) -> torch.Tensor:
    """Heads [B, H, T, D] side by side: [B, T, H * D], the output projection's input."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def train_tied(m, optimizers, steps: int, untie_at: int | None = None) -> list[float]:
    """train.py's step on one batch: the untie before step `untie_at`, the head's gradient to the embedding
    before the optimizers, the embedding's weights to the head after them."""
    x, losses = batch(), []
    for step in range(steps):
        if step == untie_at:
            untie_head(m, optimizers)
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        m.tie_grads()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        m.tie_weights()
        losses.append(loss.item())
    return losses


def window_tensor(w):
    return None if w is None else torch.tensor(w)


def gates(m) -> list[torch.nn.Parameter]:
    return [mod.weight for mod in m.modules() if isinstance(mod, model.layers.Gate)]


def sigmoid_of(w: torch.Tensor, inputs: list[float]) -> float:
    """sigmoid(w . inputs) in plain Python floats."""
    return 1 / (1 + math.exp(-sum(wc.item() * xc for wc, xc in zip(w, inputs))))
