"""What a run holds, on a real one set up in this process (configs/tiny.toml): its tokens per step through the batch
stages, its FLOPs at the window it has now, where its checkpoint goes; a non-finite step's stop, said with the
values and what to try; the hooks an observer from outside gets, which by default only run each stage."""
import pytest
import torch

import train

from model.masks import window_at
from tests.helpers import growing_window_run
from trainer.state import Diverged, Hooks, StopReason, diverged


@pytest.fixture
def run(tmp_path):
    run = growing_window_run(tmp_path, "--train.batch_stages=[1, 2, 3]", "--train.checkpoint_path=out/c.pt")
    yield run
    run.loader.close()
    run.log.close()


def test_tokens_per_step_follow_the_batch_stage_of_the_step_about_to_run(run):
    # tiny.toml: 4 rows of 64 tokens a micro-step, one process, grad_accum 2 (which the stages multiply); the
    # stages are thirds of the 30 steps
    assert run.tokens_by_stage() == [2 * 4 * 64, 4 * 4 * 64, 6 * 4 * 64]
    for step, micro_steps in ((0, 2), (9, 2), (10, 4), (19, 4), (20, 6), (29, 6)):
        run.progress.step = step
        assert run.tokens_per_step == micro_steps * 4 * 64, step


def test_under_batch_stage_rows_the_rows_grow_and_the_flops_follow_them(tmp_path):
    run = growing_window_run(tmp_path, "--train.batch_stages=[1, 2, 3]", "--train.batch_stage_rows=true",
                             "--data.shuffle=false", "--model.block_size=192")
    gpt = run.model.module
    for step, row in ((0, 64), (10, 128), (29, 192)):
        run.progress.step = step
        assert run.tokens_per_step == 2 * 4 * row, step
    for done, row in ((0, 64), (1, 64), (10, 64), (11, 128), (30, 192)):  # the FLOPs of the step just done
        run.progress.step = done
        assert run.flops_per_token() == gpt.flops_per_token(row), done
    assert run.flops_per_token(64) == gpt.flops_per_token(64) < gpt.flops_per_token(192)
    seen = []
    gpt.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    for step in (0, 10, 20):
        run.progress.step = step
        train.train_step(run, iter(run.loader))
    assert seen == [(4, 64)] * 2 + [(4, 128)] * 2 + [(4, 192)] * 2  # grad_accum's 2 micro-steps of each stage's rows
    run.loader.close()
    run.log.close()


def test_flops_per_token_are_the_models_at_the_window_it_has_now(run):
    gpt = run.model.module
    for progress in (0.0, 0.5, 1.0):
        gpt.set_progress(progress)
        assert run.flops_per_token() == gpt.flops_per_token(64, window_at(gpt.cfg, progress))
    assert run.mfu(1e6) is None  # a CPU has no peak FLOP/s to measure against


def test_the_checkpoint_goes_where_the_config_says(run):
    assert str(run.checkpoint_path) == "out/c.pt"


def test_a_non_finite_step_stops_the_run_and_says_what_to_try(run, capsys):
    with pytest.raises(Diverged, match=r"step 7: loss nan, gradient norm inf: not finite.*no checkpoint exists"):
        diverged(run, 7, torch.tensor(float("nan")), torch.tensor(float("inf")))
    said = capsys.readouterr().out
    assert "Try a lower learning rate" in said and "optim.grad_clip = 1.0" in said
    run.saved_step = 5
    with pytest.raises(Diverged, match="the checkpoint of step 5 is untouched"):
        diverged(run, 7, torch.tensor(1.0), torch.tensor(float("nan")))
    with pytest.raises(Diverged, match=r"^step 7: loss nan \(no gradient norm taken: the cause may be earlier\): not "
                                       r"finite, so training stopped"):
        diverged(run, 7, torch.tensor(float("nan")), None)


def test_a_save_of_a_state_that_is_not_finite_stops_the_run_and_writes_nothing(tmp_path):
    """What a step without a gradient norm (no clip, no log due) cannot see in its finite loss: a gradient gone
    non-finite, held for AdamW's next step (optim.adam_every) or already moving the weights. The next save finds it,
    and so does the end of a run that saves nothing."""
    run = growing_window_run(tmp_path, "--optim.name=muon", "--optim.adam_every=2")
    try:
        batches = iter(run.loader)
        for run.progress.step in range(3):  # AdamW steps at step 1, and holds step 2's gradients
            train.train_step(run, batches)
        run.progress.step = 3
        train.save(run)
        saved = run.checkpoint_path.read_bytes()
        run.progress.step = 4
        gpt = run.model.module
        matrix, weight = next((n, p) for n, p in gpt.named_parameters() if n.startswith("blocks.0.") and p.ndim == 2)
        moment = run.optimizers[0].state[gpt.wte.weight]["exp_avg_sq"]
        for name, bad in (("wte.weight", gpt.wte.weight.grad), (matrix, weight), ("wte.weight", moment)):
            finite = bad[3, 5].item()
            with torch.no_grad():
                bad[3, 5] = float("nan")
            with pytest.raises(Diverged, match=rf"^step 4: {name} \(its weight, gradient or optimizer state\) is not "
                                               r"finite, so training stopped without saving \(the checkpoint of step "
                                               r"3 is untouched\)\. .*optim.grad_clip = 1.0, with optim.adam_every = "
                                               r"1\)"):
                train.save(run)
            assert run.checkpoint_path.read_bytes() == saved and run.saved_step == 3
            run.cfg.train.save_checkpoint = False  # nothing to save: the end of the run checks all the same
            with pytest.raises(Diverged, match=rf"^step 4: {name} .* is not finite, so the run fails without its final "
                                               r"eval \(train.save_checkpoint = false: nothing to save\)"):
                train.save(run)
            run.cfg.train.save_checkpoint = True
            with torch.no_grad():
                bad[3, 5] = finite
        train.save(run)
        assert run.saved_step == 4
    finally:
        run.loader.close()
        run.log.close()


def test_hooks_run_each_stage_as_given_by_default(run):
    hooks, seen = Hooks(), []
    assert hooks.setup(lambda cfg, dist: seen.append((cfg, dist)) or run, run.cfg, run.dist) is run
    hooks.warm_up(seen.append, run)
    assert hooks.train(lambda r: seen.append(r) or StopReason.BUDGET, run) == "budget"
    assert hooks.evaluate(lambda r: 2.5, run) == 2.5
    assert seen == [(run.cfg, run.dist), run, run]
