"""Pipeline names and config (also the Hydra schema for `conf/pipeline/`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PipelineName(str, Enum):
    plain = "plain"  # next batch, forward, backward, step; nothing overlapped
    sparse_dist = "sparse_dist"  # TorchRec's TrainPipelineSparseDist


@dataclass
class PipelineConfig:
    name: PipelineName = PipelineName.plain
