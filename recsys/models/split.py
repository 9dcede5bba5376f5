"""Hot/cold split tables: the model side and the data side of a frequency-based row split.

TorchRec shards rows evenly by id (uneven row-wise shards are wrong in training), so a
table whose hottest rows are placed apart from the rest is split into two tables: feature
`f` becomes `f_hot` (rows = the hot ids, in sorted order) and `f_cold` (every other id, in
order). `SplitRemap` rewrites a batch's ids into the two new features; `SplitSparseArch`
sums the two pooled embeddings back into `f`. With the hot and cold rows copied from the
unsplit table (`split_weights`), the split model computes the same function.

Shapes: B = batch size, N = ids of one feature in the batch.
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

HOT, COLD = "_hot", "_cold"


def split_configs(
    tables: list[EmbeddingBagConfig], hot_rows: dict[str, int]
) -> list[EmbeddingBagConfig]:
    """Tables with `0 < hot_rows[name] < rows` become `<name>_hot` and `<name>_cold`, serving
    features `<feature>_hot` and `<feature>_cold`."""
    out = []
    for t in tables:
        h = hot_rows.get(t.name, 0)
        if not 0 < h < t.num_embeddings:
            out.append(t)
            continue
        (feature,) = t.feature_names
        for suffix, rows in ((HOT, h), (COLD, t.num_embeddings - h)):
            out.append(EmbeddingBagConfig(name=t.name + suffix, embedding_dim=t.embedding_dim,
                                          num_embeddings=rows, feature_names=[feature + suffix],
                                          init_fn=t.init_fn))  # fmt: skip
    return out


class SplitSparseArch(SparseArch):
    """DLRM's SparseArch over a split collection: returns B x F x D for the original F
    features, each split feature's hot and cold pooled embeddings summed."""

    def __init__(self, ebc: EmbeddingBagCollection, feature_names: list[str]) -> None:
        super().__init__(ebc)
        present = set(self._sparse_feature_names)
        self._split = [f for f in feature_names if f + HOT in present]
        self._sparse_feature_names = list(feature_names)
        self.F = len(feature_names)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        values = [
            pooled[f + HOT] + pooled[f + COLD] if f in self._split else pooled[f]
            for f in self._sparse_feature_names
        ]
        return torch.cat(values, dim=1).reshape(-1, self.F, self.D)


class SplitRemap:
    """Rewrites a KJT's ids of split features into their hot and cold features.

    `hot_ids[feature]` is the sorted array of the feature's hot ids. An id equal to the k-th
    hot id becomes row k of the hot table; any other id x becomes row x - (hot ids below x)
    of the cold table. Per-sample order and bag lengths are kept.
    """

    def __init__(self, hot_ids: dict[str, torch.Tensor]) -> None:
        self.hot_ids = {f: torch.as_tensor(ids, dtype=torch.int64).sort().values
                        for f, ids in hot_ids.items()}  # fmt: skip

    def __call__(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys, values, lengths = [], [], []
        for f in kjt.keys():
            jt = kjt[f]
            ids_N, len_B = jt.values(), jt.lengths()
            hot = self.hot_ids.get(f)
            if hot is None:
                keys.append(f)
                values.append(ids_N)
                lengths.append(len_B)
                continue
            pos_N = torch.searchsorted(hot, ids_N)
            is_hot_N = hot[pos_N.clamp(max=len(hot) - 1)] == ids_N
            sample_N = torch.repeat_interleave(torch.arange(len(len_B)), len_B.long())
            hot_len = torch.bincount(sample_N[is_hot_N], minlength=len(len_B)).to(len_B.dtype)
            keys += [f + HOT, f + COLD]
            values += [pos_N[is_hot_N], (ids_N - pos_N)[~is_hot_N]]
            lengths += [hot_len, len_B - hot_len]
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )


def split_weights(weight: torch.Tensor, hot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hot and cold tables' initial rows, copied from the unsplit table's."""
    hot = torch.as_tensor(hot_ids, dtype=torch.int64).sort().values
    is_hot = torch.zeros(weight.shape[0], dtype=torch.bool)
    is_hot[hot] = True
    return weight[hot].clone(), weight[~is_hot].clone()
