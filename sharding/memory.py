"""One memory accounting for every plan, whoever made it (hybrid, TorchRec, the baselines).

Per rank, in device memory (a CPU rank's memory):
- tables: weights and optimizer state of its shards in fast memory, and the HBM caches of
  its cached shards (the rest of those sits in host memory; `cost_model.memory_bytes`);
- shard buffers: for every sample a shard serves, its ids in (8 bytes a lookup it serves,
  4 a bag length) and its output out, with that output's gradient back (one vector a sample,
  or one a lookup for a cold part's sequence exchange): TorchRec's per-shard input and
  output sizes;
- dense: parameters, gradients, the dense optimizer's state and DDP's gradient buckets
  (`DENSE_BYTES_PER_PARAM` a parameter), on every rank;
- its batch: the inputs of the batches the schedule keeps in flight (ids, lengths, dense
  features, label), the pooled embeddings it receives for its samples and their gradients,
  and the dense part's activations saved for backward (`PlanInputs.activation_bytes_per_sample`,
  measured on the model: `recsys.models.cost_inputs`), all times its own batch share: a rank
  given a larger share of a skewed split needs that much more.
A plan fits when every rank's device and host bytes are within `hbm_budget` and
`host_budget` (the device's memory less the reserve kept for the allocator); every planner
is told the same room (`table_room`: what the tables may fill at a batch split).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sharding.types import (
    FLOAT_BYTES,
    ID_BYTES,
    LENGTH_BYTES,
    PlanInputs,
    Schedule,
    Shard,
    TableStats,
)

# fp32 weights, their gradients, Adagrad's state (the trainer's dense optimizer) and
# DDP's gradient buckets (a copy of the gradients)
DENSE_BYTES_PER_PARAM = 4 * FLOAT_BYTES
# batches whose inputs a schedule holds at once: the one training, and under TorchRec's
# SparseDist (and the nested pipeline's dual buffer) the next one being routed and the one
# after it being copied to the device
BATCHES_IN_FLIGHT = {Schedule.plain: 1, Schedule.sparse_dist: 3, Schedule.nested: 3}


def input_bytes_per_sample(inputs: PlanInputs) -> float:
    """One sample's input: ids and bag lengths of every table, dense features and label."""
    sparse = sum(t.lookups_per_sample * ID_BYTES + LENGTH_BYTES for t in inputs.tables)
    return sparse + (inputs.dense_features + 1) * FLOAT_BYTES


def batch_bytes_per_sample(inputs: PlanInputs) -> float:
    """Device bytes a rank needs per sample of its batch (module docstring: its batch)."""
    pooled = sum(t.dim for t in inputs.tables) * FLOAT_BYTES * 2  # outputs and gradients
    in_flight = BATCHES_IN_FLIGHT[inputs.schedule] * input_bytes_per_sample(inputs)
    return in_flight + pooled + inputs.activation_bytes_per_sample


def dense_bytes(inputs: PlanInputs) -> float:
    return inputs.dense_params * DENSE_BYTES_PER_PARAM


def shard_buffer_bytes(s: Shard, t: TableStats, total: float) -> float:
    """A shard's input and output buffers for `total` samples (none for a data-parallel
    copy: its outputs are the rank's own, counted with its batch)."""
    if s.dp:
        return 0.0
    share = s.rows / t.rows if s.lookup_share is None else s.lookup_share
    vectors = t.lookups_per_sample * share if s.sparse_exchange else 1.0
    ids = t.lookups_per_sample * share * ID_BYTES + LENGTH_BYTES
    return total * (ids + 2 * vectors * s.cols * FLOAT_BYTES)


def piece_buffer_bytes(
    t: TableStats, cols: int, lookup_share: float, sparse: bool, total: float
) -> float:
    """`shard_buffer_bytes` of a piece not yet placed."""
    return shard_buffer_bytes(
        Shard(t.name, 0, 1, cols, lookup_share=lookup_share, sparse_exchange=sparse), t, total
    )


def table_room(inputs: PlanInputs, batch: Sequence[float]) -> np.ndarray:
    """Per rank, the device bytes its tables and their shard buffers may fill at this
    batch split: the budget less the dense part and the batch's own needs."""
    b = np.asarray(batch, dtype=np.float64)
    fixed = dense_bytes(inputs) + b * batch_bytes_per_sample(inputs)
    return np.asarray(inputs.hbm_budget(), dtype=np.float64) - fixed


def rank_memory(
    inputs: PlanInputs, shards: Sequence[Shard], batch: Sequence[float]
) -> list[dict[str, float]]:
    """Per rank: `hbm` and `host` bytes in all, and the device bytes by part (`tables`,
    `buffers`, `dense`, `batch`)."""
    from sharding.cost_model import memory_bytes

    tables = memory_bytes(shards, inputs.world, inputs.optimizer, inputs.weight_bytes)
    by_name = {t.name: t for t in inputs.tables}
    total = float(sum(batch))
    buffers = np.zeros(inputs.world)
    for s in shards:
        if not s.dp:
            buffers[s.rank] += shard_buffer_bytes(s, by_name[s.table], total)
    per_sample = batch_bytes_per_sample(inputs)
    out = []
    for r in range(inputs.world):
        parts = {
            "tables": float(tables[r]["hbm"]),
            "buffers": float(buffers[r]),
            "dense": dense_bytes(inputs),
            "batch": float(batch[r]) * per_sample,
        }
        out.append({"hbm": sum(parts.values()), "host": float(tables[r]["host"]), **parts})
    return out
