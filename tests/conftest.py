"""Test-wide setup: offline, quiet, single-threaded, caches in a temporary folder.

Inductor's cache too: its key leaves out ATEN_CPU_CAPABILITY, so kernels another run compiled for AVX-512 were
loaded under avx2 (SIGSEGV) and default (a compile error), and two suites side by side shared one folder.

Set at import time, before any test module imports torch: intra-op threads chosen after torch starts
are ignored, and two spinning threads per process on a 2-core machine slowed the suite 5x. Triton's kernels
(optim/symmetric.py) run in its interpreter, on CPU tensors: it reads TRITON_INTERPRET when a kernel is defined.
"""
import os
import tempfile
from collections import defaultdict

_CACHE = tempfile.mkdtemp(prefix="shardrun-test-cache-")
os.environ.update({
    "WANDB_MODE": "disabled",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HOME": os.path.join(_CACHE, "hf"),
    "HF_DATASETS_CACHE": os.path.join(_CACHE, "hf_datasets"),
    "TIKTOKEN_CACHE_DIR": os.path.join(_CACHE, "tiktoken"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_CACHE, "inductor"),
    "WANDB_DIR": os.path.join(_CACHE, "wandb"),
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRITON_INTERPRET": "1",
})

import pytest  # noqa: E402
import torch  # noqa: E402  (after OMP_NUM_THREADS on purpose)

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a slow test first (run.sh test keeps this order, --no-loadscope-reorder): started late,
    one of them kept a worker busy for minutes after the other had finished."""
    slow = defaultdict(bool)
    for item in items:
        slow[item.path] |= item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: not slow[item.path])
