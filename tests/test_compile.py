"""Compile health: the compiled train step has no graph break, and the growing window never recompiles it."""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import model.gpt
from model import get_model
from optim import OptimConfig, build_optimizers

# configs/speedrun_8xh100.toml in miniature: every piece it turns on, 2 layers of width 32, 2 x 128 tokens
SPEEDRUN = dict(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=32, bias=False, norm="rmsnorm",
                activation="relu2", rotary=True, rope_base=1024.0, rope_truncate=True, qk_norm=True, attn_scale=0.12,
                norm_gain=False, embed_norm=True, x0_mix=True, tie_embeddings=False, zero_init_proj=True,
                logit_softcap=15.0, value_embeds=1, unet_skips=True, attention="flex", window=160, window_start=40,
                window_pattern="LS", doc_causal=True, bos_id=0)
# Graph breaks and recompiles are dynamo's (what it can trace, what its guards check); the backend only turns
# the graphs into code. aot_eager still traces the backward through AOTAutograd and skips inductor's code
# generation, which took 43 s (train step) and 102 s (flex forward) more here.
BACKEND = "aot_eager"
PROGRESS = [0.0, 0.3, 0.7, 1.0]  # the window of each step: 40, 76, 124, 160 tokens


def documents(seed: int, B: int = 2, T: int = 257) -> torch.Tensor:
    """B rows of T tokens holding several documents (BOS = 0) each."""
    x = torch.randint(1, 257, (B, T), generator=torch.Generator().manual_seed(seed))
    x[:, ::50] = 0
    return x


@pytest.fixture
def compiled():
    """A fresh dynamo (caches and counters) and the speedrun miniature, compiled in place as train.py does."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = get_model(SPEEDRUN)
    m.compile(backend=BACKEND)
    yield m
    torch._dynamo.reset()


def assert_one_graph() -> None:
    """Every call so far ran one graph, compiled once: no graph break, no recompile."""
    breaks = {" ".join(reason.splitlines()[:2]): n for reason, n in counters["graph_break"].items()}
    assert breaks == {}, f"graph breaks: {breaks}"
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["frames"])


@pytest.mark.filterwarnings("ignore:attention='flex'")
def test_train_step_compiles_once_without_graph_breaks(compiled):
    # CPU has no FlexAttention backward: this is the SDPA path with the same mask, which CPU trains on
    optimizers = build_optimizers(compiled, OptimConfig(name="muon"))
    windows = []
    for step, progress in enumerate(PROGRESS):
        compiled.set_progress(progress)
        windows.append(compiled.window)
        x = documents(step)
        _, loss = compiled(x[:, :-1], x[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
        compiled.zero_grad(set_to_none=True)
        assert torch.isfinite(loss)
    assert windows == [40, 76, 124, 160]
    assert_one_graph()


def flex_forwards(compiled, monkeypatch, steps: list[float]) -> None:
    """The CUDA path on CPU: a compiled forward per progress in `steps`, building its BlockMasks inside, each
    checked against SDPA. Forward only, as CPU has no flex backward."""
    monkeypatch.setattr(model.gpt, "flex_available", lambda device: True)
    sdpa = get_model({**SPEEDRUN, "attention": "sdpa"})
    sdpa.load_state_dict(compiled.state_dict())
    with torch.no_grad():
        for step, progress in enumerate(steps):
            compiled.set_progress(progress)
            sdpa.set_progress(progress)
            x = documents(step)
            torch.testing.assert_close(compiled(x[:, :-1])[0], sdpa(x[:, :-1])[0], atol=1e-5, rtol=0)


def test_flex_forward_compiles_once_without_graph_breaks(compiled, monkeypatch):
    flex_forwards(compiled, monkeypatch, PROGRESS)
    assert_one_graph()


@pytest.mark.filterwarnings("ignore:mask built")
def test_the_check_fails_on_a_mask_that_breaks_the_graph(compiled, monkeypatch):
    # What create_block_mask(_compile=True) does from torch 2.10 on: a warnings.warn, which dynamo cannot trace
    build = model.gpt.flex_block_mask

    def warning_build(*args):
        warnings.warn("mask built")
        return build(*args)
    monkeypatch.setattr(model.gpt, "flex_block_mask", warning_build)
    flex_forwards(compiled, monkeypatch, PROGRESS[:1])
    with pytest.raises(AssertionError, match="graph breaks: .*warn"):
        assert_one_graph()


def test_train_step_sets_the_window_of_the_lr_schedules_progress(tmp_path):
    import train
    from tests.helpers import growing_window_run

    run = growing_window_run(tmp_path)
    batches = iter(run.loader)
    try:
        for step in (0, 15, 30):  # tiny.toml: a step schedule over max_steps = 30
            run.progress.step = step
            train.train_step(run, batches)
            gpt = run.model.module
            assert gpt.window == round(8 + 32 * step / 30) and gpt.windows.tolist()[1] == gpt.window // 2
    finally:
        run.loader.close()
        run.log.close()
