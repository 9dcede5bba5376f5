"""Make the pipeline a config names."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import (
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
    TrainPipelineSparseDistLite,
)
from torchrec.distributed.types import ShardingPlan

from pipelines import torchrec_cpu
from pipelines.dense_reduce import BucketedReduce
from pipelines.nested import NestedPipeline
from pipelines.plain import PlainPipeline
from pipelines.types import PipelineConfig, PipelineName

# what the nested pipeline's exchange handles (pipelines/lookups.py); data_parallel stays local
NESTED_SHARDINGS = (
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "data_parallel",
)


def unsupported_sharding(cfg: PipelineConfig, plan: ShardingPlan) -> str | None:
    """Why the pipeline `cfg` cannot train `plan` (None: it can); asked before the model is
    sharded, so that a plan it cannot run stops before its tables are materialised."""
    if PipelineName(cfg.name) != PipelineName.nested:
        return None
    for module, params in plan.plan.items():
        for table, ps in params.items():
            if cfg.lookahead and ps.compute_kernel == "fused_uvm_caching":
                # batch i+1's lookup would run before batch i's fused update without FBGEMM's
                # prefetch-pipeline cache locking: the update could write through cache slots
                # that hold other rows by then
                return (
                    f"pipeline.lookahead=true: table '{table}' of {module} is cached in HBM "
                    f"(fused_uvm_caching), whose cache the lookahead cannot keep consistent; "
                    f"set pipeline.lookahead=false, or plan it without caching"
                )
            if cfg.dedup and ps.sharding_type in ("row_wise", "table_row_wise"):
                return (
                    f"pipeline.dedup=true: table '{table}' of {module} is sharded "
                    f"{ps.sharding_type}, whose owners send partial sums of every bag, not "
                    f"rows; dedup moves the unique rows of table-wise and column-wise tables. "
                    f"Set pipeline.dedup=false"
                )
            if ps.sharding_type not in NESTED_SHARDINGS:
                return (
                    f"pipeline=nested: table '{table}' of {module} is sharded {ps.sharding_type};"
                    f" the nested pipeline handles {', '.join(NESTED_SHARDINGS)} pooled tables. "
                    f"Use TorchRec's "
                    f"TrainPipelineSparseDist (pipeline=sparse_dist), or a plan without "
                    f"{ps.sharding_type} tables"
                )
    return None


def build_pipeline(
    cfg: PipelineConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    reduce: BucketedReduce | None = None,
) -> TrainPipeline[Any, Any]:
    """`reduce`: the dense gradients' reduction the model's backward runs
    (`dense_reduce.SharedReduction`), which the nested pipeline runs too; None: the model
    has TorchRec's DDP."""
    name = PipelineName(cfg.name)
    if name == PipelineName.plain:
        return PlainPipeline(model, optimizer, device)
    if name == PipelineName.base:
        return TrainPipelineBase(model, optimizer, device)
    if name == PipelineName.sparse_dist:
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)
    if name == PipelineName.sparse_dist_lite:
        return TrainPipelineSparseDistLite(model, optimizer, device)  # runs every batch itself
    if name == PipelineName.fused_sparse_dist:
        if device.type == "cpu":
            torchrec_cpu.install()
        return TrainPipelineFusedSparseDist(model, optimizer, device, execute_all_batches=True)
    if name == PipelineName.semi_sync:
        if device.type == "cpu":
            torchrec_cpu.install()
        # stale from the first step on (TorchRec's default waits 900 synchronous steps)
        return TrainPipelineSemiSync(model, optimizer, device, start_batch=0)
    if name == PipelineName.nested:
        return NestedPipeline(
            model,
            optimizer,
            device,
            cfg.micro_batches,
            cfg.cluster_samples,
            cfg.lookahead,
            cfg.dedup,
            reduce,
            cfg.dedup_grads,
        )
    raise ValueError(
        f"unknown pipeline '{cfg.name}'; choose one of {[p.value for p in PipelineName]}"
    )


def detach_for_eval(pipeline: TrainPipeline[Any, Any], model: torch.nn.Module) -> torch.nn.Module:
    """The model with its original forwards, for a plain eval forward between train steps.

    TorchRec's pipelines rewrite the sharded modules' forwards; `progress` re-attaches them.
    """
    detach = getattr(pipeline, "detach", None)
    return detach() if detach is not None else model
