"""The root config schema and its registration in Hydra's ConfigStore.

Each config group's YAML files extend a schema registered here as `base_<group>`, so an
unknown key or a value of the wrong type fails at composition with the key's name.
`experiment/` and `debug/` files are `# @package _global_` deltas checked against the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

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


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)
    cs.store(group="dataset", name="base_dataset", node=DatasetConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterSpec)
    cs.store(group="planner", name="base_planner", node=PlannerConfig)
    cs.store(group="pipeline", name="base_pipeline", node=PipelineConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
