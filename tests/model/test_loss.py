"""The training loss's later-token and prefix-token terms, and their weights' schedule."""
import pytest
import torch
import torch.nn.functional as F

from model.loss import loss_weights_at
from tests.model.tiny import batch, tiny

PREFIXES = {5: 3, 9: 5, 11: 9, 12: 1}  # a made-up prefix table: these ids have a prefix token, the others none


def with_prefixes(m):
    """`m` with PREFIXES as its prefix table (train.py fills it from the data's tokenizer)."""
    m.set_prefix_targets([PREFIXES.get(i, -1) for i in range(257)])
    return m


def loss_by_hand(logits: torch.Tensor, targets: torch.Tensor, weights: list[float], prefix: float) -> torch.Tensor:
    """sum over rows b, positions t, offsets k with a target of w_k * -log p(targets[b, t + k] | logits[b, t]), plus
    prefix * -log p(prefix of targets[b, t]) where it has one, over the count of next-token targets; loops."""
    logp = F.log_softmax(logits.double(), dim=-1)
    B, T = targets.shape
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            count += int(targets[b, t] != -100)
            for k, w in enumerate(weights):
                if t + k < T and targets[b, t + k] != -100:
                    total -= w * logp[b, t, targets[b, t + k]]
            if targets[b, t] != -100 and int(targets[b, t]) in PREFIXES:
                total -= prefix * logp[b, t, PREFIXES[int(targets[b, t])]]
    return total / count


@pytest.mark.parametrize("options, progress, weights, prefix", [
    (dict(mtp_weights=[1.0, 0.5, 0.25]), 0.0, [1.0, 0.5, 0.25], 0.0),
    (dict(mtp_weights=[1.0, 0.5, 0.25]), 0.5, [1.0, 0.25, 0.0], 0.0),  # half way through the second third
    (dict(prefix_weight=0.25), 0.1, [1.0], 0.25),
    (dict(mtp_weights=[1, 0.5, 0.25, 0.125], prefix_weight=0.5), 0.125, [1.0, 0.5, 0.25, 0.0625], 0.5),
])
def test_the_training_loss_is_the_weighted_sum_of_the_shifted_and_prefix_cross_entropies(
        options, progress, weights, prefix):
    """Each position's logits against the tokens 1, 2, ... ahead (a token past the row's end left out) and against
    its target's prefix token (left out where it has none), over the count of next-token targets; padding (-100)
    is no target at all."""
    m = tiny(logit_softcap=15.0, **options)
    if prefix:
        with_prefixes(m)
    m.set_progress(progress)
    x = batch(B=2, T=9, vocab=14, seed=3)  # small ids: many targets have a prefix token, some repeat
    targets = x[:, 1:].clone()
    targets[1, -2:] = -100  # a padded tail, as the val batches have
    with torch.no_grad():
        logits, _ = m(x[:, :-1])
    _, loss = m(x[:, :-1], targets)
    assert m.training and m.loss_weights.tolist() == weights + ([prefix] if prefix else [])
    torch.testing.assert_close(loss.double(), loss_by_hand(logits, targets, weights, prefix), atol=1e-6, rtol=1e-6)
    loss.backward()  # the loss is one graph through the shared head: every weight gets a gradient
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("weights", [[], [1.0]])
def test_without_later_tokens_the_training_loss_is_the_plain_next_token_loss(weights):
    x = batch()
    plain, m = tiny(), tiny(mtp_weights=weights)
    m.set_progress(0.0)
    assert m.loss_weights is None and "loss_weights" not in dict(m.named_buffers())
    assert torch.equal(m(x[:, :-1], x[:, 1:])[1], plain(x[:, :-1], x[:, 1:])[1])


def test_the_last_stage_and_every_eval_score_the_next_token_alone():
    x = batch()
    plain, m = tiny(), with_prefixes(tiny(mtp_weights=[1.0, 0.5, 0.25], prefix_weight=0.25))
    want = plain(x[:, :-1], x[:, 1:])[1]
    m.set_progress(0.8)  # the last third: the later tokens' and the prefix's weights are 0
    assert m.loss_weights.tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(m(x[:, :-1], x[:, 1:])[1], want, atol=1e-6, rtol=1e-6)
    m.set_progress(0.0)
    assert m(x[:, :-1], x[:, 1:])[1] > want + 0.5  # the other terms weigh in training ...
    m.eval()
    assert torch.equal(m(x[:, :-1], x[:, 1:])[1], want)  # ... never in an eval (same weights as plain)


def record_53(x: float) -> list[float]:
    """Record 53's MTP weights at x = step / scheduled steps, and record 88's prefix weight after them."""
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x), 0.25]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1)), 0.0, 0.25 * (1 - (3 * x - 1))]
    return [1.0, 0.0, 0.0, 0.0]


def test_the_loss_weights_follow_the_records_schedule_and_a_fresh_model_has_the_final_ones():
    m = tiny(mtp_weights=[1.0, 0.5, 0.25], prefix_weight=0.25)
    assert m.loss_weights.tolist() == [1.0, 0.0, 0.0, 0.0]  # progress 1, as a model loaded from checkpoint.pt
    steps = 30
    for step in range(steps + 1):
        m.set_progress(step / steps)
        assert loss_weights_at(m.cfg, step / steps) == pytest.approx(record_53(step / steps), abs=1e-12)
        torch.testing.assert_close(m.loss_weights, torch.tensor(record_53(step / steps)))
    # stages as the batch schedule's: the third weight reaches 0 at step 10 of 30, the second at step 20
    assert [w for s in (9, 10, 19, 20) for w in loss_weights_at(m.cfg, s / 30)[1:3]] == pytest.approx(
        [0.5, 0.25 / 10, 0.5, 0.0, 0.5 / 10, 0.0, 0.0, 0.0])
    assert loss_weights_at(tiny().cfg, 0.0) == []
    assert loss_weights_at(tiny(mtp_weights=[1.0, 0.5]).cfg, 0.25) == [1.0, 0.25]


# --- the head that unties from the embedding (model.untie_at) ---
