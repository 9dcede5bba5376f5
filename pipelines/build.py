"""Make the pipeline a config names."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import (
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync

from pipelines import torchrec_cpu
from pipelines.nested import NestedPipeline
from pipelines.plain import PlainPipeline
from pipelines.types import PipelineConfig, PipelineName


def build_pipeline(
    cfg: PipelineConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    per_tensor_reduce: bool = False,
) -> TrainPipeline[Any, Any]:
    """`per_tensor_reduce`: dense gradients are averaged one tensor at a time (the model's
    DDP has `dense_step.per_tensor_comm_hook`); the nested pipeline does the same."""
    name = PipelineName(cfg.name)
    if name == PipelineName.plain:
        return PlainPipeline(model, optimizer, device)
    if name == PipelineName.base:
        return TrainPipelineBase(model, optimizer, device)
    if name == PipelineName.sparse_dist:
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    if name == PipelineName.semi_sync:
        if device.type == "cpu":
            torchrec_cpu.install()
        # stale from the first step on (TorchRec's default waits 900 synchronous steps)
        return TrainPipelineSemiSync(model, optimizer, device, start_batch=0)
    if name == PipelineName.nested:
        return NestedPipeline(
            model, optimizer, device, cfg.micro_batches, cfg.cluster_samples, cfg.lookahead,
            cfg.dedup, per_tensor_reduce,
        )  # fmt: skip
    raise ValueError(
        f"unknown pipeline '{cfg.name}'; choose one of {[p.value for p in PipelineName]}"
    )


def detach_for_eval(pipeline: TrainPipeline[Any, Any], model: torch.nn.Module) -> torch.nn.Module:
    """The model with its original forwards, for a plain eval forward between train steps.

    TorchRec's pipelines rewrite the sharded modules' forwards; `progress` re-attaches them.
    """
    detach = getattr(pipeline, "detach", None)
    return detach() if detach is not None else model
