"""The dense gradients' average over ranks: one bucket layout that every pipeline shares.

DDP packs gradients into buckets of its own choosing (its size cap, and after the first
step the order gradients became ready in), and a collective's order of the sum depends
on the tensor's size and each element's place in it (gloo's ring: which rank starts each
piece). So a pipeline that reduces the same gradients packed another way rounds
differently from three ranks on. `BucketedReduce` fixes the layout once: the dense
parameters in reverse registration order (about the order backward makes their
gradients), cut into buckets of at most `cap_bytes`, the first at most `first_bytes` (so
the first collective starts early in the backward). Each bucket is averaged by one
asynchronous all-reduce (divided by the world size, then summed, as DDP's default hook).

- In a backward (the plain loop, TorchRec's pipelines) each bucket starts as soon as its
  last gradient is accumulated and every earlier bucket has started (all ranks start them
  in one order), under the rest of the backward; autograd's final callback waits for them
  and leaves each parameter its averaged gradient, before the optimizer step, as DDP does.
- The nested pipeline, whose dense gradients exist only after the micro-batches
  (`dense_step.DeferredGrads`), starts the same buckets with `start()` and waits with what
  it returns: the same collectives on the same tensors, so the same sums at any world size.

Hierarchical (`nodes`): each bucket is summed within each node onto the node's first rank,
all-reduced among those first ranks across nodes, and sent back within the node: one
crossing of the slow link per node instead of a ring through every rank.

`SharedReduction` puts it in TorchRec's DistributedModelParallel in DDP's place (its
`data_parallel_wrapper`): the parameters DDP would take, the unsharded ones, and the
data-parallel tables' (replicated hot rows too). TorchRec would wrap those tables' lookups
in a DDP of their own inside the sharded module (`take_tables` opts out before sharding,
with TorchRec's `mark_data_parallel_skip_grad_sync`): its backward then returns only once
their all-reduce is done, which in the nested pipeline held the step on it before the
dense reduction even started. In the shared buckets they are reduced with the dense
gradients, one layout for every pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    mark_data_parallel_skip_grad_sync,
)
from torchrec.optim.optimizers import in_backward_optimizer_filter

MIB = 1 << 20


@dataclass
class NodeGroups:
    """My node's ranks as a group, my node's first rank, and (on first ranks only) the
    group of every node's first rank."""

    intra: dist.ProcessGroup
    leader: int
    leaders: dist.ProcessGroup | None


def node_groups(nodes: list[int]) -> NodeGroups:
    """`nodes[r]`: rank r's node. Every rank calls it (making a group is collective)."""
    rank = dist.get_rank()
    members = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    intra = leader = None
    for ranks in members:
        group = dist.new_group(ranks)
        if rank in ranks:
            intra, leader = group, ranks[0]
    firsts = [ranks[0] for ranks in members]
    leaders = dist.new_group(firsts)
    return NodeGroups(intra, leader, leaders if rank in firsts else None)


class BucketedReduce:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: dist.ProcessGroup | None = None,
        cap_bytes: int = 25 * MIB,
        first_bytes: int = MIB,
        nodes: NodeGroups | None = None,
    ) -> None:
        """`params` in registration order; `cap_bytes=0`: one bucket per tensor; `nodes`:
        reduce within each node, then across nodes (None: one all-reduce over `group`)."""
        self.group = group
        self.nodes = nodes
        self.world = dist.get_world_size(group)
        self.params = list(reversed(params))
        self.buckets: list[list[int]] = []  # indices into self.params
        size, dtype = 0, None
        for i, p in enumerate(self.params):
            cap = first_bytes if len(self.buckets) <= 1 else cap_bytes
            nbytes = p.numel() * p.element_size()
            if not self.buckets or p.dtype != dtype or size + nbytes > cap:
                self.buckets.append([])
                size, dtype = 0, p.dtype
            self.buckets[-1].append(i)
            size += nbytes
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        # each bucket's buffer, kept (no allocation per step) and each parameter's place in it
        self._flat = [
            self.params[b[0]].new_zeros(sum(self.params[i].numel() for i in b))
            for b in self.buckets
        ]
        self._slot: dict[int, torch.Tensor] = {}
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for i in bucket:
                n = self.params[i].numel()
                self._slot[i] = self._flat[b][offset : offset + n]
                offset += n
        self._hooks: list = []
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._filled: set[int] = set()
        self._launched: list = []  # the works, in bucket order
        self._queued = False

    # a backward: hooks on every parameter
    def attach(self) -> None:
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._ready_hook(i)))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _ready_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            if not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(self._finish_backward)
            self._fill(i)
            self._missing[self._bucket_of[i]] -= 1
            self._launch_ready()

        return ready

    def _launch_ready(self) -> None:
        while len(self._launched) < len(self.buckets) and self._missing[len(self._launched)] == 0:
            self._launch(len(self._launched))

    def _fill(self, i: int) -> None:
        """Parameter i's gradient, divided by the world size, into its bucket (one pass,
        as DDP's reducer copies and scales); zeros if it has none."""
        grad, slot = self.params[i].grad, self._slot[i]
        if grad is None:
            slot.zero_()
        else:
            torch.div(grad.reshape(-1), self.world, out=slot)
        self._filled.add(i)

    def _launch(self, b: int) -> None:
        for i in self.buckets[b]:
            if i not in self._filled:  # missed by the backward, or `start`
                self._fill(i)
        flat = self._flat[b]
        if self.nodes is None:
            self._launched.append(dist.all_reduce(flat, group=self.group, async_op=True))
        else:  # summed onto the node's first rank; across nodes when it is waited for
            self._launched.append(
                dist.reduce(flat, dst=self.nodes.leader, group=self.nodes.intra, async_op=True)
            )

    def _finish_backward(self) -> None:
        while len(self._launched) < len(self.buckets):  # a parameter the backward missed
            self._launch(len(self._launched))
        self._wait()

    def _wait(self) -> None:
        for b, work in enumerate(self._launched):
            work.wait()
            if self.nodes is not None:
                if self.nodes.leaders is not None:
                    dist.all_reduce(self._flat[b], group=self.nodes.leaders)
                dist.broadcast(self._flat[b], src=self.nodes.leader, group=self.nodes.intra)
            for i in self.buckets[b]:
                self.params[i].grad = self._slot[i].view_as(self.params[i])
        self._reset()

    # the nested pipeline: every bucket at once
    def start(self) -> Callable[[], None]:
        """Start every bucket's all-reduce of the parameters' gradients now (zeros for a
        parameter without one); the returned function waits and sets the averages."""
        self._reset()
        for b in range(len(self.buckets)):
            self._launch(b)
        return self._wait


class SharedReduction(DataParallelWrapper):
    """DistributedModelParallel's data-parallel wrapper: a `BucketedReduce` over the
    parameters DDP would take, hooked into every backward; `reduce` is it (None on one
    rank)."""

    def __init__(
        self, cap_bytes: int = 25 * MIB, first_bytes: int = MIB, nodes: list[int] | None = None
    ) -> None:
        """`nodes[r]`: rank r's node, for the hierarchical reduction (None: flat)."""
        self._cap, self._first, self._nodes = cap_bytes, first_bytes, nodes
        self.reduce: BucketedReduce | None = None

    @staticmethod
    def take_tables(model: torch.nn.Module) -> None:
        """Before sharding: the embedding collections' data-parallel tables left out of
        TorchRec's DDP, for `wrap` to reduce in the shared buckets."""
        for m in model.modules():
            if isinstance(m, EmbeddingBagCollection | EmbeddingCollection):
                mark_data_parallel_skip_grad_sync(m)

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        # every rank holds the dense parameters and the data-parallel tables: averaged over
        # the world, also when the tables are sharded within 2D groups (`env` then is the
        # group's: pipelines/two_d.py)
        if env.process_group is None or dist.get_world_size() == 1:
            return
        module = dmp._dmp_wrapped_module
        sharded = set(DistributedModelParallel._sharded_parameter_names(module))
        ours = set(replicated_tables(module, taken_only=True))
        ours |= {n for n, _ in module.named_parameters() if n not in sharded}
        params = [p for n, p in module.named_parameters() if n in ours and p.requires_grad]
        nodes = None
        if self._nodes is not None and len(set(self._nodes)) > 1:
            nodes = node_groups(self._nodes)
        if params:
            self.reduce = BucketedReduce(params, dist.group.WORLD, self._cap, self._first, nodes)
            self.reduce.attach()


def replicated_tables(module: torch.nn.Module, taken_only: bool = False) -> dict[str, Variable]:
    """The data-parallel tables' parameters by name: those of the sharded embedding
    collections not updated in the backward by a fused kernel (TorchRec shards a
    data-parallel table with a dense one). `taken_only`: of the collections that opted out
    of TorchRec's DDP (`SharedReduction.take_tables`) only."""
    out = {}
    for prefix, m in module.named_modules():
        if not isinstance(m, ShardedEmbeddingBagCollection | ShardedEmbeddingCollection):
            continue
        if taken_only and not getattr(m, "_skip_data_parallel_grad_sync", False):
            continue
        dot = f"{prefix}." if prefix else ""
        out.update({dot + n: p for n, p in in_backward_optimizer_filter(m.named_parameters())})
    return out
