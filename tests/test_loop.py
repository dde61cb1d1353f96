"""train.py's timed loop in this process, on a clock the test moves: where a budget stops a CPU run, and what
the console shows of its steps; a stop and resume while AdamW holds gradients (optim.adam_every), before
and after the head unties from the embedding (model.untie_at), with MUDD connections (model.mudd), and at a step
whose eval was due; no scalar read of a tensor in an ordinary step."""
import pytest

from tests.helpers import growing_window_run, ten_second_steps


def trained(folder, run_id: str, *args: str, warm_up=None) -> tuple:
    """growing_window_run's run `run_id` in `folder` under `args`: its warm-up (`warm_up(run)`, train.warm_up by
    default: a no-op unless the args ask for one), the timed loop, and a save if a SIGTERM stopped it. (run,
    status, its weights, the train losses metrics.jsonl logged)."""
    import json

    import train

    run = growing_window_run(folder, *args, f"--log.run_id={run_id}")
    try:
        (warm_up or train.warm_up)(run)
        status = train.train(run)
        if status == "sigterm":
            train.save(run)
        lines = (folder / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
        losses = [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"]
        return run, status, {k: v.clone() for k, v in run.model.module.state_dict().items()}, losses
    finally:
        run.loader.close()
        run.log.close()


def sigterm_in(step: int, train_step):
    """`train_step` (train.py's), with a SIGTERM that comes while it runs the run's step `step` (counted from 1)."""
    import signal

    def stepped(run, batches, *args, **kwargs):
        out = train_step(run, batches, *args, **kwargs)
        if run.progress.step + 1 == step:
            run.stop_requested.append(signal.SIGTERM)
        return out
    return stepped


def test_a_cpu_run_stops_on_the_step_that_spends_the_budget(tmp_path, monkeypatch, capsys):
    """25 s in 10-s steps: step 3 ends at 30 s and sees the budget spent; on CPU, where reading the step's
    flags costs nothing, no fourth step runs. The first step has its line whatever log.every_steps, and the
    time left is never negative."""
    import train
    ten_second_steps(monkeypatch)
    run = growing_window_run(tmp_path, "--train.schedule=time", "--train.budget_s=25", "--train.max_steps=0",
                             "--log.every_steps=3")
    try:
        status = train.train(run)
    finally:
        run.loader.close()
        run.log.close()
    assert (status, run.progress.step, run.clock.elapsed()) == ("budget", 3, 30.0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 3"]
    assert lines[0].endswith("10.0s elapsed, 15.0s left") and lines[1].endswith("30.0s elapsed, 0.0s left")


def test_a_step_schedule_runs_its_extension_steps_at_the_end_window_and_a_budget_still_caps_it(tmp_path,
                                                                                            monkeypatch):
    """Record 46's shape in small: 6 scheduled steps (windows 8, 16 by halves), 2 extension steps at the final
    window 40 and the final rate, Muon's momentum down over the last 2. Without a budget all 8 steps run; a 25-s
    budget, in 10-s steps, stops the same schedule after step 3."""
    import train
    ten_second_steps(monkeypatch)
    seen, set_lr = [], train.set_lr

    def watched(opts, mult, step, steps):
        set_lr(opts, mult, step, steps)
        seen.append((step, mult, opts[1].param_groups[0]["momentum"]))
    monkeypatch.setattr(train, "set_lr", watched)
    args = ("--train.max_steps=6", "--train.extension_steps=2", "--model.window_start=0",
            "--model.window_stages=[8, 16]", "--optim.name=muon", "--optim.muon_momentum_cooldown_steps=2",
            "--train.lr_warmup_frac=0", "--train.lr_decay_frac=0.5", "--train.lr_final_frac=0.25")
    windows = []
    for budget in (0, 25):
        run = growing_window_run(tmp_path / str(budget), *args, f"--train.budget_s={budget}")
        try:
            status = train.train(run)
            windows.append(run.model.module.window)
        finally:
            run.loader.close()
            run.log.close()
        assert (status, run.progress.step) == (("completed", 8) if budget == 0 else ("budget", 3))
    assert windows == [40, 8]
    # the LR decays over steps 3 to 6 and stays at 0.25; the momentum falls over the last 2 of the 8 steps
    assert [step for step, _, _ in seen[:8]] == list(range(8))
    assert [mult for _, mult, _ in seen[:8]] == pytest.approx([1, 1, 1, 1, 0.75, 0.5, 0.25, 0.25])
    assert [momentum for _, _, momentum in seen[5:8]] == pytest.approx([0.95, 0.95, 0.90])


def test_the_final_eval_widens_the_long_window_after_the_last_steps_own_eval(tmp_path, monkeypatch):
    """eval.final_window: the last step's eval scores at the training window (40), then the final eval at 64, its
    loss the run's final one, and checkpoint.pt's too, loaded as the contract says; the model's window is the
    training one again afterwards."""
    import json

    import torch

    import train
    from data.val import PAD_TARGET
    from model import get_model
    from trainer.data import val_loader
    ten_second_steps(monkeypatch)
    run = growing_window_run(tmp_path, "--train.max_steps=2", "--data.val=holdout", "--eval.tokens=2048",
                             "--eval.every_steps=2", "--eval.final_window=64")
    train.finish(run, train.train(run))
    evals = [r for r in map(json.loads, (tmp_path / "runs" / "w" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval"]
    summary = json.loads((tmp_path / "runs" / "w" / "summary.json").read_text())
    assert [r["step"] for r in evals] == [2, 2] and evals[0]["val_loss"] != evals[1]["val_loss"]
    assert summary["final_val_loss"] == evals[1]["val_loss"]
    assert run.model.module.windows.tolist() == [run.model.module.window, run.model.module.window // 2]
    ckpt = torch.load(run.checkpoint_path, weights_only=True)
    model = get_model(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    with torch.no_grad():
        scored = [(float(model(x, y)[1]) * n, n) for x, y in val_loader(run.cfg, run.dist, run.val_files)
                  if (n := int((y != PAD_TARGET).sum()))]
    # the same fp32 forward on the same batches; train.py sums the chunks' losses in another order: ~1e-7 of ~5
    assert sum(s for s, _ in scored) / sum(n for _, n in scored) == pytest.approx(summary["final_val_loss"], abs=1e-6)


def test_adamw_every_second_step_resumes_exactly_from_a_step_that_holds_its_gradients(tmp_path, monkeypatch):
    """optim.adam_every = 2: a run stopped after step 3, whose AdamW gradients wait for step 4, and resumed ends
    with the weights and losses of the run that went straight through; both stopped and resumed runs warm up
    first, so a warm-up that leaked its held gradients (or lost the resumed ones) would show too."""
    import torch

    import train

    args = ("--optim.name=muon", "--optim.adam_every=2", "--optim.embed_lr=0.05", "--train.max_steps=6")
    warm = ("--train.timing=exclude_warmup", "--train.warmup_steps=1")

    def warm_up(run) -> None:
        held = {name for name, p in run.model.module.named_parameters() if p.grad is not None}
        train.warm_up(run)  # its one step (step 0 again, no AdamW step) holds gradients: the restore drops them
        assert {name for name, p in run.model.module.named_parameters() if p.grad is not None} == held

    _, _, straight, straight_losses = trained(tmp_path, "straight", *args, warm_up=warm_up)
    real = train.train_step
    monkeypatch.setattr(train, "train_step", sigterm_in(3, real))
    run, status, _, _ = trained(tmp_path, "stopped", *args, *warm, warm_up=warm_up)
    assert (status, run.progress.step) == ("sigterm", 3)
    adamw = {name for name, p in run.model.module.named_parameters()
             if any(p is q for g in run.optimizers[0].param_groups for q in g["params"])}
    saved = tmp_path / "runs" / "stopped" / "resume" / "step0000003" / "rank0.pt"
    assert torch.load(saved, weights_only=True)["grads"].keys() == adamw  # held for step 4, Muon's dropped
    monkeypatch.setattr(train, "train_step", real)

    run, status, resumed, losses = trained(tmp_path, "stopped", *args, *warm, warm_up=warm_up)
    assert (status, run.progress.step) == ("completed", 6)
    assert losses == straight_losses
    assert all(torch.equal(resumed[k], w) for k, w in straight.items())
    # without the held gradients the resumed run ends elsewhere: the comparison above sees them
    state = torch.load(saved, weights_only=True)
    torch.save({**state, "grads": {}}, saved)
    _, _, lost, _ = trained(tmp_path, "stopped", *args, *warm, warm_up=warm_up)
    assert not all(torch.equal(lost[k], w) for k, w in straight.items())


def test_a_resumed_launch_logs_the_rows_the_run_would_have_logged(tmp_path, monkeypatch):
    """log.every_steps = 4: a fresh run logs its first step too, so its pace shows at once; a launch that resumes
    it at step 3 does not, which added a row at step 3 the uninterrupted run lacks."""
    import json

    import train

    def rows(run_id: str) -> list[tuple[int, float]]:
        lines = (tmp_path / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["type"] == "train"]

    args = ("--train.max_steps=9", "--log.every_steps=4")
    trained(tmp_path, "straight", *args)
    real = train.train_step
    monkeypatch.setattr(train, "train_step", sigterm_in(2, real))
    assert trained(tmp_path, "stopped", *args)[1] == "sigterm"
    monkeypatch.setattr(train, "train_step", real)
    trained(tmp_path, "stopped", *args)
    assert [step for step, _ in rows("straight")] == [1, 4, 8]
    assert rows("stopped") == rows("straight")


def test_a_run_whose_head_unties_resumes_exactly_from_before_and_after_the_untie(tmp_path, monkeypatch):
    """model.untie_at = 0.35 of 8 steps under optim.adam_every = 2, with model.mtp_weights: the untie waits for
    step 4, the first past 0.35 that starts with no AdamW gradients held (step 3 applies step 2's). Runs stopped
    after 3 steps (AdamW holds gradients that the head's joined), 4 (the untie is the resumed run's first step, and
    its warm-up's, whose restore must tie the head again) and 6 (untied, an AdamW step since) resume to the
    straight run's losses and weights; each stopped run's checkpoint.pt loads per the eval contract, tied or not."""
    import signal

    import torch

    import train
    from trainer.checkpoint import load_checkpoint

    args = ("--optim.name=muon", "--optim.adam_every=2", "--optim.embed_lr=0.05", "--optim.head_lr=0.02",
            "--train.max_steps=8", "--model.untie_at=0.35", "--model.mtp_weights=[1.0, 0.5, 0.25]")
    warm = ("--train.timing=exclude_warmup", "--train.warmup_steps=1")
    real, stop, tied = train.train_step, [], []

    def step(run, batches, *args, **kwargs):
        out = real(run, batches, *args, **kwargs)
        tied.append(run.model.module.tied)
        if run.progress.step + 1 in stop:
            run.stop_requested.append(signal.SIGTERM)
        return out
    monkeypatch.setattr(train, "train_step", step)

    _, _, straight, straight_losses = trained(tmp_path, "straight", *args)
    assert tied == [True] * 4 + [False] * 4
    assert not torch.equal(straight["lm_head.weight"], straight["wte.weight"])
    for at in (3, 4, 6):
        stop[:] = [at]
        run, status, saved, _ = trained(tmp_path, f"stopped{at}", *args, *warm)
        assert (status, run.progress.step) == ("sigterm", at)
        loaded, _ = load_checkpoint(run.checkpoint_path)
        assert loaded.tied == (at < 5) and torch.equal(loaded.lm_head.weight, loaded.wte.weight) == (at < 5)
        assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
        stop.clear()
        run, status, resumed, losses = trained(tmp_path, f"stopped{at}", *args, *warm)
        assert (status, run.progress.step) == ("completed", 8)
        assert losses == straight_losses, at
        assert all(torch.equal(resumed[k], w) for k, w in straight.items()), at


def test_a_run_with_mudd_connections_resumes_exactly(tmp_path, monkeypatch):
    """model.mudd on both layers under the muon recipe: a run stopped after step 3 and resumed ends with the weights
    and losses of the run that went straight through (the MUDD MLPs' AdamW group has betas of its own)."""
    import torch

    import train

    args = ("--optim.name=muon", "--optim.embed_lr=0.05", "--train.max_steps=6", "--model.mudd=[0, 1]",
            "--model.mudd_sources=[0]")
    _, _, straight, straight_losses = trained(tmp_path, "straight", *args)
    assert straight["mudd.0.proj"].any() and straight["mudd.1.bias"].any()  # off their zero init
    real = train.train_step
    monkeypatch.setattr(train, "train_step", sigterm_in(3, real))
    run, status, _, _ = trained(tmp_path, "stopped", *args)
    assert (status, run.progress.step) == ("sigterm", 3)
    monkeypatch.setattr(train, "train_step", real)
    run, status, resumed, losses = trained(tmp_path, "stopped", *args)
    assert (status, run.progress.step) == ("completed", 6)
    assert losses == straight_losses
    assert all(torch.equal(resumed[k], w) for k, w in straight.items())


def test_an_ordinary_step_reads_no_tensor_on_the_host(tmp_path, monkeypatch):
    """train()'s docstring: on a GPU an ordinary step waits for nothing but the Flags of the step before. Run on
    CPU with the GPU's exchange (read a step late), every optimizer piece of the speedrun config on and no log or
    eval due, no step converts a tensor to a Python number (.item(), float(), bool(), int(): the scalar reads that
    wait for a GPU). The Flags arrive through a host buffer (LateMax's .tolist(), no scalar read). AdamW's step
    counters are read here because CPU AdamW keeps them on the host; fused AdamW on a GPU reads none of them. Nor,
    without a clip, does such a step take the gradients' norm, which nobody would read."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    import torch

    import train

    class ScalarReads(TorchDispatchMode):
        """Where each scalar read of a tensor happened, other than of AdamW's step counters; how many gradient
        norms were taken."""
        def __init__(self):
            super().__init__()
            self.where, self.counters, self.norms = [], set(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.counters:
                self.where.append("".join(traceback.format_stack(limit=6)[:-1]))
            self.norms += func.overloadpacket is torch.ops.aten._foreach_norm  # get_total_norm's pass
            return func(*args, **(kwargs or {}))

    reads, real = ScalarReads(), train.timed_step

    def watched(run, loop, batches):
        if run.progress.step < 2:  # the first step freezes the GC and logs whatever log.every_steps
            return real(run, loop, batches)
        reads.counters = {id(state["step"]) for opt in run.optimizers if isinstance(opt, torch.optim.AdamW)
                          for state in opt.state.values()}
        with reads:
            return real(run, loop, batches)
    monkeypatch.setattr(train, "timed_step", watched)
    run = growing_window_run(tmp_path, "--optim.name=muon", "--optim.normuon=true", "--optim.adam_every=2",
                             "--optim.ns_coefficients=polar_express", "--optim.muon_weight_decay=0.01",
                             "--optim.muon_cautious_wd=true", "--optim.muon_momentum_warmup_steps=4",
                             "--train.batch_stages=[1,2]", "--train.max_steps=8", "--log.every_steps=100")
    run.flags.cuda = True  # the GPU's exchange: collected one step late, not at once
    try:
        assert train.train(run) == "completed" and run.progress.step == 8
    finally:
        run.loader.close()
        run.log.close()
    assert reads.where == [], f"{len(reads.where)} scalar reads in ordinary steps; the first:\n{reads.where[0]}"
    assert reads.norms == 0


@pytest.mark.parametrize("schedule", [("--train.max_steps=8",),
                                      ("--train.schedule=time", "--train.budget_s=75", "--train.max_steps=0")])
def test_a_stop_at_a_step_whose_eval_is_due_holds_that_eval_first_on_resume(tmp_path, monkeypatch, schedule):
    """eval.every_steps = 2: a SIGTERM at step 2, whose eval is due, saves it as due; the resumed run holds it
    before its first step, at step 2's window (under a time schedule not the clock's after step 2), so its evals,
    and a stop at a target that eval reaches, are the straight run's."""
    import json

    import train

    args = ("--data.val=holdout", "--eval.tokens=2048", "--eval.every_steps=2", *schedule)

    def evals(run_id: str) -> list:
        lines = (tmp_path / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["val_loss"]) for r in map(json.loads, lines) if r["type"] == "eval"]

    real = train.train_step
    ten_second_steps(monkeypatch)  # 10 s a step: the time schedule's window grows step by step
    trained(tmp_path, "straight", *args)
    straight = evals("straight")
    assert [step for step, _ in straight] == [2, 4, 6, 8][:len(straight)] and len(straight) >= 3
    target = ("--eval.stop_at_target=true", f"--eval.target_loss={straight[0][1]}")  # the straight run's stop
    full = ("completed" if len(schedule) == 1 else "budget", 8)
    for run_id, extra, ends in (("stopped", (), full), ("target", target, ("target", 2))):
        monkeypatch.setattr(train, "train_step", sigterm_in(2, real))
        ten_second_steps(monkeypatch)
        run, status, _, _ = trained(tmp_path, run_id, *args, *extra)
        assert (status, run.progress.step, run.progress.eval_pending) == ("sigterm", 2, run.trained_at)
        monkeypatch.setattr(train, "train_step", real)
        ten_second_steps(monkeypatch)
        run, status, _, _ = trained(tmp_path, run_id, *args, *extra)
        assert (status, run.progress.step) == ends
        assert evals(run_id) == straight[:ends[1] // 2], schedule
