"""The [optim] config section as a dataclass, free of torch (trainer/config.py reads it before torch loads), and
the rule of muon_qk_pairs that spans the model's section (trainer/config.py and optim/groups.py check it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model.config import check_choices, elements_are, grouped
from optim.quintics import quintics


@dataclass
class OptimConfig:
    """The [optim] section."""
    name: Literal["adamw", "muon"] = "adamw"  # "adamw": one AdamW for all; "muon": Muon + AdamW groups (speedrun)
    lr: float = 6e-4  # adamw: learning rate of every parameter
    weight_decay: float = 0.1  # adamw: decoupled decay of matrices (never of embeddings, norms, biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam betas (both recipes)
    eps: float = 1e-8  # Adam epsilon (both recipes)
    # Adam's eps added to sqrt(v) before its bias correction (record 46's Adam), not after (torch's): it weighs
    # 1 / sqrt(1 - beta2^t) more at AdamW's t-th step (x4.5 at the first with beta2 = 0.95, x1.25 at the 20th)
    eps_before_correction: bool = False
    grad_clip: float = 0.0  # > 0: scale the gradients down to this global norm before every step; 0 = off
    embed_lr: float = 0.6  # muon: Adam rate of token/position/value embeddings (and a tied head)
    head_lr: float = 0.008  # muon: Adam rate of the untied head
    scalar_lr: float = 0.04  # muon: Adam rate of norms, biases and learned scalars
    muon_lr: float = 0.05  # muon: rate of the hidden matrices of the blocks
    muon_momentum: float = 0.95  # muon: Nesterov momentum
    muon_momentum_warmup_steps: int = 0  # muon: steps of the linear momentum warm-up (0 = none; records: 300)
    muon_momentum_start: float = 0.85  # muon: momentum at step 0 of the warm-up (records: 0.85)
    # muon: the run's last steps, over which the momentum falls back linearly towards muon_momentum_start (0 = none;
    # record 46: 50); needs a step schedule, whose last step is known
    muon_momentum_cooldown_steps: int = 0
    muon_weight_decay: float = 0.0  # muon: decoupled decay of the hidden matrices
    ns_steps: int = 5  # muon: Newton-Schulz iterations
    adjust_lr: Literal["original", "match_rms_adamw", "none"] = "original"  # muon: update scale per shape (lr_scale)
    ns_coefficients: Literal["newton_schulz", "polar_express"] = "newton_schulz"  # muon: the iteration's quintics
    # muon: added to the update's starting norm (times the safety factor), which it divides by; record 46: 1e-6
    # on its summed loss's gradients, 1e-6 / 16,384 on ours (train.stage_loss_scale)
    ns_eps: float = 1e-7
    muon_cautious_wd: bool = False  # muon: decay only where the update and the weight share a sign
    muon_wd_lr_squared: bool = False  # muon: the decay follows the rate squared (the same at the base rate)
    muon_fc_lr_scale: float = 1.0  # muon: the MLP fc's rate (and decay) as a multiple of muon_lr's
    normuon: bool = False  # muon: rescale the orthogonalised update per neuron by its second moment (NorMuon)
    normuon_beta2: float = 0.95  # muon: NorMuon's second-moment decay
    normuon_attn_columns: bool = False  # muon: NorMuon's neurons of the attention matrices are their input columns
    muon_gates: bool = False  # muon: the attention and smear gates' weights are Muon's matrices, not AdamW's scalars
    muon_qk_pairs: bool = False  # muon: orthogonalise each pair of adjacent heads of Q and of K apart (V whole)
    muon_compile: bool = grouped(False, "speed")  # muon: its math between the collectives compiled (optim/compiled.py)
    muon_symmetric: bool = grouped(False, "speed")  # muon: Newton-Schulz's symmetric products by a Triton kernel
    adam_every: int = 1  # AdamW steps every N steps, on the sum of their gradients (records: 2); Muon every step
    # record 46's bf16 storage: the tables', head's and gates' weights and gradients, and AdamW's moments, rounded
    # to bf16 around each step (optim/bf16_storage.py)
    bf16_storage: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "optim config")
        if self.name == "muon":  # Muon's own rule, here before the run starts rather than when Muon is built
            try:
                quintics(self.ns_coefficients, self.ns_steps)
            except ValueError as e:
                raise ValueError(f"optim config: {e}") from None
        if self.grad_clip < 0:
            raise ValueError(f"optim config: grad_clip={self.grad_clip} must be >= 0 (0 = off, e.g. 1.0)")
        if len(self.betas) != 2 or not elements_are(self.betas, int, float) or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim config: betas={self.betas} must be a list of two floats in [0, 1), e.g. "
                             f"[0.9, 0.95]")
        if self.eps <= 0:
            raise ValueError(f"optim config: eps={self.eps} must be > 0 (Adam divides by sqrt(v) + eps; e.g. 1e-8)")
        rates = ("lr", "embed_lr", "head_lr", "scalar_lr", "muon_lr")
        for key in rates + ("weight_decay", "muon_weight_decay"):
            if getattr(self, key) < 0 or (key in rates and getattr(self, key) == 0):
                raise ValueError(f"optim config: {key}={getattr(self, key)} must be "
                                 f"{'> 0' if key in rates else '>= 0 (0 = no decay)'}")
        if self.muon_momentum_warmup_steps < 0:
            raise ValueError(f"optim config: muon_momentum_warmup_steps={self.muon_momentum_warmup_steps} must be "
                             ">= 0 (0 = no warm-up)")
        if self.muon_fc_lr_scale <= 0:
            raise ValueError(f"optim config: muon_fc_lr_scale={self.muon_fc_lr_scale} must be > 0 (1 = muon_lr; "
                             "record 46: 2)")
        if self.muon_momentum_cooldown_steps < 0:
            raise ValueError(f"optim config: muon_momentum_cooldown_steps={self.muon_momentum_cooldown_steps} must "
                             "be >= 0 (0 = no cooldown; record 46: 50)")
        if self.ns_eps <= 0:
            raise ValueError(f"optim config: ns_eps={self.ns_eps} must be > 0 (a zero update divides by it; e.g. 1e-7)")
        if not 0 <= self.normuon_beta2 < 1:
            raise ValueError(f"optim config: normuon_beta2={self.normuon_beta2} must be in [0, 1), e.g. 0.95")
        if self.adam_every < 1:
            raise ValueError(f"optim config: adam_every={self.adam_every} must be >= 1 (1 = every step; records: 2)")
        if self.adam_every > 1 and self.grad_clip > 0:
            raise ValueError(f"optim config: adam_every={self.adam_every} with grad_clip={self.grad_clip}: the clip "
                             "would scale AdamW's held gradients again at every step that holds them; set "
                             "grad_clip = 0 or adam_every = 1")
        for key in ("muon_compile", "muon_symmetric"):
            if getattr(self, key) and self.name != "muon":
                raise ValueError(f"optim config: {key} = true is a Muon option, which name={self.name!r} does not "
                                 f"use; set name = 'muon' or {key} = false")
        for key, example in (("muon_momentum", 0.95), ("muon_momentum_start", 0.85)):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optim config: {key}={getattr(self, key)} must be in [0, 1), e.g. {example}")


def check_qk_pairs(n_head: int) -> None:
    """Refuse optim.muon_qk_pairs on an odd model.n_head: it pairs adjacent heads."""
    if n_head % 2:
        raise ValueError(f"optim.muon_qk_pairs pairs adjacent heads, so it needs an even model.n_head, got "
                         f"{n_head}; use an even n_head or optim.muon_qk_pairs = false")
