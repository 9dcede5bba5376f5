"""A two-tower model in the project's model contract (`model(dense, sparse) -> logits`,
docs/training.md "Models"): TorchRec's retrieval example's `TwoTower` (a query tower and a
candidate tower over their own tables, trained pointwise: BCE on the dot product of the
two towers' outputs), with the dense features joining the query side through a bottom MLP.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DenseArch, SparseArch
from torchrec.modules.mlp import MLP


class TwoTower(torch.nn.Module):
    """Query (user) tower over the dense features' bottom-MLP vector and the first
    `query_features` pooled embeddings; candidate (item) tower over the others; the logit
    is their dot product. Each sample's logit depends on that sample alone (no in-batch
    negatives), so micro-batches leave it unchanged."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        query_features: int,
        tower_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        dim = configs[0].embedding_dim
        features = sum(len(c.feature_names) for c in configs)
        self.query_features = query_features
        self.sparse_arch = SparseArch(embedding_bag_collection)  # B x F x D, as DLRM's
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dense_device)
        self.query_tower = MLP((query_features + 1) * dim, tower_layer_sizes, device=dense_device)
        self.candidate_tower = MLP(
            (features - query_features) * dim, tower_layer_sizes, device=dense_device
        )

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        return self.interact(self.dense_arch(dense_features), self.sparse_arch(sparse_features))

    def interact(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The logits (B x 1) from the bottom MLP's vectors and the pooled embeddings."""
        q = self.query_features
        query = torch.cat([dense, pooled[:, :q].flatten(1)], dim=1)
        item = pooled[:, q:].flatten(1)
        return (self.query_tower(query) * self.candidate_tower(item)).sum(dim=1, keepdim=True)
