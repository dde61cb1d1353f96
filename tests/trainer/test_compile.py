"""Compile health: the compiled train step has no graph break, the growing window never recompiles it, and the
eval's shape gets a static graph of its own."""
import warnings

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import model.masks
from model import get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers, step_optimizers
from trainer.config import TrainConfig
from trainer.distributed import Dist
from trainer.parallel import ParallelModel, parallelize
from tests.helpers import bf16_attention_error

BF16_ATTENTION = bf16_attention_error()  # None where torch runs a masked bf16 attention on this CPU

# configs/speedrun_8xh100.toml in miniature: every piece it turns on, 2 layers of width 32, 2 x 128 tokens
SPEEDRUN = dict(vocab_size=257, block_size=256, n_layer=2, n_head=2, n_embd=32, bias=False, norm="rmsnorm",
                activation="relu2", rotary=True, rope_base=1024.0, rope_truncate=True, qk_norm=True, attn_scale=0.12,
                norm_gain=False, embed_norm=True, x0_mix=True, tie_embeddings=False, zero_init_proj=True,
                logit_softcap=15.0, value_embeds=1, unet_skips=True, attention="flex", window=160, window_start=40,
                window_pattern="LS", doc_causal=True, bos_id=0)
# and the newer records' pieces on top: the attention gate, the smear, a block without attention (the S layer), the
# bigram table with its sign patterns, XSA, value-embedding and skip gates, backout, YaRN, whose frequencies follow
# the growing window, and MUDD connections (the residual alone: layer 1 has no attention)
NEWER = dict(SPEEDRUN, attn_gate=True, smear=True, no_attention=[1], bigram_hash=500, bigram_dim=16, bigram_signs=True,
             xsa=[0], ve_gate=True, skip_gate=True, backout=1, yarn=True, mudd=[0, 1], mudd_sources=[0])
# MUDD's value channel, which needs attention in the layer after the connection
MUDD = dict(SPEEDRUN, mudd=[0, 1], mudd_sources=[0, 1])
# record 46's pieces: x0 mix from 1.1, value tables from 1 in the first layers, the others' values scaled, one sigmoid
# skip, N(0, 1) tables
RECORD_46 = dict(SPEEDRUN, n_layer=3, window_pattern="LSL", x0_mix_init=1.1, value_embed_skip=1, value_scale=True,
                 skip_connection=[0, 2], embed_init_std=1.0)
# and the loss's other terms with a head that unties from the embedding half way (records 53 and 88)
LOSS_TERMS = dict(SPEEDRUN, tie_embeddings=True, untie_at=0.5, mtp_weights=[1.0, 0.5, 0.25], prefix_weight=0.25)
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
def graphs():
    """A fresh dynamo (caches and counters), and the list of the graphs it compiles (see speedrun)."""
    torch._dynamo.reset()
    counters.clear()
    yield []
    torch._dynamo.reset()


def speedrun(graphs: list, config: dict = SPEEDRUN, **train) -> ParallelModel:
    """The speedrun miniature (or another `config`) as train.py gets it from parallelize in one process, compiled in
    place (with more `train` keys); the backend keeps every graph dynamo hands it in `graphs`, then compiles it with
    BACKEND."""
    def keep(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)
    torch.manual_seed(0)
    return parallelize(get_model(config), TrainConfig(compile=True, **train), Dist(), backend=keep)


@pytest.fixture
def compiled(graphs):
    """The speedrun miniature's plain module, compiled in place as train.py does."""
    return speedrun(graphs).module


def assert_one_graph() -> None:
    """Every call so far ran one graph, compiled once: no graph break, no recompile."""
    breaks = {" ".join(reason.splitlines()[:2]): n for reason, n in counters["graph_break"].items()}
    assert breaks == {}, f"graph breaks: {breaks}"
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["frames"])


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.parametrize("config", [SPEEDRUN, NEWER, MUDD, RECORD_46], ids=["speedrun", "newer_records", "mudd",
                                                                            "record_46"])
def test_train_step_compiles_once_without_graph_breaks(graphs, config):
    # CPU has no FlexAttention backward: this is the SDPA path with the same mask, which CPU trains on
    compiled = speedrun(graphs, config).module
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


@pytest.mark.filterwarnings("ignore:attention='flex'")
@pytest.mark.skipif(bool(BF16_ATTENTION), reason=f"torch's bf16 attention on this CPU: {BF16_ATTENTION}")
def test_the_bf16_stream_compiles_once_and_computes_what_it_does_eager(graphs):
    """train.bf16_stream under bf16 autocast (CPU's here): parallelize turns it on, the step is one graph, the
    loss's autocast-free region included, and its loss and gradients are the eager model's with the key."""
    config = dict(NEWER, zero_init_proj=False)  # every block and the head in the loss from the first step
    compiled = speedrun(graphs, config, bf16_stream=True).module
    torch.manual_seed(0)  # speedrun's draws: the same weights
    eager = get_model(config)
    eager.autocast_stream = True
    assert compiled.autocast_stream
    for step, progress in enumerate(PROGRESS):
        x = documents(step)
        results = []
        for m in (eager, compiled):  # eager first: its warning of the flex fallback is then no guard's change
            m.set_progress(progress)
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = m(x[:, :-1], x[:, 1:])
            loss.backward()
            results.append([loss, *(p.grad for p in m.parameters())])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)  # without the key: 0.4% apart
    assert_one_graph()


def symbolic_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's inputs that dynamo traced with a symbolic size: a size itself, or a tensor with one."""
    names = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.SymInt) or isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in value.shape):
            names.append(node.name)
    return names


def input_shape(gm: torch.fx.GraphModule) -> tuple:
    """The shape of the graph's first tensor input, the token ids (a symbolic size as its name)."""
    ids = next(v for n in gm.graph.nodes if n.op == "placeholder"
               and isinstance(v := n.meta.get("example_value"), torch.Tensor))
    return tuple(d if isinstance(d, int) else str(d) for d in ids.shape)


@pytest.mark.filterwarnings("ignore:attention='flex'")
def test_an_eval_shape_compiles_a_static_graph_of_its_own_and_training_resumes_without_recompiling(graphs):
    # train.py's order: training steps, an eval at another shape (eval.batch_size, eval.seq_len), another eval,
    # training again. With dynamic=None the first eval made dynamo recompile with symbolic batch and length.
    run = speedrun(graphs)
    optimizers = build_optimizers(run.module, OptimConfig(name="muon"))

    def train(steps: int) -> None:
        for step in range(steps):
            run.module.set_progress(PROGRESS[step])
            x = documents(step)
            _, loss = run(x[:, :-1], x[:, 1:])
            loss.backward()
            run.clip_grads(1.0)
            step_optimizers(optimizers, step)

    def evaluate() -> None:
        model = run.eval_module
        model.eval()
        with torch.no_grad():
            x = documents(9, B=3, T=129)
            model(x[:, :-1], x[:, 1:])
        model.train()

    seen = []
    for phase in (lambda: train(2), evaluate, evaluate, lambda: train(2)):
        phase()
        seen.append([input_shape(gm) for gm in graphs])
    dynamic = {input_shape(gm): symbolic_inputs(gm) for gm in graphs if symbolic_inputs(gm)}
    assert dynamic == {}, f"graphs with symbolic (dynamic) shapes, by input shape: {dynamic}"
    # one graph per shape, the eval's compiled once, and training resumed on its own graph
    assert seen == [[(2, 256)], [(2, 256), (3, 128)], [(2, 256), (3, 128)], [(2, 256), (3, 128)]]
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


@pytest.mark.filterwarnings("ignore:attention='flex'")
def test_each_row_length_compiles_a_static_graph_once_and_training_through_the_stages_no_more(graphs):
    """train.batch_stage_rows: each stage's row length is a static graph of its own, compiled in the warm-up; the
    training after it, through the stages, compiles nothing."""
    run = speedrun(graphs)
    optimizers = build_optimizers(run.module, OptimConfig(name="muon"))

    def step(T: int, step: int) -> None:
        x = documents(step, B=1, T=T + 1)
        _, loss = run(x[:, :-1], x[:, 1:])
        loss.backward()
        step_optimizers(optimizers, step)

    for T in (128, 256, 384):  # train.py's warm-up: each row length ahead
        step(T, 0)
    warmed = [input_shape(gm) for gm in graphs]
    for n, T in enumerate((128, 128, 256, 384, 384), start=1):
        step(T, n)
    assert warmed == [input_shape(gm) for gm in graphs] == [(1, 128), (1, 256), (1, 384)]
    assert not any(symbolic_inputs(gm) for gm in graphs) and not counters["graph_break"]


def flex_forwards(compiled, monkeypatch, steps: list[float]) -> None:
    """The CUDA path on CPU: a compiled forward per progress in `steps`, building its BlockMasks inside, each
    checked against SDPA. Forward only, as CPU has no flex backward."""
    monkeypatch.setattr(model.masks, "flex_available", lambda device: True)
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
    build = model.masks.flex_block_mask

    def warning_build(*args):
        warnings.warn("mask built")
        return build(*args)
    monkeypatch.setattr(model.masks, "flex_block_mask", warning_build)
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


@pytest.mark.filterwarnings("ignore:attention='flex'")
def test_the_loss_weights_and_the_untie_never_recompile_the_train_step(graphs):
    """train.py's step over the progress of PROGRESS: the loss's weights change every step (values of a buffer),
    the head unties between 0.3 and 0.7 (which changes nothing in the graph: the same parameters throughout)."""
    from optim.groups import untie_when_due

    compiled = speedrun(graphs, LOSS_TERMS).module
    compiled.set_prefix_targets([(i - 1) // 2 if i > 2 else -1 for i in range(257)])
    optimizers = build_optimizers(compiled, OptimConfig(name="muon"))
    weights, tied = [], []
    for step, progress in enumerate(PROGRESS):
        compiled.set_progress(progress)
        untie_when_due(compiled, optimizers, progress, step)
        weights.append(compiled.loss_weights.tolist())
        tied.append(compiled.tied)
        x = documents(step)
        _, loss = compiled(x[:, :-1], x[:, 1:])
        loss.backward()
        compiled.tie_grads()
        step_optimizers(optimizers, step)
        compiled.tie_weights()
        assert torch.isfinite(loss)
    assert tied == [True, True, False, False] and len({tuple(w) for w in weights}) == 3  # 0.7, 1.0: the last
    assert_one_graph()
