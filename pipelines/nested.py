"""The nested pipeline: inter-batch dual buffer + intra-batch frozen window, staleness-free.

One `progress()` call trains batch i. What runs, in order (the stages of the design):

1. data prefetch of batch i+1, with key-centric sample clustering (`clustering.py`);
2. host-to-device copy of batch i+1;
3. key routing of batch i+1: TorchRec's own input all-to-all, started now, waited for
   only when batch i's micro-batches are done; with `dedup` (and its gradients), only
   each micro-batch's distinct ids are routed (`dedup.py`);
4. embedding retrieval of batch i+1 (the local TBE lookup) into the prefetch buffer: with
   `lookahead`, before batch i's update, while batch i's last gradient chunks are still on
   the wire (on GPUs on a side stream), and after the update
   the bags of batch i+1 that hold a row batch i touched are looked up again (the dual
   buffer refresh), so nothing is stale; without it, right after batch i's update. Its
   embedding chunks go on the wire at once (under batch i's all-reduce and step);
5. batch i in N micro-batches under a frozen window: the pooled-embedding all-to-all of
   every chunk is in flight while earlier micro-batches' dense forward and backward run,
   and each micro-batch's gradient all-to-all runs under the next micro-batch's dense
   work. The embedding update happens once, on the whole batch's gradient, through the
   TBE's own fused backward: the result equals the plain loop for any optimizer. With
   `dedup` the chunks carry each micro-batch's distinct rows, pooled by the requester in
   each bag's order (as the TBE pools), and each row's gradient summed over its bags
   (equal within rounding: sums reorder), or with `dedup_grads=False` the pooled
   gradients as without dedup (bit for bit).

The arithmetic is the plain loop's, in its order, bit for bit (`dense_step.py`, and
docs/pipelines.md "Bit for bit"): micro-batch boundaries on whole vector units, each
logit's gradient as the plain loop's backward computes it, dense parameters' gradients
once over the whole batch in data order, the embedding lookups and their update once per
batch in data order (clustering only chooses which samples each micro-batch takes). Dense
gradients are averaged over ranks in the buckets the model's own backward uses
(`dense_reduce.py`), once per batch, in flight while the embedding update runs.

Files, one stage each: `lookups.py` (stages 1-4 and the update), `exchange.py` and
`dedup.py` (the chunked all-to-all of stage 5), `dense_step.py` (a micro-batch's dense
forward and backward, and the dense reduction); this file is the schedule.

The model contract is TorchRec's `DLRMTrain`: a `model(dense, sparse) -> logits` and a
`loss_fn(logits, labels)`, a mean over the rank's samples (`BCEWithLogitsLoss`), or a scaled
sum declared with `loss_reduction = "sum"`; sparse features used only through the sharded
modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipeline
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.dense_reduce import BucketedReduce
from pipelines.dense_step import DeferredGrads, batch_loss_fn, loss_seed
from pipelines.exchange import Pending
from pipelines.lookups import Lookups, Step

# what a step waits for: the next batch's ids, an embedding chunk, the last gradient
# chunks, the dense all-reduce
WAITS = ("ids", "chunks", "gradients", "dense_allreduce")


class NestedPipeline(TrainPipeline[Any, Any]):
    """The nested pipeline, a drop-in for TorchRec's `TrainPipelineSparseDist`:

        pipeline = NestedPipeline(dmp_model, optimizer, device, micro_batches=4)
        for _ in range(steps):
            pipeline.progress(batches)

    Inter-batch, the next batch's ids are routed and its first lookups started while the
    current batch trains; intra-batch, the batch runs as `micro_batches` chunks whose
    embedding all-to-all overlaps the dense work, the tables frozen within the batch. The
    losses equal the plain loop's, bit for bit (docs/pipelines.md).

    What it needs and does, beyond TorchRec's pipeline:
    - a model shaped like TorchRec's `DLRMTrain` (a forward of a `Batch` giving the loss
      and its outputs, the sparse part's embedding collections under DistributedModelParallel),
      with a loss that is a mean over samples; another is refused, naming why;
    - the dense gradients are averaged over ranks by its own fixed buckets
      (`pipelines.dense_reduce.BucketedReduce`), once a batch: DMP's DDP wrapper stays in
      place but its backward hooks are not used (pass `reduce=` to choose the buckets);
    - `cluster=True` groups samples by key within a batch to cut the exchange, `dedup=True`
      sends each distinct row once (and its gradient: equal within rounding; with
      `dedup_grads=False` forward only, bit for bit), `lookahead=True` looks the next
      batch's rows up early and again where the update changed them.
    `stats` counts what it did and where a step waited.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        micro_batches: int = 4,
        cluster: bool = False,
        lookahead: bool = False,
        dedup: bool = False,
        reduce: BucketedReduce | None = None,
        dedup_grads: bool = True,
    ) -> None:
        super().__init__()
        if micro_batches < 1:
            raise ValueError(f"pipeline.micro_batches must be >= 1, got {micro_batches}")
        self._dmp = model
        self._model = getattr(model, "module", model)  # DMP: the module without DDP
        self._optimizer = optimizer
        self._device = device
        self._n = micro_batches
        self._lookahead = lookahead
        self._world = dist.get_world_size()
        # lookahead: bags looked up again / seen; dedup: rows sent / the pooled vectors
        # they replace (as owner); where the step waited on the network, summed over steps
        self.stats = {
            "refreshed_bags": 0,
            "bags": 0,
            "dedup_rows": 0,
            "dedup_bags": 0,
            "steps": 0,
            "wait_ms": dict.fromkeys(WAITS, 0.0),
        }
        self._lookups = Lookups(
            self._model, device, micro_batches, cluster, dedup, self.stats, dedup_grads
        )
        # the dense layers: their gradients once per batch, averaged over ranks here as the
        # model's backward does (with the data-parallel tables' when the model's reduction
        # holds them; under TorchRec's DDP buckets, inside their lookups' own DDP)
        tables = {id(p) for m in self._lookups.modules for p in m.module.parameters()}
        dense = {
            n: p
            for n, p in in_backward_optimizer_filter(self._model.named_parameters())
            if id(p) not in tables
        }
        self._dense = list(dense.values())
        self._deferred = DeferredGrads(dense)
        # the model's own reduction (its backward hooks unused: the dense gradients are
        # made by `DeferredGrads`), or under TorchRec's DDP buckets of our own
        if reduce is None and self._world > 1 and self._dense:
            reduce = BucketedReduce(self._dense)
        elif reduce is not None:
            reduce.detach()
        self._reduce = reduce
        self._loss_fn = batch_loss_fn(self._model)
        self._next: Step | None = None
        self._placeholders: dict[tuple, KeyedJaggedTensor] = {}
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._model.training:
            with torch.no_grad():
                return self._dmp(next(dataloader_iter).to(self._device))[1]
        if self._next is None:  # the first batch: nothing was prefetched
            self._next = self._lookups.start(next(dataloader_iter))
            self._lookups.look_up(self._next, exchanged=True)
        cur = self._next
        try:
            self._next = self._lookups.start(next(dataloader_iter))
        except StopIteration:
            self._next = None
        self._optimizer.zero_grad()
        self._lookups.look_up(cur, exchanged=False)  # data-parallel tables: local, no prefetch
        output, backs = self._micro_batches(cur)
        # under the last gradient chunks still on the wire: the data-parallel tables'
        # gradients (their all-reduce starts), the dense reduction's start, and with the
        # lookahead batch i+1's lookups (stage 4: before i's update, refreshed after it)
        self._lookups.backward(cur, exchanged=False)
        reduce = None if self._reduce is None else self._reduce.start()
        nxt = self._next
        if nxt is not None and self._lookahead:
            with self._side():
                self._lookups.look_up(nxt, exchanged=True)
        with self._waiting("gradients"):
            for pending in backs:
                pending.wait()
        self._lookups.backward(cur, exchanged=True)  # the fused update, once per batch
        if nxt is not None:
            if self._lookahead:
                self._join_side()
                self._lookups.refresh(nxt, cur)  # after both: whatever the lookup read is fixed
            else:
                self._lookups.look_up(nxt, exchanged=True)
            # batch i+1's chunks start now: the first is on the wire under this step's
            # all-reduce, the optimizer step and the next batch's fetch (its values are final)
            self._send_chunks(nxt)
        if reduce is not None:
            with self._waiting("dense_allreduce"):
                reduce()
        self._optimizer.step()
        self.stats["steps"] += 1
        return output

    @contextmanager
    def _waiting(self, what: str):
        start = time.perf_counter()
        yield
        self.stats["wait_ms"][what] += 1000 * (time.perf_counter() - start)

    def _side(self):
        """Where the lookahead lookup runs: a side CUDA stream on GPUs (it overlaps the
        update of batch i; the refresh afterwards makes any row it raced with exact),
        the calling thread on CPU."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _join_side(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
            for ms in self._next.modules:  # made on the side stream, used on the main one
                for t in ms.looked_up:
                    if t is not None:
                        t.record_stream(torch.cuda.current_stream())

    def _send_chunks(self, step: Step) -> None:
        """Launch every chunk's embedding exchange of `step`, in order (micro-batch k waits
        for its own): as soon as its lookups are final."""
        if step.sends is not None:
            return
        plans = self._lookups.plans(step)
        step.sends = []  # [module][chunk][group]
        for m, ms, plan in zip(self._lookups.modules, step.modules, plans, strict=True):
            values = [None if t is None else t.detach() for t in ms.looked_up]  # DP: later
            step.sends.append(
                [
                    [
                        g.send(v, plan, state, k) if g.exchange else None
                        for g, v, state in zip(m.groups, values, ms.states, strict=True)
                    ]
                    for k in range(self._n)
                ]
            )

    def _micro_batches(self, step: Step):
        """Batch `step` in micro-batches: its (loss, logits, labels), and the gradient
        exchanges still in flight (waiting for them fills `step.grads`)."""
        batch = step.batch
        size = batch.dense_features.shape[0]
        plans = self._lookups.plans(step)
        rank = dist.get_rank()
        self._send_chunks(step)  # the first batch's; later ones left in the previous step
        sends = step.sends
        grads = [[torch.zeros_like(t) for t in ms.looked_up] for ms in step.modules]
        backs: list[Pending] = []
        logits = []
        deferred = self._deferred
        for k, b in enumerate(plans[0].sizes[rank]):
            if b == 0:  # none of my samples, but other ranks' chunk k still moves
                self._empty_micro_batch(step, k, plans, sends, grads, backs)
            else:
                logits.append(self._micro_batch(step, k, b, plans, sends, grads, backs))
            # every rank, whatever its share: the collectives run in one order on all ranks
            if k == 0 and self._next is not None:
                self._lookups.send_ids(self._next)
        inverse = None
        if step.order is not None:  # back to the data's sample order
            inverse = torch.empty_like(step.order)
            inverse[step.order] = torch.arange(len(step.order), device=step.order.device)
        deferred.accumulate(inverse, size)  # under the last gradient exchanges
        step.grads = grads
        logit = torch.cat(logits)
        if inverse is not None:
            logit = logit[inverse]
        with torch.no_grad():  # the plain loop's loss: once, over the batch in data order
            loss = self._loss_fn(logit, batch.labels.float())
        return (loss, logit, batch.labels), backs

    def _placeholder(self, kjt: KeyedJaggedTensor, batch: int) -> KeyedJaggedTensor:
        """`_placeholder(kjt, batch)`, made once for each shape (never read: the same one
        serves every micro-batch of its size)."""
        values = kjt.values()
        key = (tuple(kjt.keys()), batch, values.dtype, kjt.lengths().dtype, values.device)
        if key not in self._placeholders:
            self._placeholders[key] = _placeholder(kjt, batch)
        return self._placeholders[key]

    def _micro_batch(
        self, step: Step, k: int, b: int, plans, sends, grads, backs: list[Pending]
    ) -> torch.Tensor:
        """Micro-batch k (`b` of my samples): its dense forward and backward on the chunk's
        embeddings, its gradients sent back under the next one's work; its logits."""
        batch, rank, deferred = step.batch, dist.get_rank(), self._deferred
        mine = plans[0].samples(rank, k)  # this micro-batch's samples of my batch
        leaves = []
        for mi, (m, ms) in enumerate(zip(self._lookups.modules, step.modules, strict=True)):
            parts = []
            for g, group in enumerate(m.groups):
                if group.exchange is None:
                    parts.append(ms.looked_up[g].detach()[mine])
                else:
                    with self._waiting("chunks"):
                        parts.append(sends[mi][k][g].wait())
            leaf = [p.requires_grad_() for p in parts]
            leaves.append(leaf)
            m.module.forward = _returns(m.output(leaf, ms.states, k))
        # requires grad so that every layer's output gradient is computed
        dense = batch.dense_features[mine].requires_grad_()
        sparse = self._placeholder(batch.sparse_features, b)
        label = batch.labels[mine].float()
        try:
            deferred.start_micro_batch()
            with deferred:  # the forward only: what it records, the backward completes
                logit = self._model.model(dense, sparse).squeeze(-1)
            logit.backward(loss_seed(self._model, logit, label, batch.dense_features.shape[0]))
        finally:
            for m in self._lookups.modules:
                del m.module.forward
        for mi, (m, leaf) in enumerate(zip(self._lookups.modules, leaves, strict=True)):
            for g, group in enumerate(m.groups):
                if group.exchange is None:
                    grads[mi][g][mine] = leaf[g].grad
                else:  # in flight under the next micro-batch's dense work
                    state = step.modules[mi].states[g]
                    backs.append(group.send_back(leaf[g].grad, plans[mi], state, k, grads[mi][g]))
        return logit.detach()

    def _empty_micro_batch(
        self, step: Step, k: int, plans, sends, grads, backs: list[Pending]
    ) -> None:
        """Keep every rank's collectives in step when this rank's micro-batch k is empty (a
        batch smaller than N): receive its (empty) chunk, send back an empty gradient."""
        for mi, (m, plan) in enumerate(zip(self._lookups.modules, plans, strict=True)):
            for g, group in enumerate(m.groups):
                if group.exchange is not None:
                    sends[mi][k][g].wait()
                    empty = grads[mi][g].new_zeros(0, group.exchange.width)
                    state = step.modules[mi].states[g]
                    backs.append(group.send_back(empty, plan, state, k, grads[mi][g]))


def _returns(value):
    def forward(*_args, **_kwargs):
        return value

    return forward


def _placeholder(kjt: KeyedJaggedTensor, batch: int) -> KeyedJaggedTensor:
    """An empty KJT of `batch` samples: the micro-batch's sparse input is never read, the
    sharded modules return the exchanged embeddings instead."""
    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values()[:0],
        lengths=kjt.lengths().new_zeros(len(keys) * batch),
        stride=batch,
    )
