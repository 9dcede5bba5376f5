"""What the cost model needs to know about a model: its tables, dense parameters, the
FLOPs of its feature interaction and the activation bytes its dense part saves for backward
per sample. Built and run on the meta device: no memory, no GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsys.config import Arch, ModelConfig, TableDtype
from recsys.models.dlrm import build_model, table_configs
from sharding.activations import saved_bytes_per_sample
from sharding.cost_model import dot_interaction_flops
from sharding.types import TableStats

WEIGHT_BYTES = {TableDtype.fp32: 4, TableDtype.fp16: 2}  # a stored value's


@dataclass
class ModelCost:
    tables: list[TableStats]
    dense_params: int
    interaction_flops_per_sample: float
    activation_bytes_per_sample: float = 0.0
    dense_features: int = 13


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
    return ModelCost(tables, dense, interaction, _activation_bytes(model.model, cfg),
                     cfg.dense_in_features)  # fmt: skip


def _activation_bytes(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Bytes TorchRec's DLRM / DLRM_DCN dense part saves for backward per sample: the
    bottom MLP, the interaction over the pooled embeddings, the top MLP."""
    model = model.to("meta")  # buffers too (the interaction's indices)
    meta = torch.device("meta")
    features = len(cfg.num_embeddings_per_feature)

    def forward(b: int) -> object:
        dense = model.dense_arch(torch.empty(b, cfg.dense_in_features, device=meta))
        pooled = torch.empty(b, features, cfg.embedding_dim, device=meta, requires_grad=True)
        return model.over_arch(model.inter_arch(dense, pooled))

    return saved_bytes_per_sample(forward)
