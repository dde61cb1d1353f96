"""The quintics of Muon's orthogonalisation, one (a, b, c) a step: X <- a X + (b A + c A^2) X with A = X X^T.
Free of torch, so that the config checks ns_coefficients and ns_steps before a run starts (optim/config.py);
optim/muon.py iterates them."""
from __future__ import annotations

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
