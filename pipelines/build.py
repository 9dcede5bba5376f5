"""Make the pipeline a config names."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineSparseDist

from pipelines.plain import PlainPipeline
from pipelines.types import PipelineConfig, PipelineName


def build_pipeline(
    cfg: PipelineConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> TrainPipeline[Any, Any]:
    name = PipelineName(cfg.name)
    if name == PipelineName.plain:
        return PlainPipeline(model, optimizer, device)
    if name == PipelineName.sparse_dist:
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    raise ValueError(
        f"unknown pipeline '{cfg.name}'; choose one of {[p.value for p in PipelineName]}"
    )


def detach_for_eval(pipeline: TrainPipeline[Any, Any], model: torch.nn.Module) -> torch.nn.Module:
    """The model with its original forwards, for a plain eval forward between train steps.

    TorchRec's pipelines rewrite the sharded modules' forwards; `progress` re-attaches them.
    """
    detach = getattr(pipeline, "detach", None)
    return detach() if detach is not None else model
