"""What the cost model needs to know about a model: its tables, dense parameters and the
FLOPs of its feature interaction. Built on the meta device: no memory, no GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsys.config import Arch, ModelConfig, TableDtype
from recsys.models.dlrm import build_model, table_configs
from sharding.cost_model import dot_interaction_flops
from sharding.types import TableStats

WEIGHT_BYTES = {TableDtype.fp32: 4, TableDtype.fp16: 2}  # a stored value's


@dataclass
class ModelCost:
    tables: list[TableStats]
    dense_params: int
    interaction_flops_per_sample: float


def model_cost(cfg: ModelConfig, lookups_per_sample: dict[str, float] | None = None) -> ModelCost:
    model = build_model(cfg, dense_device=torch.device("meta"))
    dense = sum(p.numel() for n, p in model.named_parameters() if "embedding_bags" not in n)
    features = len(cfg.num_embeddings_per_feature) + 1  # tables + the bottom MLP's output
    interaction = (
        dot_interaction_flops(features, cfg.embedding_dim)
        if Arch(cfg.arch) == Arch.dlrm
        else 0.0  # DCN's cross layers are parameters, counted in dense
    )
    pooling = lookups_per_sample or {}
    tables = [
        TableStats(
            t.name,
            t.num_embeddings,
            t.embedding_dim,
            pooling.get(t.name, 1.0),
            weight_bytes=WEIGHT_BYTES[TableDtype(cfg.table_dtype)],
        )  # fmt: skip
        for t in table_configs(cfg)
    ]
    return ModelCost(tables, dense, interaction)
