"""Unequal batch shares: ranks with different batch sizes give the global batch's update."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM, DLRMTrain

from recsys.config import SyntheticConfig
from recsys.data.synthetic import SyntheticCriteo
from recsys.models.shares import SharedBatchDLRMTrain

ROWS = [30] * 26


NAMES = [f"cat_{i}" for i in range(26)]


def dlrm() -> DLRM:
    from recsys.config import ModelConfig
    from recsys.models.dlrm import table_configs

    cfg = ModelConfig(
        num_embeddings_per_feature=ROWS,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    torch.manual_seed(0)
    return DLRM(EmbeddingBagCollection(table_configs(cfg)), 13, [16, 8], [16, 1])


def slice_batch(b, lo: int, hi: int):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n = b.labels.shape[0]
    values = b.sparse_features.values().view(len(NAMES), n)[:, lo:hi].reshape(-1)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        NAMES, values, torch.ones(len(values), dtype=torch.int32)
    )
    return Batch(b.dense_features[lo:hi], kjt, b.labels[lo:hi])


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_unequal_shares_give_the_global_batch_gradient() -> None:
    full = SyntheticCriteo(SyntheticConfig(), ROWS, NAMES, 13, 96).batch("train", 0, 0)
    reference = DLRMTrain(dlrm())
    loss, _ = reference(full)
    loss.backward()
    expected = grads(reference)

    shares, world = [24, 72], 2
    summed: dict[str, torch.Tensor] = {}
    lo = 0
    for share in shares:  # each "rank" holds its own share of the global batch
        rank_model = SharedBatchDLRMTrain(dlrm(), world, sum(shares))
        rank_loss, (_, logits, _) = rank_model(slice_batch(full, lo, lo + share))
        assert logits.shape[0] == share
        rank_loss.backward()
        for n, g in grads(rank_model).items():
            summed[n] = summed.get(n, 0) + g
        lo += share
    for n, g in expected.items():  # DDP and TorchRec average gradients over ranks
        assert torch.allclose(summed[n] / world, g, atol=1e-6), n
