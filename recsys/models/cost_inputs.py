"""What the cost model needs to know about a model: its tables, dense parameters, the
FLOPs of its feature interaction and the activation bytes its dense part saves for backward
per sample. Built and run on the meta device: no memory, no GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    """The model's costs, worked out once per model config and pooling in a process (it
    builds the model on meta and runs its dense part, 40 ms; side-by-side runs of one
    model, as benchmarks and the tests' comparisons make, each ask again)."""
    key = (repr(cfg), tuple(sorted((lookups_per_sample or {}).items())))
    if key not in _COSTS:
        if len(_COSTS) >= 32:
            _COSTS.pop(next(iter(_COSTS)))
        _COSTS[key] = _measure(cfg, lookups_per_sample)
    return replace(_COSTS[key], tables=list(_COSTS[key].tables))  # a caller's own list


_COSTS: dict[tuple, ModelCost] = {}


def _measure(cfg: ModelConfig, lookups_per_sample: dict[str, float] | None) -> ModelCost:
    model = build_model(cfg, dense_device=torch.device("meta"))
    dense = sum(p.numel() for n, p in model.named_parameters() if "embedding_bags" not in n)
    interaction = _interaction_flops(cfg)
    pooling = lookups_per_sample or {}
    tables = [
        TableStats(
            t.name,
            t.num_embeddings,
            t.embedding_dim,
            pooling.get(t.name, 1.0),
            weight_bytes=WEIGHT_BYTES[TableDtype(cfg.table_dtype)],
        )
        for t in table_configs(cfg)
    ]
    return ModelCost(
        tables, dense, interaction, _activation_bytes(model.model, cfg), cfg.dense_in_features
    )


def _interaction_flops(cfg: ModelConfig) -> float:
    """FLOPs per sample of the feature interaction's parameter-free work (its parameters'
    are counted with the dense part's)."""
    features, dim = len(cfg.num_embeddings_per_feature) + 1, cfg.embedding_dim  # + bottom MLP
    arch = Arch(cfg.arch)
    if arch == Arch.dlrm:
        return dot_interaction_flops(features, dim)
    if arch == Arch.projection:  # one branch's projected vectors dotted with the other's
        f1 = cfg.interaction_branch1_layer_sizes[-1] // dim
        f2 = cfg.interaction_branch2_layer_sizes[-1] // dim
        return 2.0 * f1 * f2 * dim
    if arch == Arch.deepfm:  # the factorization machine: a square of sums, a sum of squares
        return 4.0 * features * dim
    if arch == Arch.two_tower:  # the two towers' outputs dotted
        return 2.0 * cfg.tower_layer_sizes[-1]
    return 0.0  # DCN's cross layers are parameters


def _activation_bytes(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Bytes the model's dense part saves for backward per sample: the bottom MLP, the
    interaction over the pooled embeddings, the top MLP."""
    model = model.to("meta")  # buffers too (the interaction's indices)
    meta = torch.device("meta")
    names = [f"cat_{i}" for i in range(len(cfg.num_embeddings_per_feature))]

    def forward(b: int) -> object:
        dense = model.dense_arch(torch.empty(b, cfg.dense_in_features, device=meta))
        pooled = torch.empty(b, len(names), cfg.embedding_dim, device=meta, requires_grad=True)
        if Arch(cfg.arch) == Arch.two_tower:
            return model.interact(dense, pooled)
        if Arch(cfg.arch) == Arch.deepfm:  # its interaction takes each feature's by name
            by_name = dict(zip(names, pooled.unbind(1), strict=True))
            return model.over_arch(model.inter_arch(dense, by_name))
        return model.over_arch(model.inter_arch(dense, pooled))

    return saved_bytes_per_sample(forward)
