"""The nested pipeline's dense step in one process: micro-batches give the plain loop's
loss, per-logit gradients and parameter gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRMTrain

from pipelines.dense_step import (
    DeferredGrads,
    alignment,
    batch_loss_fn,
    compute_dtype,
    loss_seed,
)
from pipelines.exchange import micro_sizes
from recsys.config import Arch, ModelConfig
from recsys.models.dlrm import build_torchrec_model
from recsys.models.shares import SharedBatchDLRMTrain

FEATURES = 4


def test_micro_batch_boundaries_fall_on_whole_vector_units() -> None:
    assert alignment(torch.float32) == 32 and alignment(torch.bfloat16) == 64
    assert micro_sizes(256, 3, 32) == [96, 96, 64]
    assert micro_sizes(200, 3, 32) == [64, 64, 72]  # the last takes the 8-sample rest
    assert micro_sizes(64, 4, 32) == [32, 32, 0, 0]
    for batch, n in [(2048, 3), (1000, 8), (31, 2), (0, 4)]:
        sizes = micro_sizes(batch, n, 32)
        assert sum(sizes) == batch and all(s % 32 == 0 for s in sizes[:-1])


def _model(arch: str, shared: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=50, feature_names=[f"f{i}"]
        )
        for i in range(FEATURES)
    ]
    cfg = ModelConfig(
        arch=Arch(arch),
        num_embeddings_per_feature=[50] * FEATURES,
        embedding_dim=16,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[1] if arch == "deepfm" else [64, 1],
        dcn_num_layers=3,
        dcn_low_rank_dim=32,
        query_features=2,
    )
    model = build_torchrec_model(cfg, EmbeddingBagCollection(tables=tables), torch.device("cpu"))
    return SharedBatchDLRMTrain(model, 2, 512) if shared else DLRMTrain(model)


def _sparse(ids: torch.Tensor, samples) -> KeyedJaggedTensor:
    """Two ids per bag, one bag per sample and feature."""
    picked = ids[:, samples]  # [feature, sample, 2]
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(FEATURES)],
        values=picked.reshape(-1),
        lengths=torch.full((picked.shape[0] * picked.shape[1],), 2, dtype=torch.int32),
    )


def _micro_batched(train, params, data, order, n: int, align: int):
    """The nested pipeline's dense step: `data`'s samples (in `order`, None: data order) in
    `n` micro-batches on whole `align`-sample units, each forward and backward under
    DeferredGrads; the logits back in data order, and the DeferredGrads once accumulated."""
    dense, ids, labels = data
    batch = len(dense)
    taken = order if order is not None else torch.arange(batch)
    deferred, logits, first = DeferredGrads(params), [], 0
    for b in micro_sizes(batch, n, align):
        mine, first = taken[first : first + b], first + b
        if b == 0:
            continue
        with deferred:
            deferred.start_micro_batch()
            logit = train.model(dense[mine].requires_grad_(), _sparse(ids, mine)).squeeze(-1)
            logit.backward(loss_seed(train, logit, labels[mine], batch))
        logits.append(logit.detach())
    inverse = torch.empty_like(taken)
    inverse[taken] = torch.arange(batch)
    deferred.accumulate(inverse if order is not None else None, batch)
    return torch.cat(logits)[inverse], deferred


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2", "projection", "deepfm", "two_tower"])
@pytest.mark.parametrize("shared", [False, True], ids=["mean_loss", "scaled_sum_loss"])
@pytest.mark.parametrize(
    ("batch", "n", "clustered"), [(256, 4, False), (256, 3, True), (200, 3, False), (256, 8, True)]
)
def test_micro_batches_give_the_plain_loops_gradients(arch, shared, batch, n, clustered) -> None:
    """Dense layers (Linear, DCN's cross kernels and bias) get the whole batch's gradient,
    computed once in data order, whatever N and sample order; the loss is the plain one."""
    train = _model(arch, shared)
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, 13, generator=gen)
    labels = (torch.rand(batch, generator=gen) < 0.3).float()
    ids = torch.randint(0, 50, (FEATURES, batch, 2), generator=gen)
    params = {k: p for k, p in train.named_parameters() if "embedding_bags" not in k}

    loss = train.loss_fn(train.model(dense, _sparse(ids, slice(None))).squeeze(-1), labels)
    loss.backward()
    want = {k: p.grad.clone() for k, p in params.items()}
    train.zero_grad(set_to_none=True)

    order = torch.randperm(batch, generator=gen) if clustered else None
    logits, deferred = _micro_batched(
        train, params, (dense, ids, labels), order, n, alignment(dense.dtype)
    )

    assert not deferred.inexact
    assert torch.equal(train.loss_fn(logits, labels), loss.detach())
    differ = [k for k, p in params.items() if not torch.equal(p.grad, want[k])]
    assert not differ, differ
    assert all(p.grad.is_contiguous() for p in params.values())  # reduced in storage order


def test_a_parameter_used_another_way_is_summed_per_micro_batch_and_named() -> None:
    """A use the mode does not know (here a matmul by the weight) still gets its gradient,
    summed over micro-batches (within rounding), and the parameter is named inexact."""
    weight = torch.nn.Parameter(torch.randn(8, 4))
    other = torch.nn.Parameter(torch.randn(3, 8))  # a linear whose input carries no grad
    x = torch.randn(64, 8)
    loss = (x @ weight).square().sum() + F.linear(x, other).sum()
    want = torch.autograd.grad(loss, [weight, other])
    deferred = DeferredGrads({"w": weight, "other": other})
    for part in x.split(32):
        with deferred:
            deferred.start_micro_batch()
            (
                (part.requires_grad_() @ weight).square().sum()
                + F.linear(part.detach(), other).sum()
            ).backward()
    deferred.accumulate(None, 64)
    assert deferred.inexact == {"w", "other"}
    torch.testing.assert_close(weight.grad, want[0])
    torch.testing.assert_close(other.grad, want[1])


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
@pytest.mark.parametrize(("batch", "n", "clustered"), [(256, 4, False), (320, 3, True)])
def test_under_bf16_autocast_micro_batches_give_the_plain_loops_gradients(
    arch, batch, n, clustered
) -> None:
    """`trainer.precision=bf16`: the model's forward under autocast, logits back in fp32;
    each linear's operands kept in bf16 as autocast ran it, its whole-batch product cast
    back to the parameter's fp32; micro-batches on whole bf16 vector units (64 samples)."""
    from recsys.config import Precision
    from recsys.models.precision import set_precision

    train = _model(arch, shared=False)
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(batch, 13, generator=gen)
    labels = (torch.rand(batch, generator=gen) < 0.3).float()
    ids = torch.randint(0, 50, (FEATURES, batch, 2), generator=gen)
    params = {k: p for k, p in train.named_parameters() if "embedding_bags" not in k}
    with torch.no_grad():
        in_fp32 = train.model(dense, _sparse(ids, slice(None))).squeeze(-1)
    set_precision(train, Precision.bf16, torch.device("cpu"))

    logits = train.model(dense, _sparse(ids, slice(None))).squeeze(-1)
    assert logits.dtype == torch.float32 and not torch.equal(logits, in_fp32)  # bf16 inside
    loss = train.loss_fn(logits, labels)
    loss.backward()
    want = {k: p.grad.clone() for k, p in params.items()}
    assert all(g.dtype == torch.float32 for g in want.values())
    train.zero_grad(set_to_none=True)

    align = alignment(compute_dtype(train, dense.dtype))
    assert align == 64
    order = torch.randperm(batch, generator=gen) if clustered else None
    logits, deferred = _micro_batched(train, params, (dense, ids, labels), order, n, align)
    assert torch.equal(train.loss_fn(logits, labels), loss.detach())
    differ = [k for k, p in params.items() if not torch.equal(p.grad, want[k])]
    assert not differ and not deferred.inexact, differ


def test_a_model_whose_samples_interact_is_refused_at_start_naming_why() -> None:
    """Micro-batches keep each sample's logit and loss only if they depend on that sample
    alone: batch norm in the model, or a loss over the batch (in-batch negatives), is
    refused before training, naming the module or the loss; the contract's models pass."""

    class InBatchSoftmax(torch.nn.Module):  # each query against every candidate of the batch
        def forward(self, logits, labels):
            return F.cross_entropy(logits[:, None] * logits[None, :], torch.arange(len(logits)))

    train = _model("two_tower", shared=False)
    assert batch_loss_fn(train) is train.loss_fn
    train.loss_fn = InBatchSoftmax()
    with pytest.raises(NotImplementedError, match="InBatchSoftmax.*couple samples"):
        batch_loss_fn(train)
    train.per_sample_loss = True  # the module's author vouches for it
    assert batch_loss_fn(train) is train.loss_fn

    normed = _model("dlrm", shared=False)
    normed.model.dense_arch.model = torch.nn.Sequential(
        torch.nn.BatchNorm1d(13), normed.model.dense_arch.model
    )
    with pytest.raises(NotImplementedError, match="dense_arch.model.0.*BatchNorm1d"):
        batch_loss_fn(normed)
