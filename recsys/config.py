"""The root config schema and its registration in Hydra's ConfigStore.

Each config group's YAML files extend a schema registered here as `base_<group>`, so an
unknown key or a value of the wrong type fails at composition with the key's name.
`experiment/` and `debug/` files are `# @package _global_` deltas checked against the root.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipelines.types import PipelineConfig
from recsys.data.source import DatasetConfig
from recsys.models.dlrm import ModelConfig
from recsys.trainer import TrainerConfig
from sharding.types import ClusterSpec, PlannerConfig

GROUPS = ("dataset", "model", "cluster", "planner", "pipeline", "trainer", "experiment", "debug")


@dataclass
class TrainConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class TrainConfigError(ValueError):
    """A training config key with a value no run can use; the message names the key."""


def check_train_config(cfg: TrainConfig) -> None:
    """Every key a run reads that can be checked before any rank starts, each refused in one
    line naming it (the model's, the cluster's and the planner's own checks run beside)."""
    t = cfg.trainer
    lows = {"batch_size": 1, "max_steps": 1, "warmup_steps": 0, "log_every": 1,
            "eval_every": 0, "checkpoint_every": 0, "threads_per_rank": 0}  # fmt: skip
    for key, low in lows.items():
        value = getattr(t, key)
        if not value >= low:
            raise TrainConfigError(f"trainer.{key} must be >= {low}, got {value}")
    for key in ("lr", "embedding_lr", "eps", "dist_timeout_s", "job_timeout_s"):
        value = getattr(t, key)
        if not (math.isfinite(value) and value > 0):
            raise TrainConfigError(f"trainer.{key} must be a finite number > 0, got {value}")
    if t.log_level not in ("info", "debug"):
        raise TrainConfigError(f"trainer.log_level must be info or debug, got '{t.log_level}'")
    if not cfg.pipeline.micro_batches >= 1:
        raise TrainConfigError(f"pipeline.micro_batches must be >= 1 (1: no micro-batches), got "
                               f"{cfg.pipeline.micro_batches}")  # fmt: skip
    if not cfg.dataset.eval_batches >= 0:
        raise TrainConfigError(f"dataset.eval_batches must be >= 0 (0: no evaluation), got "
                               f"{cfg.dataset.eval_batches}")  # fmt: skip


def register_configs() -> None:
    # run directories: `${now:...}-${pid:}`, so two runs started in the same second differ
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)
    cs.store(group="dataset", name="base_dataset", node=DatasetConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterSpec)
    cs.store(group="planner", name="base_planner", node=PlannerConfig)
    cs.store(group="pipeline", name="base_pipeline", node=PipelineConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
