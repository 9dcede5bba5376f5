"""Pipeline names and config (also the Hydra schema for `conf/pipeline/`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PipelineName(str, Enum):
    plain = "plain"  # next batch, forward, backward, step; nothing overlapped
    base = "base"  # TorchRec's TrainPipelineBase (batch copy overlapped only)
    sparse_dist = "sparse_dist"  # TorchRec's TrainPipelineSparseDist
    semi_sync = "semi_sync"  # TorchRec's TrainPipelineSemiSync: embeddings one step stale
    nested = "nested"  # ours: dual-buffer lookahead + frozen-window micro-batches


@dataclass
class PipelineConfig:
    name: PipelineName = PipelineName.plain
    # nested only:
    micro_batches: int = 4  # N: chunks of the embedding exchange overlapped with dense work
    cluster_samples: bool = True  # key-centric sample clustering into micro-batches
    lookahead: bool = True  # look up batch i+1 before batch i's update, then refresh it
