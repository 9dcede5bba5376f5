"""Pipeline names and config (also the Hydra schema for `conf/pipeline/`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PipelineName(str, Enum):
    plain = "plain"  # next batch, forward, backward, step; nothing overlapped
    base = "base"  # TorchRec's TrainPipelineBase (batch copy overlapped only)
    sparse_dist = "sparse_dist"  # TorchRec's TrainPipelineSparseDist
    # TorchRec's TrainPipelineSparseDistLite: one batch in flight, its ids' all-to-all in the
    # step (not overlapped), for little memory
    sparse_dist_lite = "sparse_dist_lite"
    # TorchRec's TrainPipelineFusedSparseDist: the next batch's lookup overlaps this batch's
    # optimizer step (the tables update in the fused backward, before it)
    fused_sparse_dist = "fused_sparse_dist"
    semi_sync = "semi_sync"  # TorchRec's TrainPipelineSemiSync: embeddings one step stale
    nested = "nested"  # ours: dual-buffer lookahead + frozen-window micro-batches


# what 2D groups train under (pipelines/two_d.py): the nested pipeline's exchanges span every
# rank, and semi_sync's stale lookups would miss the replicas' update
TWO_D_PIPELINES = (
    PipelineName.plain,
    PipelineName.base,
    PipelineName.sparse_dist,
    PipelineName.sparse_dist_lite,
    PipelineName.fused_sparse_dist,
)


@dataclass
class PipelineConfig:
    name: PipelineName = PipelineName.plain
    # nested only:
    micro_batches: int = 4  # N: chunks of the embedding exchange overlapped with dense work
    # key-centric sample clustering into micro-batches: fewer distinct ids per micro-batch
    # where samples share ids; the pooled exchange's bytes do not change (README)
    cluster_samples: bool = False
    # look up batch i+1 before batch i's update, then refresh the rows it shares: pays on
    # GPUs (a side stream); on CPU ranks nothing runs beside it, so off by default
    lookahead: bool = False
    # key routing with deduplication: each micro-batch's distinct rows cross the network
    # once, pooled by the requester, instead of one pooled vector per sample and feature
    dedup: bool = False
    # with dedup, the gradients go back as unique rows too (each row's gradient summed over
    # its bags by the requester: fewer bytes, equal within rounding); false: they go back
    # pooled, and nested is the plain loop bit for bit (docs/pipelines.md "Dedup")
    dedup_grads: bool = True
