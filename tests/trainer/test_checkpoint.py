"""checkpoint.pt (the evaluation contract) and the resume state: round trips through real files, and saves
that fail or are superseded leave a complete state behind."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data.loader import TokenLoader
from model import get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers
from tests.helpers import VOCAB, tiny_data
from tests.workers.fault_writer import CONFIG
from trainer.checkpoint import (CheckpointError, load_checkpoint, load_resume, restore, resume_marker, save_checkpoint,
                                save_resume, training_state)
from trainer.config import ConfigError
from trainer.distributed import Dist
from trainer.runs import done_path


def trained_model():
    torch.manual_seed(0)
    model = get_model(CONFIG)
    with torch.no_grad():  # off the init, so that a fresh model differs from it
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def test_a_checkpoint_loads_as_the_contract_says_and_gives_the_same_logits(tmp_path):
    model, path = trained_model(), tmp_path / "checkpoint.pt"
    save_checkpoint(path, CONFIG, model.state_dict(), step=7)
    raw = torch.load(path, weights_only=True)
    assert raw.keys() == {"config", "model", "step"} and raw["config"] == CONFIG and raw["step"] == 7
    loaded, config = load_checkpoint(path)
    assert config == CONFIG and not loaded.training
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], model.eval()(x)[0], atol=0, rtol=0)
        assert not torch.equal(get_model(CONFIG).eval()(x)[0], model(x)[0])
    # an evaluator that passes targets reads both: the logits it scores HellaSwag by, and the loss of those logits
    y = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            logits, loss = loaded(x, y)
        torch.testing.assert_close(logits, loaded(x)[0], atol=0, rtol=0)
        torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)))
    # the contract's own calls, with no .eval() among them: in training mode too the model gives its logits
    contract = get_model(raw["config"])
    contract.load_state_dict(raw["model"])
    with torch.no_grad():
        logits, loss = contract(x, y)
    torch.testing.assert_close(logits, loaded(x)[0], atol=0, rtol=0)


BEFORE_SPLIT = Path(__file__).parents[1] / "model" / "before_split"


@pytest.mark.parametrize("name", ["gpt2", "records"])
def test_checkpoints_written_before_the_model_was_split_into_files_load_and_give_their_logits(name):
    """tests/model/before_split/: checkpoint.pt files that ed639e4's model/gpt.py wrote (its state-dict keys, the
    users' contract), GPT-2's shape and one with every record piece on, their weights moved off the init, and
    each one's logits on a fixed batch at 1/4 of training (the window follows the progress; they hold none, as
    the model then saved none)."""
    want = torch.load(BEFORE_SPLIT / "logits.pt", weights_only=True)
    model, _ = load_checkpoint(BEFORE_SPLIT / f"{name}.pt")
    model.set_progress(0.25)
    with torch.no_grad():
        torch.testing.assert_close(model(want["idx"])[0], want["logits"][name])


def test_files_that_are_no_checkpoint_say_why(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint; pass runs/<run_id>/checkpoint.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"expected a dict with keys 'config' and 'model'.*got keys \['weights'\]"):
        load_checkpoint(tmp_path / "other.pt")
    wider = {"model": {**CONFIG["model"], "n_embd": 32}}
    save_checkpoint(tmp_path / "mixed.pt", wider, get_model(CONFIG).state_dict(), step=1)
    with pytest.raises(CheckpointError, match="its config and weights do not make a model"):
        load_checkpoint(tmp_path / "mixed.pt")
    # torch's own words were "()" (empty), "(101)" (text) and 200 characters of a zip library's internals (cut short)
    save_checkpoint(tmp_path / "checkpoint.pt", CONFIG, get_model(CONFIG).state_dict(), step=1)
    whole = (tmp_path / "checkpoint.pt").read_bytes()
    cut = "it is incomplete (a copy cut short, or a save still being written)"
    for content, why in ((b"", "it is empty"), (b"step 3 | loss 5.56\n", "it is not a file torch.save wrote"),
                         (whole[:len(whole) // 2], cut)):
        (tmp_path / "copy.pt").write_bytes(content)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(tmp_path / "copy.pt")
        assert str(e.value) == (f"{tmp_path / 'copy.pt'}: cannot be loaded as a checkpoint: {why}; copy it again from "
                                f"its run, or pass the run's own runs/<run_id>/checkpoint.pt")


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, CONFIG, get_model(CONFIG).state_dict(), step=1)
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - what pickle raises for a function is its own business
        save_checkpoint(path, {**CONFIG, "unsavable": lambda: 0}, get_model(CONFIG).state_dict(), step=2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_the_resume_state_restores_model_optimizer_held_gradients_loader_and_rng(tmp_path):
    data = tiny_data(tmp_path / "data", train_sizes=(5000,), val_tokens=500)
    run_dir, dist = tmp_path / "run", Dist()
    model = trained_model()
    (opt,) = build_optimizers(model, OptimConfig())
    with TokenLoader(sorted(data.glob("*_train_*.bin")), 2, 16) as loader:
        x, y = next(loader)
        model(x, y)[1].backward()
        opt.step()
        held, *dropped = [name for name, _ in model.named_parameters()]
        for name, p in model.named_parameters():  # as if held for a later AdamW step (optim.adam_every)
            p.grad = p.grad if name == held else None
        save_resume(run_dir, dist, 1, training_state(model, [opt], loader), CONFIG, replicated=True)
        want_batch, want_rand = next(loader), torch.rand(3)
    marker = resume_marker(run_dir, dist)
    assert (marker["dir"], marker["step"], marker["world_size"], marker["config"]) == ("step0000001", 1, 1, CONFIG)
    fresh = get_model(CONFIG)
    (fresh_opt,) = build_optimizers(fresh, OptimConfig())
    fresh(x, y)[1].backward()  # gradients everywhere: the restore keeps only the held one
    with TokenLoader(sorted(data.glob("*_train_*.bin")), 2, 16) as fresh_loader:
        restore(fresh, [fresh_opt], fresh_loader, load_resume(run_dir, dist, marker))
        got_batch, got_rand = next(fresh_loader), torch.rand(3)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, atol=0, rtol=0)
    grads = dict(fresh.named_parameters())
    assert torch.equal(grads[held].grad, dict(model.named_parameters())[held].grad)
    assert dropped and all(grads[name].grad is None for name in dropped)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(got_batch, want_batch)) and torch.equal(got_rand, want_rand)


def test_a_resume_state_saved_before_a_group_setting_existed_takes_the_setting_as_built(tmp_path):
    """Muon's groups gained keys over time (record 46's wd_lr_squared, normuon_columns): torch's load_state_dict
    puts the saved groups in place of the built ones, so without the built settings the first step of a resumed
    older run would raise KeyError; the saved groups' own values win."""
    data = tiny_data(tmp_path / "data", train_sizes=(5000,), val_tokens=500)
    cfg = OptimConfig(name="muon", normuon=True, muon_weight_decay=0.01, muon_wd_lr_squared=True)
    model = trained_model()
    optimizers = build_optimizers(model, cfg)
    with TokenLoader(sorted(data.glob("*_train_*.bin")), 2, 16) as loader:
        state = training_state(model, optimizers, loader)
        for saved in state["optim"]:
            for group in saved["param_groups"]:
                group.pop("wd_lr_squared", None)  # as written before the key existed
                group["lr"] = 0.125
        restore(model, optimizers, loader, state)
    muon = [g for opt in optimizers for g in opt.param_groups if "wd_lr_squared" in g or "ns_steps" in g]
    assert muon and all(g["wd_lr_squared"] is True for g in muon)  # the setting as this run built it
    assert all(g["lr"] == 0.125 for opt in optimizers for g in opt.param_groups)  # what was saved wins


def test_a_new_resume_state_replaces_the_old_one_and_names_its_world_size(tmp_path):
    state = {"model": get_model(CONFIG).state_dict(), "optim": [], "loader": {}, "rng": {"cpu": None, "cuda": None}}
    for step in (1, 2):
        save_resume(tmp_path, Dist(), step, state, CONFIG, replicated=False)
    resume = done_path(tmp_path).parent
    assert sorted(p.name for p in resume.iterdir()) == ["done.json", "step0000002"]
    assert json.loads(done_path(tmp_path).read_text())["step"] == 2
    with pytest.raises(ConfigError, match="saved with world size 1, this one has world size 2"):
        load_resume(tmp_path, Dist(world_size=2), resume_marker(tmp_path, Dist(world_size=2)))
    assert resume_marker(tmp_path / "elsewhere", Dist()) is None


def test_a_ddp_replica_writes_no_held_gradients_and_resumes_with_rank_0s(tmp_path):
    # under DDP every rank holds the same averaged gradients (as the model and optimizer state): rank 0 writes them
    grads = {"wte.weight": torch.randn(4, 3)}
    state = {"model": {"w": torch.ones(2)}, "optim": [], "grads": grads, "loader": {}, "rng": {"cpu": None,
                                                                                            "cuda": None}}
    for rank in (1, 0):  # rank 0 last: its done.json marks the state complete
        save_resume(tmp_path, Dist(rank=rank, world_size=2), 1, state, CONFIG, replicated=True)
    folder = done_path(tmp_path).parent / "step0000001"
    assert torch.load(folder / "rank1.pt", weights_only=True).keys() == {"loader", "rng"}
    marker = resume_marker(tmp_path, Dist(world_size=2))  # rank 0's, which every rank gets
    loaded = load_resume(tmp_path, Dist(rank=1, world_size=2), marker)
    assert loaded.keys() == state.keys() and torch.equal(loaded["grads"]["wte.weight"], grads["wte.weight"])
