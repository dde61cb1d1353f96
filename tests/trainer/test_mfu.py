"""MFU: the peak FLOP/s a GPU's name gives, and the fraction of it a run's tokens per second use."""
import pytest

from trainer.distributed import Dist
from trainer.mfu import gpu_peak_flops, mfu, mfu_of


def test_a_gpu_name_gives_its_peak_and_the_longest_match_wins():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert gpu_peak_flops("NVIDIA GH200 480GB") == 989e12 and gpu_peak_flops("NVIDIA B200") == 2.25e15
    assert gpu_peak_flops("Tesla T4") is None


def test_mfu_shares_the_tokens_between_the_gpus_and_a_cpu_run_has_none():
    # 8 GPUs of 1e15 FLOP/s at 6e9 FLOPs a token and 4e5 tokens/s between them: 2.4e15 of 8e15
    assert mfu(6e9, 4e5, 1e15, 8) == pytest.approx(0.3)
    assert mfu_of(6e9, 4e5, Dist()) is None
