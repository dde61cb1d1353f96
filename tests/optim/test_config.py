"""The [optim] section: its defaults are the nanoGPT recipe's, and a bad value is refused with the fix."""
import pytest

from optim.config import OptimConfig


def test_the_defaults_are_one_adamw_with_decay_and_no_clipping():
    cfg = OptimConfig()
    assert (cfg.name, cfg.lr, cfg.weight_decay, cfg.betas, cfg.grad_clip) == ("adamw", 6e-4, 0.1, [0.9, 0.95], 0.0)
    assert OptimConfig().betas is not cfg.betas  # each config its own list


@pytest.mark.parametrize("bad, message", [
    (dict(name="sgd"), "name='sgd'"),
    (dict(grad_clip=-1.0), r"grad_clip=-1.0 must be >= 0 \(0 = off, e.g. 1.0\)"),
    (dict(betas=[0.9]), r"betas=\[0.9\] must be a list of two floats in \[0, 1\), e.g. \[0.9, 0.95\]"),
    (dict(muon_momentum_warmup_steps=-1), r"muon_momentum_warmup_steps=-1 must be >= 0 \(0 = no warm-up\)"),
    (dict(muon_momentum_start=1.0), r"muon_momentum_start=1.0 must be in \[0, 1\), e.g. 0.85"),
    (dict(muon_momentum=1.5), r"muon_momentum=1.5 must be in \[0, 1\), e.g. 0.95"),
    (dict(betas=["a", "b"]), r"betas=\['a', 'b'\] must be a list of two floats in \[0, 1\)"),
    (dict(betas=[[1], [2]]), r"betas=\[\[1\], \[2\]\] must be a list of two floats"),
    (dict(adjust_lr="bogus"), r"adjust_lr='bogus'; use 'original', 'match_rms_adamw' or 'none'"),
    (dict(name="muon", ns_steps=0), r"ns_steps=0 must be >= 1, the iterations that orthogonalise Muon's update "
                                    r"\(e.g. 5\)"),
    (dict(name="muon", ns_steps=-2, ns_coefficients="polar_express"), r"ns_steps=-2 must be >= 1"),
    (dict(name="muon", ns_steps=3, ns_coefficients="polar_express"),
     r"ns_coefficients='polar_express' needs ns_steps >= 5, got 3: .*; raise ns_steps or use "
     r"ns_coefficients='newton_schulz'"),
    (dict(muon_fc_lr_scale=0.0), r"muon_fc_lr_scale=0.0 must be > 0 \(1 = muon_lr; record 46: 2\)"),
    (dict(adam_every=0), r"adam_every=0 must be >= 1 \(1 = every step; records: 2\)"),
    (dict(ns_eps=0.0), r"ns_eps=0.0 must be > 0 \(a zero update divides by it; e.g. 1e-7\)"),
    (dict(adam_every=2, grad_clip=1.0), r"adam_every=2 with grad_clip=1.0: the clip would scale AdamW's held "
                                        r"gradients again .*; set grad_clip = 0 or adam_every = 1"),
])
def test_bad_values_say_what_to_write(bad, message):
    with pytest.raises(ValueError, match=f"^optim config: {message}"):
        OptimConfig(**bad)


def test_muons_own_keys_are_left_alone_under_adamw():
    assert OptimConfig(name="adamw", ns_steps=0, ns_coefficients="polar_express").ns_steps == 0
