"""optim/quintics.py: the coefficient sets of Muon's orthogonalisation, and the step counts each allows."""
import pytest

from optim.quintics import NS_COEFFS, POLAR_EXPRESS_COEFFS, POLAR_EXPRESS_SAFETY, quintics


def test_each_set_gives_a_quintic_a_step_and_polar_express_repeats_its_last():
    assert quintics("newton_schulz", 3) == (1.0, [NS_COEFFS] * 3)
    safety, schedule = quintics("polar_express", 7)
    assert safety == POLAR_EXPRESS_SAFETY and schedule == [*POLAR_EXPRESS_COEFFS, POLAR_EXPRESS_COEFFS[-1],
                                                           POLAR_EXPRESS_COEFFS[-1]]


@pytest.mark.parametrize("coefficients, steps, message", [
    ("newton_schulz", 0, "ns_steps=0 must be >= 1"),
    ("polar_express", 4, "ns_coefficients='polar_express' needs ns_steps >= 5, got 4"),
    ("chebyshev", 5, "ns_coefficients='chebyshev'; use 'newton_schulz' or 'polar_express'"),
])
def test_too_few_steps_or_an_unknown_set_is_refused(coefficients, steps, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        quintics(coefficients, steps)
