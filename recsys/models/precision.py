"""The dense part's precision on a rank (`trainer.precision`).

- `tf32`: fp32 matmuls and convolutions on tensor cores (GPU ranks; on CPU ranks torch's
  fp32 matmul has no such mode and nothing changes).
- `bf16`: the DLRM's forward under autocast: matmuls and activations in bf16, the logits
  cast back to fp32, so the loss and its gradient are fp32 as autocast computes BCE itself.
  Tables, their lookups and updates, parameters and their gradients stay fp32. The model
  declares `compute_dtype` (the nested pipeline cuts its micro-batches on whole vector
  units of it, `pipelines.dense_step.alignment`).
"""

from __future__ import annotations

import functools

import torch

from recsys.config import Precision


def set_precision(train: torch.nn.Module, precision: Precision, device: torch.device) -> None:
    """`train` (a DLRMTrain-like module whose `model` gives the logits) computes its dense
    part at `precision` on `device`."""
    precision = Precision(precision)
    if precision == Precision.tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if precision == Precision.bf16:
        model = train.model
        model.__class__ = _in_bf16(type(model), device.type)


@functools.cache
def _in_bf16(cls: type, device_type: str) -> type:
    """`cls` whose forward runs under bf16 autocast and returns fp32 (a subclass: the
    parameters, their names and the state dict are the model's own)."""

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = cls.forward(self, *args, **kwargs)
        return out.float()

    return type(
        f"{cls.__name__}InBF16", (cls,), {"forward": forward, "compute_dtype": torch.bfloat16}
    )
