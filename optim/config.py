"""The [optim] config section as a dataclass, free of torch (trainer/config.py reads it before torch loads), and
Muon's rules that need no torch (its quintics, its rate scale of a shape, its pairs of heads): optim/muon.py and
optim/groups.py apply them, and the config checks its keys by them before a run starts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from model.config import check_choices, elements_are, grouped


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
    adjust_lr: str = "original"  # muon: update scale per shape, "original" | "match_rms_adamw" | "none" (optim/muon.py)
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
        try:  # Muon's own rules, here before the run starts rather than when Muon is built
            lr_scale((1, 1), self.adjust_lr)
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


NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic chosen to maximise the slope at 0 (Keller Jordan, 2024)
# Polar Express (Amsel, Persson, Musco, Gower, 2025): one quintic per step, each the minimax-optimal one for the
# range of singular values the previous steps leave, computed for 5 steps with a safety factor of 1.02; the
# coefficients of modded-nanogpt's record 38 (2025-09-29). Past the fifth step the last quintic repeats.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# The starting norm is inflated by the safety factor: the quintics are tuned for singular values up to 1, and
# bf16 rounding of the Frobenius norm must not push one past it.
POLAR_EXPRESS_SAFETY = 1.02


def quintics(coefficients: str, steps: int) -> tuple[float, list[tuple[float, float, float]]]:
    """(safety factor of the starting norm, the (a, b, c) of each step) of an iteration's coefficient set."""
    if steps < 1:  # no step would leave the update as it is, not orthogonalised
        raise ValueError(f"ns_steps={steps} must be >= 1, the iterations that orthogonalise Muon's update (e.g. 5)")
    if coefficients == "newton_schulz":
        return 1.0, [NS_COEFFS] * steps
    if coefficients == "polar_express":
        pe = POLAR_EXPRESS_COEFFS
        if steps < len(pe):
            raise ValueError(f"ns_coefficients='polar_express' needs ns_steps >= {len(pe)}, got {steps}: cut short, "
                             f"its quintics leave their early steps' overshoot (singular values up to ~1.8); raise "
                             f"ns_steps or use ns_coefficients='newton_schulz'")
        return POLAR_EXPRESS_SAFETY, list(pe) + [pe[-1]] * (steps - len(pe))
    raise ValueError(f"ns_coefficients={coefficients!r}; use 'newton_schulz' or 'polar_express'")


def lr_scale(shape: Sequence[int], rule: str) -> float:
    """Multiplier of the learning rate for a matrix of this (global, per-view) shape; see optim/muon.py's docstring."""
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    if rule == "none":
        return 1.0
    raise ValueError(f"adjust_lr={rule!r}; use 'original', 'match_rms_adamw' or 'none'")


def check_qk_pairs(n_head: int) -> None:
    """Refuse optim.muon_qk_pairs on an odd model.n_head: it pairs adjacent heads."""
    if n_head % 2:
        raise ValueError(f"optim.muon_qk_pairs pairs adjacent heads, so it needs an even model.n_head, got "
                         f"{n_head}; use an even n_head or optim.muon_qk_pairs = false")
