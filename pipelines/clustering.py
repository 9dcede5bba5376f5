"""Key-centric sample clustering: order a batch's samples so that samples sharing ids fall
into the same micro-batch. It permutes samples only, so the batch's summed gradient is
unchanged; each micro-batch then has fewer distinct ids to route and look up.
"""

from __future__ import annotations

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.exchange import micro_sizes


def _one_id_per_sample(kjt: KeyedJaggedTensor, key: str) -> np.ndarray:
    """The first id of every sample's bag for `key` (-1 for an empty bag)."""
    jt = kjt[key]
    lengths = jt.lengths().numpy()
    first = np.full(len(lengths), -1, dtype=np.int64)
    has = lengths > 0
    first[has] = jt.values().numpy()[jt.offsets().numpy()[:-1][has]]
    return first


def cluster_order(kjt: KeyedJaggedTensor, n: int) -> torch.Tensor:
    """A permutation of the samples that groups shared ids into the same micro-batch.

    Every sample picks its anchor: of its ids, the one most samples of the batch share,
    leaving out ids so frequent that every micro-batch holds them anyway (more than
    batch / n samples) and ids no other sample has. Samples are then ordered by anchor,
    so the samples sharing one land in the same micro-batch; in click logs the samples
    of one user or item share their other ids too, and those follow. Samples without an
    anchor keep their order at the end.
    """
    batch = kjt.stride()
    if n <= 1 or batch <= n:
        return torch.arange(batch)
    cap = batch // n
    keys = kjt.keys()
    counts = np.zeros((batch, len(keys)), dtype=np.int64)
    codes = np.zeros((batch, len(keys)), dtype=np.int64)
    for j, key in enumerate(keys):
        ids = _one_id_per_sample(kjt, key)
        _, inverse, count = np.unique(ids, return_inverse=True, return_counts=True)
        c = count[inverse]
        counts[:, j] = np.where((c > 1) & (c <= cap) & (ids >= 0), c, 0)
        codes[:, j] = inverse
    best = counts.argmax(axis=1)  # ties: the first feature, the same for every sample
    rows = np.arange(batch)
    anchored = counts[rows, best] > 0
    anchor = np.where(anchored, best * batch + codes[rows, best], len(keys) * batch)
    return torch.from_numpy(np.argsort(anchor, kind="stable").astype(np.int64))


def permute_kjt(kjt: KeyedJaggedTensor, order: torch.Tensor) -> KeyedJaggedTensor:
    """The same KJT with its samples (every key's bags) in `order`. (FBGEMM's
    `keyed_jagged_index_select_dim1` does this but has no CPU kernel in 1.8.)"""
    keys, batch = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().view(len(keys), batch)
    starts = kjt.offsets()[:-1].view(len(keys), batch)
    new_lengths = lengths[:, order].reshape(-1)
    new_starts = starts[:, order].reshape(-1)
    total = int(new_lengths.sum())
    # each output position: the start of its bag plus its position within the bag
    bag_first = torch.repeat_interleave(torch.cumsum(new_lengths, 0) - new_lengths, new_lengths)
    src = torch.repeat_interleave(new_starts, new_lengths) + torch.arange(total) - bag_first
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values()[src],
        lengths=new_lengths,
        weights=None if weights is None else weights[src],
        stride=batch,
    )


def permute_batch(batch: Batch, order: torch.Tensor) -> Batch:
    return Batch(
        dense_features=batch.dense_features[order],
        sparse_features=permute_kjt(batch.sparse_features, order),
        labels=batch.labels[order],
    )


def distinct_ids_per_micro_batch(kjt: KeyedJaggedTensor, n: int) -> list[int]:
    """Distinct (feature, id) pairs in each of the `n` contiguous micro-batches."""
    sizes = micro_sizes(kjt.stride(), n)
    out = []
    start = 0
    for size in sizes:
        count = 0
        for key in kjt.keys():
            jt = kjt[key]
            offsets = jt.offsets()
            values = jt.values()[int(offsets[start]) : int(offsets[start + size])]
            count += int(torch.unique(values).numel())
        out.append(count)
        start += size
    return out
