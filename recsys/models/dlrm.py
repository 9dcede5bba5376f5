"""DLRM and DLRM-DCNv2 built from TorchRec's modules, with their config.

The embedding tables are one EmbeddingBagCollection, one table per categorical feature
(`t_cat_<i>` serves feature `cat_<i>`, TorchRec's Criteo names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain


class Arch(str, Enum):
    dlrm = "dlrm"  # dot interaction
    dcnv2 = "dcnv2"  # low-rank DCN cross layers (MLPerf DLRM-DCNv2)


@dataclass
class ModelConfig:
    """Model shapes. `num_embeddings_per_feature` has one entry per categorical feature."""

    name: str = "dlrm_small"
    arch: Arch = Arch.dlrm
    embedding_dim: int = 16
    num_embeddings_per_feature: list[int] = field(default_factory=lambda: [1000] * 26)
    dense_in_features: int = 13
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 1])
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512


class ModelConfigError(ValueError):
    """Model shapes that cannot make a DLRM."""


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise ModelConfigError naming the field when shapes cannot make a DLRM."""
    if not cfg.num_embeddings_per_feature or min(cfg.num_embeddings_per_feature) < 1:
        raise ModelConfigError(
            f"model '{cfg.name}': num_embeddings_per_feature needs rows >= 1 per table"
        )
    if cfg.embedding_dim < 1 or cfg.dense_in_features < 1:
        raise ModelConfigError(
            f"model '{cfg.name}': embedding_dim and dense_in_features must be >= 1"
        )
    if cfg.embedding_dim % 4:
        raise ModelConfigError(
            f"model.embedding_dim={cfg.embedding_dim}: TorchRec's fused tables (FBGEMM's TBE) "
            f"take a multiple of 4 columns per shard; use a multiple of 4 (e.g. "
            f"{max(4, cfg.embedding_dim // 4 * 4)}), and end dense_arch_layer_sizes with it"
        )
    if not cfg.dense_arch_layer_sizes or cfg.dense_arch_layer_sizes[-1] != cfg.embedding_dim:
        raise ModelConfigError(
            f"model '{cfg.name}': the last dense_arch_layer_sizes entry must equal embedding_dim "
            f"({cfg.embedding_dim}), got {list(cfg.dense_arch_layer_sizes)}"
        )
    if not cfg.over_arch_layer_sizes or cfg.over_arch_layer_sizes[-1] != 1:
        raise ModelConfigError(
            f"model '{cfg.name}': over_arch_layer_sizes must end in 1 (one logit), got "
            f"{list(cfg.over_arch_layer_sizes)}"
        )
    if len(cfg.num_embeddings_per_feature) > len(DEFAULT_CAT_NAMES):
        raise ModelConfigError(
            f"model '{cfg.name}': at most {len(DEFAULT_CAT_NAMES)} categorical features"
        )


def feature_names(cfg: ModelConfig) -> list[str]:
    return list(DEFAULT_CAT_NAMES[: len(cfg.num_embeddings_per_feature)])


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
        )
        for name, rows in zip(feature_names(cfg), cfg.num_embeddings_per_feature, strict=True)
    ]


def build_model(
    cfg: ModelConfig,
    dense_device: torch.device,
    hot_rows: dict[str, int] | None = None,
    sequence_cold: bool = False,
    cold_parts: dict[str, int] | None = None,
) -> DLRMTrain:
    """The train module (model + BCE loss). Tables are on meta: DMP materialises its shards.

    `hot_rows`: tables split into `<name>_hot` / `<name>_cold` (see `recsys.models.split`),
    `cold_parts`: cold parts (or whole tables without hot rows) in row parts
    `<name>_cold0`...; the batches must then go through the matching `SplitRemap`.
    """
    validate_model_config(cfg)
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.dense_in_features,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
        dense_device=dense_device,
    )
    if cfg.arch == Arch.dcnv2:
        model = DLRM_DCN(
            **common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim
        )
    else:
        model = DLRM(**common)
    hot_rows, cold_parts = hot_rows or {}, cold_parts or {}
    from recsys.models.split import is_split

    splits = [
        t.name
        for t in table_configs(cfg)
        if is_split(t.num_embeddings, hot_rows.get(t.name, 0), cold_parts.get(t.name, 1))
    ]
    if splits:  # fmt: skip
        from torchrec import EmbeddingCollection

        from recsys.models.split import SplitSparseArch, sequence_cold_configs, split_configs

        meta = torch.device("meta")
        split = split_configs(table_configs(cfg), hot_rows, cold_parts)
        ec = None
        if sequence_cold:  # cold parts of hot/cold splits exchange only their own lookups
            pooled = frozenset(n for n in splits if not hot_rows.get(n, 0))
            split, cold = sequence_cold_configs(split, pooled)
            ec = EmbeddingCollection(tables=cold, device=meta) if cold else None
        split_ebc = EmbeddingBagCollection(tables=split, device=meta)
        model.sparse_arch = SplitSparseArch(split_ebc, feature_names(cfg), ec)
    return DLRMTrain(model)
