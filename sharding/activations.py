"""Activation memory of a model's dense part, measured on the meta device: the bytes of
every tensor autograd saves for backward in one forward pass, per sample (the difference
between a pass at batch 3 and one at batch 1, over 2: parameters saved for backward, the
same at every batch, drop out). No memory is allocated and nothing is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes_per_sample(forward: Callable[[int], object]) -> float:
    """`forward(batch)` runs the dense part on meta tensors of that batch size."""

    def saved(batch: int) -> int:
        total, seen = [0], set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in seen:  # one tensor saved by two operations is stored once
                seen.add(id(t))
                total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(batch)
        return total[0]

    return (saved(3) - saved(1)) / 2


def dcnv2_activation_bytes(
    dense_in: int,
    bottom: tuple[int, ...],
    embedding_width: int,
    cross_layers: int,
    cross_rank: int,
    top: tuple[int, ...],
) -> float:
    """Per sample, for a DLRM-DCNv2 dense part (TorchRec's MLP and LowRankCrossNet) over
    `embedding_width` pooled floats."""
    from torchrec.modules.crossnet import LowRankCrossNet
    from torchrec.modules.mlp import MLP

    meta = torch.device("meta")
    width = bottom[-1] + embedding_width
    bottom_mlp = MLP(dense_in, list(bottom), device=meta)
    cross = LowRankCrossNet(width, cross_layers, cross_rank).to(meta)
    top_mlp = MLP(width, list(top), device=meta)

    def forward(b: int) -> object:
        dense = bottom_mlp(torch.empty(b, dense_in, device=meta))
        sparse = torch.empty(b, embedding_width, device=meta, requires_grad=True)
        return top_mlp(cross(torch.cat([dense, sparse], dim=1)))

    return saved_bytes_per_sample(forward)
