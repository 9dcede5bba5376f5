"""Synchronous 2D sparse parallelism: the tables sharded over a group of G ranks, the group
replicated W / G times, every replica applying the same update every step.

Ranks `g*G .. g*G + G-1` form sharding group g; each trains the group's plan (a TorchRec
plan for G ranks) on its own samples, its embedding all-to-alls within the group. The ranks
holding the same shards (the same place `p` in every group: `p, p+G, p+2G, ...`) form a
replica group. TorchRec 1.9's `DMPCollection` keeps replicas close by averaging their
weights and optimizer state every few steps, which for Adagrad is not the plain loop's
update. Here the replicas agree before the update, so the step is the plain loop's up to
the order of each row gradient's sum (see the end):

- each exchanged lookup's output is cut from the TBE's graph (`install_replica_sync`); when
  backward reaches it, the gradient of each row the group's samples touched is summed from
  the gradients of the bags (or ids) holding it; the replica group all-gathers which rows
  each replica touched and all-reduces the rows' gradients over their union;
- the fused update then runs through the lookup's own kernel on one single-id bag per row
  with that row's summed gradient: a bag of one id passes its gradient to the row
  unchanged, so FBGEMM's optimizer (row-wise Adagrad, SGD) sees exactly the summed gradient,
  the same on every replica;
- data-parallel tables and the dense parameters are averaged over all W ranks, in
  `dense_reduce.SharedReduction`'s buckets on the world's group (under `ddp_buckets`,
  TorchRec's `ShardingEnv2D` hands their DDP the world's group).

The result equals the plain loop's on W ranks up to the order of each row gradient's sum
(replica partial sums, then across replicas): the order noise `benchmarks.order_noise`
measures; the replicas stay equal to each other bit for bit. The cross-replica traffic is
the touched rows' gradients, what `sharding.two_d` prices.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv2D, ShardingPlan
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def two_d_env(size: int, device: torch.device) -> ShardingEnv2D:
    """TorchRec's 2D environment as `DMPCollection` makes it with
    `use_inter_host_allreduce=True`: groups of `size` consecutive ranks shard (a group of
    whole nodes exchanges within them), the ranks at one place in every group are replicas
    (`replica_pg`); made here because `DMPCollection` takes only CUDA devices. Every rank
    calls it (making groups is collective); `size` divides the world (checked before any
    rank starts, `sharding.two_d.group_inputs`)."""
    world = dist.get_world_size()
    mesh = DeviceMesh(
        device.type,
        [list(range(g, g + size)) for g in range(0, world, size)],
        mesh_dim_names=("replicate", "shard"),
    )
    return ShardingEnv2D(
        sharding_pg=mesh.get_group("shard"),
        replica_pg=mesh.get_group("replicate"),
        global_pg=dist.group.WORLD,
        device_mesh=mesh,
        use_inter_host_allreduce=True,
    )


def place_group_plan(plan: ShardingPlan, size: int) -> ShardingPlan:
    """One group's plan (ranks 0 .. G-1) with this rank's group's global ranks, as
    `DMPCollection._remap_sharding_plan` places it (a copy)."""
    plan = copy.deepcopy(plan)
    first = dist.get_rank() // size * size
    for params in plan.plan.values():
        for ps in params.values():
            ps.ranks = [r + first for r in ps.ranks]
            spec = ps.sharding_spec
            for shard in getattr(spec, "shards", None) or []:
                where = shard.placement
                shard.placement = _remote_device(f"rank:{where.rank() + first}/{where.device()}")
    return plan


@dataclass
class _Table:
    """One table (shard) of one TBE in a lookup: the features reading it, its columns and
    its pooling."""

    features: list[str]
    dim: int
    pooling: PoolingType | None  # None: a sequence lookup (a row per id)


class _LookupTables:
    """The tables of one sharded lookup, in the lookup's feature order."""

    def __init__(self, lookup: torch.nn.Module, sequence: bool) -> None:
        self.sequence = sequence
        self.keys: list[str] = []
        self.tables: list[_Table] = []
        self.weighted = False
        for emb in lookup._emb_modules:
            self.keys += emb.config.feature_names()
            for t in emb.config.embedding_tables:
                pooling = None if sequence else t.pooling
                self.tables.append(_Table(list(t.feature_names), t.local_cols, pooling))
                self.weighted |= bool(t.is_weighted)

    def per_id(self, kjt: KeyedJaggedTensor, grad: torch.Tensor) -> list[tuple]:
        """Per table, its ids in `kjt` and the gradient each id's row receives from `grad`
        (the lookup output's gradient)."""
        out = []
        col = 0  # pooled: each feature's columns; sequence: each id's row, in key order
        grad = grad.view(-1) if self.sequence else grad
        for t in self.tables:
            ids, grads = [], []
            for f in t.features:
                jt = kjt[f]
                values, lengths = jt.values(), jt.lengths()
                if self.sequence:
                    n = values.numel() * t.dim
                    g = grad[col : col + n].view(-1, t.dim)
                    col += n
                else:
                    bags = torch.arange(lengths.numel(), device=lengths.device)
                    bag = torch.repeat_interleave(bags, lengths)
                    g = grad[bag, col : col + t.dim]
                    col += t.dim
                    if t.pooling == PoolingType.MEAN:
                        g = g / lengths[bag].clamp(min=1).unsqueeze(1).to(g.dtype)
                    if jt.weights_or_none() is not None:
                        g = g * jt.weights().unsqueeze(1).to(g.dtype)
                ids.append(values)
                grads.append(g)
            out.append((torch.cat(ids), torch.cat(grads)))
        return out

    def single_id_bags(self, rows: list[torch.Tensor]) -> tuple[KeyedJaggedTensor, int]:
        """A batch that looks up each table's `rows` once, each in a bag of its own under
        the table's first feature (a sequence lookup: one bag of them), and its stride."""
        device = rows[0].device
        rows_of = {t.features[0]: r for t, r in zip(self.tables, rows, strict=True)}
        none = torch.zeros(0, dtype=torch.int64, device=device)
        stride = 1 if self.sequence else max([len(r) for r in rows] + [1])
        values, lengths = [], []
        for k in self.keys:
            r = rows_of.get(k, none)
            values.append(r)
            if self.sequence:
                lengths.append(torch.tensor([len(r)], dtype=torch.int32, device=device))
            else:
                bag = torch.zeros(stride, dtype=torch.int32, device=device)
                bag[: len(r)] = 1
                lengths.append(bag)
        values = torch.cat(values)
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=values,
            lengths=torch.cat(lengths),
            weights=torch.ones(values.numel(), device=device) if self.weighted else None,
            stride=stride,
        )
        return kjt, stride

    def scatter(
        self, rows: list[torch.Tensor], grads: list[torch.Tensor], stride: int, like: torch.Tensor
    ) -> torch.Tensor:
        """The output gradient of `single_id_bags(rows)` that gives each row its gradient."""
        if self.sequence:  # the output: each key's ids' rows, in key order
            return torch.cat([g.reshape(-1) for g in grads]).to(like.dtype)
        out = like.new_zeros(stride, sum(len(t.features) * t.dim for t in self.tables))
        col = 0
        for t, r, g in zip(self.tables, rows, grads, strict=True):
            out[: len(r), col : col + t.dim] = g
            col += len(t.features) * t.dim
        return out


def _feature_columns_in_key_order(tables: _LookupTables) -> bool:
    """`per_id` and `scatter` walk the columns table by table; TorchRec's TBE orders its
    output by feature, which is the same when each table's features are consecutive keys."""
    order = [f for t in tables.tables for f in t.features]
    return order == tables.keys


def replica_row_grads(
    ids: list[torch.Tensor], grads: list[torch.Tensor], dims: list[int], replicas: dist.ProcessGroup
) -> tuple[list, list]:
    """Per table, the union of the rows any replica's ids touch (sorted) and each row's
    gradient summed over every replica's ids: two all-gathers (how many rows, which) and
    one all-reduce of the rows' gradients."""
    device = ids[0].device
    mine = [torch.unique(i, return_inverse=True) for i in ids]
    summed = [
        torch.zeros(len(u), d, device=device).index_add_(0, inv, g.float())
        for (u, inv), g, d in zip(mine, grads, dims, strict=True)
    ]
    n = dist.get_world_size(replicas)
    counts = torch.tensor([len(u) for u, _ in mine], dtype=torch.int64, device=device)
    every = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(every, counts, group=replicas)
    longest = torch.stack(every).sum(dim=1).max()
    flat = torch.full((int(longest),), -1, dtype=torch.int64, device=device)  # padded alike
    flat[: int(counts.sum())] = torch.cat([u for u, _ in mine])
    gathered = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat, group=replicas)
    unions = [[] for _ in ids]
    for c, g in zip(every, gathered, strict=True):
        for t, part in enumerate(g[: int(c.sum())].split(c.tolist())):
            unions[t].append(part)
    unions = [torch.unique(torch.cat(u)) for u in unions]
    buffers = []
    for (u, _), s, union, d in zip(mine, summed, unions, dims, strict=True):
        b = torch.zeros(len(union), d, device=device)
        b[torch.searchsorted(union, u)] = s
        buffers.append(b)
    flat_grads = torch.cat([b.reshape(-1) for b in buffers])
    dist.all_reduce(flat_grads, group=replicas)
    sizes = [b.numel() for b in buffers]
    out = [f.view(-1, d) for f, d in zip(flat_grads.split(sizes), dims, strict=True)]
    return unions, out


class _ReplicaSync(torch.autograd.Function):
    """Identity on the lookup's output, detached from the TBE's graph; its backward sums
    the row gradients over the replicas and applies the fused update with them."""

    @staticmethod
    def forward(ctx, output, lookup, tables, kjt, replicas):  # noqa: ANN001, ANN205
        ctx.lookup, ctx.tables, ctx.kjt, ctx.replicas = lookup, tables, kjt, replicas
        return output.detach().clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        tables: _LookupTables = ctx.tables
        if get_gradient_division():  # TorchRec's all-to-all divided it by G; the loop's by W
            grad = grad / dist.get_world_size(ctx.replicas)
        pairs = tables.per_id(ctx.kjt, grad)
        rows, row_grads = replica_row_grads(
            [i for i, _ in pairs],
            [g for _, g in pairs],
            [t.dim for t in tables.tables],
            ctx.replicas,
        )
        kjt, stride = tables.single_id_bags(rows)
        with torch.enable_grad():
            out = ctx.lookup.forward(kjt)  # the lookup's own kernels, no hook
            torch.autograd.backward(out, tables.scatter(rows, row_grads, stride, out))
        return None, None, None, None, None


def install_replica_sync(model: torch.nn.Module, env: ShardingEnv2D) -> None:
    """Hook every exchanged lookup of the model's sharded embedding modules (see the module
    docstring)."""
    for fqn, module in model.named_modules():
        sequence = isinstance(module, ShardedEmbeddingCollection)
        if not (sequence or isinstance(module, ShardedEmbeddingBagCollection)):
            continue
        shardings = (
            module._sharding_type_to_sharding.values() if sequence else module._embedding_shardings
        )
        for i, (sharding, lookup) in enumerate(zip(shardings, module._lookups, strict=True)):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                continue  # TorchRec's DDP on the 2D env's global group: every rank averages
            if not lookup._emb_modules:
                continue
            tables = _LookupTables(lookup, sequence)
            if not _feature_columns_in_key_order(tables):
                raise ValueError(
                    f"2D groups: {fqn}'s lookup {i} reads a table through features that are "
                    f"not consecutive ({tables.keys}); the replica sync cannot place their "
                    f"gradients. Give each table one feature, or train without "
                    f"trainer.sharding_group_size"
                )
            lookup.register_forward_hook(_sync_hook(tables, env.replica_pg))


def _sync_hook(tables: _LookupTables, replicas: dist.ProcessGroup):
    def hook(lookup, args, output):  # noqa: ANN001, ANN202
        if not torch.is_grad_enabled() or not output.requires_grad:
            return output  # an eval forward, or a refresh: no update follows
        return _ReplicaSync.apply(output, lookup, tables, args[0], replicas)

    return hook
