"""How big each part of the GPU check is, and how long each may take: real sizes on a GPU, tiny ones for the CPU
rehearsal. The runner plans its parts with these; the verdicts judge a training check against its budget."""
from __future__ import annotations

from dataclasses import dataclass, field

# after SIGTERM, before SIGKILL: train.py stops after the step in flight and writes its summary (it saves nothing
# here); a compile in flight does not stop for it, so a longer grace would buy nothing
KILL_GRACE_S = 5
CALL_S = 540  # the whole check, shell bound included: a device call runs 600 s at most, and the node's setup
# before it (scripts/gpu_check.sh) and the transfers need the rest
CHECKS = ("speedrun", "text", "kernels", "hackathon")


@dataclass
class Sizes:
    """How big each part of the check is: real sizes on a GPU, tiny ones for the CPU rehearsal."""
    train_tokens: int  # per random shard (two of them)
    val_tokens: int
    demo_args: list[str]
    budget_s: dict[str, float]  # train.budget_s of each training check
    timeout_s: dict[str, float]  # "data" and each check
    deadline_s: float
    eval_batches: int  # full batches per eval: a partial one would compile another shape
    # the demo corpus' val loss must fall below this: ln(50,304) = 10.8 at init, and its bytes' unigram entropy
    # is 3.1 nats, so a GPU's figure below that needs context
    text_max_loss: float
    probe: tuple[int, int]  # the probe's window: steps skipped, steps timed
    # each training check's steps, its evals halfway (the budget a cap): a busy machine runs the same checks, only
    # slower; none: the budget's seconds, its evals at half of them
    steps: dict[str, int] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    # per recipe on top: "speedrun" (the speedrun and text checks) and "hackathon"
    recipe_overrides: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # for the subprocesses, on top of ours

    def __post_init__(self) -> None:
        # The budgets add up: a part killed at its timeout (the data's prepare, a check) takes KILL_GRACE_S more
        assert set(self.timeout_s) == {"data", *CHECKS} and self.planned_s() <= self.deadline_s < CALL_S, \
            (self.timeout_s, self.planned_s())

    def planned_s(self) -> float:
        """The seconds of the check if every part runs to its timeout and then its kill grace."""
        return sum(self.timeout_s.values()) + len(self.timeout_s) * KILL_GRACE_S


GPU = Sizes(train_tokens=16_000_000, val_tokens=1_100_000,
            # the text check's val set: 4 eval sequences of 262,144 targets and the token before the first
            demo_args=["--max-tokens", "21000000", "--shard-tokens", "10000000", "--val-tokens", "1048577"],
            # training seconds: ~50-150 steps; the evals come at half of it, after the probe's 33 steps (~4 s at
            # the ~120 ms a speedrun step of 49,152 tokens takes at 30% MFU), and the rest is training after them
            budget_s={"speedrun": 12, "text": 15, "hackathon": 10},
            # What each timeout assumes (one H100/H200, 16 CPU cores compiling, a cold inductor cache); the
            # seconds each took on an H200 are in records/gpu_check/:
            timeout_s={
                # 2 x 16M + 1.1M random tokens and chunks (numpy); data.prepare of 21 MB of stdlib text with the
                # bytes tokenizer; its shards renumbered: ~6 s
                "data": 15,
                # imports and setup ~15 s; cold compile of the 12-layer flex model fwd+bwd, split at DDP's buckets,
                # ~180 s; 5 warm-up steps + 12 s of training at ~125 ms a step; the eval shape (1 x 262,144, fwd
                # only) compiled cold ~25 s; 3 evals of 4 such sequences ~10 s; ~20 s margin
                "speedrun": 260,
                # the speedrun's model and shapes: its graphs loaded from the cache, dynamo still traces (~25 s);
                # setup ~15 s; 15 s of training; 3 evals ~10 s; ~5 s margin
                "text": 72,
                # flex fwd+bwd compiled cold at 2 x 4,096 tokens, head 128 (~7 s); a float64 reference; 2 x 200
                # loader batches (~5 s); imports ~10 s; the FP8 head's matmul at 16,384 x 768 @ 50,304, compiled
                # fwd+bwd (~5 s), its float64 reference (~12 TFLOP) and 3 x 20 timed calls (~1 s); the symmetric
                # kernel's Triton compiles (2 forms at 768 rows, a few s), the spectral norms of 62 matrices, float64
                # references (~1.5 TFLOP) and 2 x 20 Polar Expresses of Muon's stacks (~3 ms each); ~5 s margin
                "kernels": 45,
                # cold compile of the 12-layer SDPA model fwd+bwd at 32 x 1,024 (~35 s after the speedrun's
                # kernels are cached, ~45 s alone) and of its eval graph (~20 s); setup ~15 s; 3 warm-up steps +
                # 10 s of training at ~85 ms a step; 3 evals ~3 s; ~10 s margin when it runs alone (--checks)
                "hackathon": 108},
            # from the runner's import (torch's included); gpu_check.sh's TERM and KILL follow it within CALL_S
            deadline_s=525, eval_batches=4, text_max_loss=2.5, probe=(3, 30))
CPU = Sizes(train_tokens=200_000, val_tokens=20_000,
            demo_args=["--max-tokens", "300000", "--shard-tokens", "140000", "--val-tokens", "20000", "--workers", "1"],
            # the text check's tiny model still has the 50,304-token head: ~10 steps to learn that only bytes occur.
            # Counted in steps: ~11 s of the speedrun's and the text's batch stages, ~3 s of the hackathon's, on 2
            # cores alone; the budgets only caps
            steps={"speedrun": 12, "text": 12, "hackathon": 12}, budget_s={"speedrun": 60, "text": 60, "hackathon": 60},
            timeout_s={"data": 60, "speedrun": 100, "text": 80, "kernels": 80, "hackathon": 80}, deadline_s=525,
            eval_batches=2, text_max_loss=9.0, probe=(1, 3),  # skip 1: the first step holds the GC pass
            # compile is off: inductor on CPU takes minutes per shape, and these sizes test the plumbing.
            # three layers, so that the speedrun's layer without attention (no_attention) has one on each side
            overrides=["--model.n_layer=3", "--model.no_attention=[1]", "--model.n_head=2", "--model.n_embd=64",
                       "--model.value_embeds=1",
                       "--model.block_size=128", "--train.seq_len=128", "--train.batch_size=2",
                       "--eval.batch_size=0", "--eval.seq_len=0",  # not the speedrun's 262,144-token sequences
                       "--train.compile=false", "--train.warmup_steps=2", "--log.every_steps=1"],
            # the speedrun backs out the stream after 8 of its 11 blocks (model.backout): here after 2 of 3, and its
            # skip connection (3 to 6) goes from the first block to the last; the hackathon's bigram table is 192
            # channels wide, more than these 64
            recipe_overrides={"speedrun": ["--model.backout=2", "--model.skip_connection=[0, 2]"],
                              "hackathon": ["--model.bigram_dim=16"]},
            # a rehearsal on a GPU machine still runs on the CPU; one thread, as the CPU track runs (run.sh):
            # spinning intra-op threads on a busy machine slow a step many times over
            env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
