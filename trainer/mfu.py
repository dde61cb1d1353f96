"""Model FLOPs utilisation: the assumed peak FLOP/s of each GPU and the one formula train.py, its probe and the
GPU check use."""
from __future__ import annotations

import torch

from trainer.distributed import Dist

# Dense bf16 peak FLOP/s per GPU (vendor datasheets), for MFU; unknown GPUs get no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2.25e15, "B300": 2.25e15,
                   "GH200": 989e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def gpu_peak_flops(name: str) -> float | None:
    """Assumed peak bf16 FLOP/s of the GPU called `name` (as torch.cuda.get_device_name says), or None if unknown."""
    # the largest match, since a name can hold several keys ("NVIDIA GH200" holds "H200" too)
    matches = [flops for key, flops in PEAK_BF16_FLOPS.items() if key in name]
    return max(matches) if matches else None


def peak_flops(dist: Dist) -> float | None:
    """Assumed peak bf16 FLOP/s of one of this run's GPUs, or None (CPU, unknown GPU)."""
    return gpu_peak_flops(torch.cuda.get_device_name(dist.device)) if dist.cuda else None


def mfu(flops_per_token: float, tok_s: float, peak: float, gpus: int) -> float:
    """Model FLOPs utilisation of `gpus` GPUs of `peak` FLOP/s each, training `tok_s` tokens/s between them."""
    return flops_per_token * tok_s / (peak * gpus)


def mfu_of(flops_per_token: float, tok_s: float, dist: Dist) -> float | None:
    """Model FLOPs utilisation at `tok_s` tokens/s over all ranks (GPU with known peak only)."""
    peak = peak_flops(dist)
    return None if peak is None else mfu(flops_per_token, tok_s, peak, dist.world_size)
