"""The pooled-embedding all-to-all of a table-wise (or column-wise) sharded group, in
micro-batch chunks, forward and backward, as plain asynchronous collectives.

TorchRec's `PooledEmbeddingsAllToAll` moves a whole batch and puts its backward inside
autograd, where the engine waits for it at once. Here each chunk is its own
`all_to_all_single(async_op=True)`; the caller decides what runs while it is in flight.

Layout (the same as TorchRec's, so the result is the same tensor): the owner's local
lookup output holds the samples of every rank, rank by rank, one column block of
`dim_sum_per_rank[owner]` wide. Rank `r` receives, for its own samples, one block from
every owner and concatenates them along columns in owner order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division


def micro_sizes(batch: int, n: int, align: int = 1) -> list[int]:
    """`batch` samples in `n` micro-batches as equal as can be in whole units of `align`
    samples (earlier ones one unit larger); the last also takes the `batch % align` rest.
    So every boundary falls on a multiple of `align` (`dense_step.alignment`)."""
    units, rest = divmod(batch, align)
    sizes = [(units // n + (1 if k < units % n else 0)) * align for k in range(n)]
    sizes[-1] += rest
    return sizes


@dataclass
class ChunkPlan:
    """Which samples of every rank's batch micro-batch `k` holds, the same on all ranks:
    consecutive ones, or with `orders` (each rank's sample order, from clustering) the
    k-th slice of that order; sizes from `micro_sizes(batch, n, align)`."""

    batch_per_rank: list[int]
    n: int
    orders: list[torch.Tensor] | None = None
    align: int = 1  # micro-batch boundaries on multiples of this many samples

    def __post_init__(self) -> None:
        self.sizes = [micro_sizes(b, self.n, self.align) for b in self.batch_per_rank]  # [rank][k]
        self.rank_offset = [0]
        for b in self.batch_per_rank[:-1]:
            self.rank_offset.append(self.rank_offset[-1] + b)

    def samples(self, rank: int, k: int) -> slice | torch.Tensor:
        """Micro-batch k of `rank`: its samples' positions in that rank's batch."""
        first = sum(self.sizes[rank][:k])
        window = slice(first, first + self.sizes[rank][k])
        return window if self.orders is None else self.orders[rank][window]

    def rows(self, rank: int, k: int) -> slice | torch.Tensor:
        """The same samples' rows in an owner's stacked (all ranks) lookup output."""
        at, offset = self.samples(rank, k), self.rank_offset[rank]
        return slice(at.start + offset, at.stop + offset) if isinstance(at, slice) else at + offset


class Pending:
    """An in-flight exchange: `wait()` gives the received tensor, shaped."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


class ChunkedPooledExchange:
    """Forward and backward exchange of one pooled group in micro-batch chunks."""

    def __init__(self, pg: dist.ProcessGroup, dim_sum_per_rank: list[int]) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.dims = list(dim_sum_per_rank)
        self.local_dim = self.dims[self.rank]
        self.col_starts = [sum(self.dims[:o]) for o in range(len(self.dims))]

    def forward(self, local: torch.Tensor, plan: ChunkPlan, k: int) -> Pending:
        """Send each rank its chunk-k rows of `local` (all ranks' samples x my columns);
        receive my chunk-k samples x every owner's columns."""
        world = len(self.dims)
        send = torch.cat([local[plan.rows(s, k)].reshape(-1) for s in range(world)])
        mine = plan.sizes[self.rank][k]
        recv = local.new_empty(mine * sum(self.dims))
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[mine * d for d in self.dims],
            input_split_sizes=[plan.sizes[s][k] * self.local_dim for s in range(world)],
            group=self.pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            parts = recv.split([mine * d for d in self.dims])
            return torch.cat(
                [p.view(mine, d) for p, d in zip(parts, self.dims, strict=True)], dim=1
            )

        return Pending(work, finish)

    def backward(self, grad: torch.Tensor, plan: ChunkPlan, k: int, out: torch.Tensor) -> Pending:
        """The reverse: my chunk-k samples' gradient (every owner's columns) goes back to
        the owners; what I receive lands in `out` (my lookup output's gradient) at the
        rows of chunk k of every rank, divided by the world size when TorchRec's gradient
        division is on (its default: the sparse counterpart of DDP's averaging)."""
        world = len(self.dims)
        mine = plan.sizes[self.rank][k]
        send = torch.cat(
            [
                grad[:, c : c + d].reshape(-1)
                for c, d in zip(self.col_starts, self.dims, strict=True)
            ]
        )
        recv_sizes = [plan.sizes[s][k] * self.local_dim for s in range(world)]
        recv = grad.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_sizes,
            input_split_sizes=[mine * d for d in self.dims],
            group=self.pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            if get_gradient_division():  # as TorchRec's own backward all-to-all does
                recv.div_(world)
            for s, part in enumerate(recv.split(recv_sizes)):
                out[plan.rows(s, k)] = part.view(plan.sizes[s][k], self.local_dim)
            return out

        return Pending(work, finish)
