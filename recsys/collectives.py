"""The collectives the trainer and its metrics issue themselves (TorchRec's, the planner's
plan broadcast and the pipelines' exchanges go through their own modules): each on the
rank's device. NCCL takes CUDA tensors only, so a count or a sum kept on the host fails a
GPU run at its first collective; here every tensor is moved to the rank's device first,
whatever device it was made on, and `tests/unit/test_gpu_paths.py` checks that no other
module of `recsys/` calls a collective directly."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum of `tensor` over every rank, on `device` (the rank's); `tensor` unchanged.
    Outside a process group, `tensor` on `device`."""
    summed = tensor.to(device, copy=True)
    if dist.is_initialized():
        dist.all_reduce(summed)
    return summed
