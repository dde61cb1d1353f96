"""What the token embedding gets besides its table, each a record's piece that a key turns on: the smear (record 34,
model.smear) and the bigram hash embedding (records 62 and 83, model.bigram_hash, model.bigram_signs). The value
embeddings are plain tables (model.value_embeds): model/gpt.py holds them."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig
from model.layers import Gate


class Smear(nn.Module):
    """The records' smear: each token's embedding x_t adds lambda * gate(x_t) * x_{t-1}, the previous token's (the
    first has none), so a block reads the previous token without attending to it. lambda starts at 0: no change."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate = Gate(cfg, 1)
        self.lam = nn.Parameter(torch.empty(1))

    def reset_parameters(self) -> None:
        """lambda 0 (its gate resets itself)."""
        nn.init.zeros_(self.lam)

    def forward(self, x: Tensor) -> Tensor:
        now, before = x[:, 1:], x[:, :-1]
        # lambda (fp32, shape [1]) in x's dtype: it would make a bf16 stream fp32 (train.bf16_stream)
        return torch.cat((x[:, :1], now + self.lam.to(x.dtype) * self.gate(now) * before), dim=1)


# The records' odd multipliers of the current and the previous token: their products spread over the integers
# before the modulo, and below 2^31 for vocabularies under 59,000 tokens, where the records' int32 hash agrees.
BIGRAM_MULTIPLIERS = (36313, 27191)
SIGN_ROWS = 8192  # the sign trick's patterns: enough that two bigrams sharing a table row rarely share one
SIGN_SEED = 0  # the patterns are drawn from their own generator: the same on every rank, no other draw moved


def pair_hash(idx: Tensor, first: int, pair: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """pair(previous, current) at each position of idx [B, T] but the first, which has no previous token: `first`."""
    start = idx.new_full((idx.size(0), 1), first)
    return torch.cat((start, pair(idx[:, :-1], idx[:, 1:])), dim=1)


def bigram_rows(idx: Tensor, rows: int) -> Tensor:
    """The bigram table's row of each token of idx [B, T]: (a * current XOR b * previous) mod (rows - 1), a and b
    BIGRAM_MULTIPLIERS; each sequence's first token gets the last row, which no bigram hashes to."""
    now, before = BIGRAM_MULTIPLIERS
    return pair_hash(idx, rows - 1, lambda p, c: torch.bitwise_xor(now * c, before * p) % (rows - 1))


class BigramHash(nn.Embedding):
    """The records' bigram hash embedding: row bigram_rows(idx) of a [bigram_hash, bigram_width] table, zero at init,
    as [B, T, n_embd] with zeros after its width. Distinct bigrams share a row, so with bigram_signs each row read is
    multiplied by a fixed random +-1 pattern picked by (previous XOR current) mod SIGN_ROWS (the first token: pattern
    0): bigrams sharing a row mostly pull it apart in different channels."""

    def __init__(self, cfg: GPTConfig):
        # _weight: no init drawn here; GPT.reset_parameters calls ours, which draws from no generator of torch's
        super().__init__(cfg.bigram_hash, cfg.bigram_width, _weight=torch.empty(cfg.bigram_hash, cfg.bigram_width))
        self.n_embd = cfg.n_embd
        # A buffer, so a checkpoint holds the patterns it was trained with.
        self.register_buffer("signs", torch.empty(SIGN_ROWS, cfg.bigram_width) if cfg.bigram_signs else None)

    def reset_parameters(self) -> None:
        """Zero the table; draw the sign patterns from their own seeded generator (nothing drawn from torch's)."""
        nn.init.zeros_(self.weight)
        if self.signs is not None:
            bits = torch.randint(0, 2, self.signs.shape, generator=torch.Generator().manual_seed(SIGN_SEED),
                                 device="cpu")
            with torch.no_grad():
                self.signs.copy_(2 * bits - 1)

    def forward(self, idx: Tensor) -> Tensor:
        rows = super().forward(bigram_rows(idx, self.num_embeddings))
        if self.signs is not None:
            rows = rows * F.embedding(pair_hash(idx, 0, lambda p, c: torch.bitwise_xor(p, c) % SIGN_ROWS), self.signs)
        return rows if rows.size(-1) == self.n_embd else F.pad(rows, (0, self.n_embd - rows.size(-1)))
