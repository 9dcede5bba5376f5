"""`python -m benchmarks.gpu_probe --out DIR`: measure the device constants the cost model
assumes for a GPU, on the current CUDA device (or `--device cpu --quick` for a check).

The cost model prices every GPU from its datasheet and assumed efficiencies
(`sharding.cost_model`: embedding at 0.5 of HBM bandwidth, backward 2x forward, dense at
0.35 of the bf16 peak, sequence-exchange work from assumed passes over HBM). This probe
measures each on the device, every figure a median over repeats timed with CUDA events:

- tbe: FBGEMM's table-batched embedding, the kernel TorchRec trains with, forward and its
  backward with the row-wise Adagrad update fused in, where `fbgemm_gpu` imports; the
  embedding constants come from it then (`embedding_kernel` says which kernel they are of);
- embedding: `embedding_bag` (sum) forward, and its backward with a row-wise Adagrad
  update of the touched rows (the fused update TorchRec's kernels do), dims 64/128, pooling
  1/8/32, 1e6 and 4e7 rows (fewer where the free memory holds fewer), uniform and power-law
  ids: bytes moved per second;
- dense: DCNv2 at MLPerf's shapes and `dlrm_small`, forward + backward, fp32, tf32, bf16,
  batch 2048-65536: achieved TFLOP/s (matmul FLOPs) against the catalog's bf16 peak;
- copies host<->device from pinned and pageable memory, and a gather of random rows from
  pinned host memory sent to the device (what a host-memory shard costs per lookup);
- the cold-only (sequence) exchange's local work: single-id lookups, the pooling after
  them, and its backward: per lookup and per byte;
- links: all-to-all and all-reduce between the node's GPUs over NCCL, one process each, from
  1 MB to 64 MB a rank (latency and bytes/s fitted; none with one GPU).

A GPU the catalog lacks is named from its name and memory (`l40s_45g.json`) and described
by what was measured.

It writes `gpu_probe.json` (device, versions, every measurement with its shape; rewritten
after each section, `complete` once all have run) and
`<kind>.json`, the device constants in the CPU calibration's format (`sharding.calibration`);
copied to `sharding/calibration/gpu/<kind>.json` the planners and `sharding.predict` use
them for that device kind. Needs torch alone (TorchRec and Hydra are never imported, and
fbgemm-gpu only where it is installed: the GPU machines this runs on may have none of them);
hence plain argparse, not a Hydra app.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sharding.constants import (
    DEVICE_CATALOG,
    PRECISIONS,
    datasheet_rates,
    gpu_kind,
    precision_factor,
)

A100_BF16_FLOPS = 312e12  # the catalog's `speed` is relative to this
EMBEDDING_KERNELS = {
    True: "fbgemm TBE (what TorchRec trains with; row-wise Adagrad fused in the backward)",
    False: "torch embedding_bag + index_add (fbgemm_gpu does not import here; FBGEMM's TBE "
    "reads faster, so these rates are a lower bound)",
}
FLOAT_BYTES = 4
HOST_TO_DEVICE_GBPS = 12.0  # a cluster config's default (sharding.types.NodeGroup)


@dataclass(frozen=True)
class Sizes:
    """What each section measures; `quick` shrinks everything to a few seconds on a CPU."""

    dims: tuple[int, ...] = (64, 128)
    poolings: tuple[int, ...] = (1, 8, 32)
    rows: tuple[int, ...] = (1_000_000, 40_000_000)
    emb_batch: int = 16384
    dense_batches: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768, 65536)
    train_batch: int = 8192  # the dense constant is read at this batch (MLPerf: 65536 / 8)
    copy_mb: int = 256
    host_rows: int = 4_000_000
    seq_lookups: tuple[int, ...] = (65536, 262144)
    link_bytes: tuple[int, ...] = (1 << 20, 1 << 23, 1 << 26)  # per rank, each collective
    repeats: int = 10


QUICK = Sizes(
    dims=(16, 32),
    poolings=(1, 8),
    rows=(10_000,),
    emb_batch=512,
    dense_batches=(64,),
    train_batch=64,
    copy_mb=4,
    host_rows=20_000,
    seq_lookups=(2048, 8192),
    link_bytes=(1 << 12, 1 << 16),
    repeats=3,
)


class Timer:
    """Median milliseconds of `fn()` over repeats: CUDA events on a GPU, else wall time."""

    def __init__(self, device: torch.device, repeats: int, budget_s: float) -> None:
        self.device, self.repeats = device, repeats
        self.deadline = time.monotonic() + budget_s

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def median_ms(self, fn: Callable[[], object], warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def power_law_ids(n: int, rows: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Ids whose popularity falls as 1/rank (log-uniform ranks), hot rows scattered over the
    table by a multiplicative hash, as hashed Criteo ids are."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ranks = torch.exp(u * math.log(rows)).long().clamp_(1, rows) - 1
    return ((ranks * 2654435761) % rows).to(device)


def uniform_ids(n: int, rows: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(0, rows, (n,), generator=gen).to(device)


def free_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the GPU's (CUDA's count), or the host's available pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# a table and its momentum take at most this share of the free memory (the ids, the pooled
# output and the backward's gradient need the rest)
TABLE_SHARE = 0.4


def table_rows(rows: int, dim: int, free: int) -> int:
    """`rows`, or fewer where a table of them (and its momentum) would not fit `free` bytes:
    a 40M x 128 table is 20.5 GB, more than a 16 GB T4 or V100 has."""
    return min(rows, int(TABLE_SHARE * free) // ((dim + 1) * FLOAT_BYTES))


def _tables(sizes: Sizes, device: torch.device, timer: Timer) -> Iterator[tuple[int, int]]:
    """(rows, dim) of each table to time: as large as the free memory allows, up to
    `sizes.rows`, until the section's budget is spent (the caller frees each before the
    next)."""
    for asked in sizes.rows:
        for dim in sizes.dims:
            if timer.over_budget():
                return
            yield table_rows(asked, dim, free_bytes(device)), dim
            _empty_cache(device)


def _case(
    rows: int, dim: int, pooling: int, ids: str, batch: int, fwd_ms: float, bwd_ms: float
) -> dict:
    read = batch * pooling * dim * FLOAT_BYTES  # rows read by the forward
    return {
        "rows": rows,
        "dim": dim,
        "pooling": pooling,
        "ids": ids,
        "batch": batch,
        "forward_ms": fwd_ms,
        "backward_ms": bwd_ms,
        "bwd_over_fwd": bwd_ms / fwd_ms,
        "forward_bytes_per_s": read / (fwd_ms / 1e3),
    }


def embedding(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """Forward bytes/s (rows read), and backward + row-wise Adagrad over the forward."""
    out, gen = [], torch.Generator().manual_seed(0)
    for rows, dim in _tables(sizes, device, timer):
        weight = torch.empty(rows, dim, device=device).uniform_(-0.01, 0.01)
        momentum = torch.zeros(rows, device=device)
        for pooling in sizes.poolings:
            for dist, draw in (("uniform", uniform_ids), ("power_law", power_law_ids)):
                ids = draw(sizes.emb_batch * pooling, rows, gen, device)
                times = _embedding_case(weight, momentum, ids, pooling, timer)
                out.append(_case(rows, dim, pooling, dist, sizes.emb_batch, *times))
        del weight, momentum
    return out


def tbe(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """FBGEMM's table-batched embedding, the kernel TorchRec trains with (one table, the
    row-wise Adagrad update fused into the backward), as `embedding` measures torch's:
    forward bytes/s and backward + update over forward. Empty where `fbgemm_gpu` does not
    import (the result's `embedding_kernel` says which kernel the constants come from)."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception:  # noqa: BLE001 - not installed, or built for another CUDA: say so
        return []
    gpu = device.type == "cuda"
    where = (
        (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
        if gpu
        else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    )
    out, gen = [], torch.Generator().manual_seed(0)
    for rows, dim in _tables(sizes, device, timer):
        kernel = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, *where)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            **({"device": device} if gpu else {}),
        )
        for pooling in sizes.poolings:
            ids = power_law_ids(sizes.emb_batch * pooling, rows, gen, device)
            offsets = torch.arange(0, len(ids) + 1, pooling, device=device)
            times = _tbe_case(kernel, ids, offsets, timer)
            out.append(_case(rows, dim, pooling, "power_law", sizes.emb_batch, *times))
        del kernel
    return out


def _tbe_case(kernel: nn.Module, ids, offsets, timer: Timer) -> tuple[float, float]:
    """Median ms of the forward and of the backward with its fused update (timed as forward
    + backward, less the forward)."""
    ids, offsets = ids.to(torch.int64), offsets.to(torch.int64)

    def forward() -> None:
        with torch.no_grad():
            kernel(ids, offsets)

    def forward_backward() -> None:
        out = kernel(ids, offsets)
        out.backward(torch.ones_like(out))

    fwd = timer.median_ms(forward)
    return fwd, max(timer.median_ms(forward_backward) - fwd, 1e-6)


@torch.no_grad()
def _embedding_case(
    weight: torch.Tensor, momentum: torch.Tensor, ids: torch.Tensor, pooling: int, timer: Timer
) -> tuple[float, float]:
    """Median ms of the pooled forward and of backward + row-wise Adagrad on touched rows."""
    device, dim = weight.device, weight.shape[1]
    batch = len(ids) // pooling
    offsets = torch.arange(0, len(ids), pooling, device=device)
    bag = torch.arange(batch, device=device).repeat_interleave(pooling)
    grad_out = torch.randn(batch, dim, device=device)

    def forward() -> torch.Tensor:
        return F.embedding_bag(ids, weight, offsets, mode="sum")

    def backward() -> None:
        uniq, inverse = torch.unique(ids, return_inverse=True)
        grad = torch.zeros(len(uniq), dim, device=device).index_add_(0, inverse, grad_out[bag])
        momentum.index_add_(0, uniq, grad.pow(2).mean(1))
        weight.index_add_(0, uniq, grad / (momentum[uniq].sqrt() + 1e-8).unsqueeze(1), alpha=-0.01)

    return timer.median_ms(forward), timer.median_ms(backward)


class DCNv2(nn.Module):
    """DLRM-DCNv2's dense part: bottom MLP, low-rank cross layers over [dense, 26 pooled
    embeddings], top MLP; the embeddings are inputs that take gradients."""

    def __init__(
        self,
        dim: int = 128,
        bottom=(512, 256, 128),
        top=(1024, 1024, 512, 256, 1),
        layers: int = 3,
        rank: int = 512,
        features: int = 26,
    ) -> None:
        super().__init__()
        self.bottom = _mlp(13, bottom)
        width = dim * (features + 1)
        self.v = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.u = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))
        self.top = _mlp(width, top)

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([self.bottom(dense), emb.flatten(1)], 1)
        x = x0
        for v, u in zip(self.v, self.u, strict=True):
            x = x0 * u(v(x)) + x
        return self.top(x)

    def matmul_flops_per_sample(self) -> float:
        return 2.0 * _linear_macs(self)


class DLRMSmall(nn.Module):
    """`dlrm_small`'s dense part: bottom 13-64-16, pairwise dots of 27 vectors, top 64-32-1."""

    def __init__(self, dim: int = 16, features: int = 26) -> None:
        super().__init__()
        self.bottom = _mlp(13, (64, dim))
        n = features + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1))
        self.top = _mlp(dim + n * (n - 1) // 2, (64, 32, 1))
        self.n, self.dim = n, dim

    def forward(self, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)
        x = torch.cat([d.unsqueeze(1), emb], 1)
        dots = torch.bmm(x, x.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([d, dots], 1))

    def matmul_flops_per_sample(self) -> float:
        return 2.0 * (_linear_macs(self) + self.n * self.n * self.dim)


def _mlp(width: int, sizes) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, s in enumerate(sizes):
        layers += [nn.Linear(width, s)] + ([nn.ReLU()] if i < len(sizes) - 1 else [])
        width = s
    return nn.Sequential(*layers)


def _linear_macs(m: nn.Module) -> int:
    return sum(x.in_features * x.out_features for x in m.modules() if isinstance(x, nn.Linear))


def dense(sizes: Sizes, device: torch.device, timer: Timer, peak: float | None) -> list[dict]:
    """Forward + backward (3x the forward's matmul FLOPs) per model, precision and batch."""
    out = []
    precisions = ("fp32", "tf32", "bf16") if device.type == "cuda" else ("fp32", "bf16")
    for name, make, dim in (("dcnv2_mlperf", DCNv2, 128), ("dlrm_small", DLRMSmall, 16)):
        model = make().to(device)
        for precision in precisions:
            for batch in sizes.dense_batches:
                if timer.over_budget():
                    return out
                ms = _dense_case(model, batch, dim, precision, timer)
                tflops = 3 * model.matmul_flops_per_sample() * batch / (ms / 1e3) / 1e12
                out.append(
                    {
                        "model": name,
                        "precision": precision,
                        "batch": batch,
                        "ms": ms,
                        "tflops": tflops,
                        "of_bf16_peak": tflops * 1e12 / peak if peak else None,
                    }
                )
        del model
        _empty_cache(device)
    return out


def _dense_case(model: nn.Module, batch: int, dim: int, precision: str, timer: Timer) -> float:
    device = next(model.parameters()).device
    dense_in = torch.randn(batch, 13, device=device)
    emb = torch.randn(batch, 26, dim, device=device, requires_grad=True)

    def step() -> None:
        with _precision(precision, device):
            loss = model(dense_in, emb).float().mean()
        loss.backward()

    ms = timer.median_ms(step)
    model.zero_grad(set_to_none=True)
    return ms


class _precision:
    """fp32 (no TF32), tf32 (TF32 matmuls), or bf16 autocast."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision, self.device = precision, device

    def __enter__(self) -> None:
        if self.device.type == "cuda":
            self.tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        self.autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"
        )
        self.autocast.__enter__()

    def __exit__(self, *exc) -> None:
        self.autocast.__exit__(*exc)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32


def copies(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """Host -> device and device -> host GB/s from pinned and pageable host memory."""
    n = sizes.copy_mb * 2**20 // FLOAT_BYTES
    on_device = torch.empty(n, device=device)
    pinned = device.type == "cuda"
    out = []
    for memory in ("pinned", "pageable") if pinned else ("pageable",):
        host = torch.empty(n, pin_memory=memory == "pinned")
        for direction, fn in (
            ("host_to_device", lambda h=host: on_device.copy_(h)),
            ("device_to_host", lambda h=host: h.copy_(on_device)),
        ):
            ms = timer.median_ms(fn)
            out.append(
                {
                    "direction": direction,
                    "host_memory": memory,
                    "mb": sizes.copy_mb,
                    "ms": ms,
                    "gb_per_s": n * FLOAT_BYTES / (ms / 1e3) / 1e9,
                }
            )
    return out


def host_gather(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """Random rows gathered from a (pinned) host table and sent to the device: torch has no
    device-side zero-copy read of host memory, so this is the CPU gather + copy path."""
    pinned = device.type == "cuda"
    gen, out = torch.Generator().manual_seed(1), []
    for dim in sizes.dims:
        table = torch.empty(sizes.host_rows, dim, pin_memory=pinned).uniform_(-0.01, 0.01)
        ids = torch.randint(0, sizes.host_rows, (sizes.emb_batch * 8,), generator=gen)
        staging = torch.empty(len(ids), dim, pin_memory=pinned)

        def gather(table=table, ids=ids, staging=staging):
            torch.index_select(table, 0, ids, out=staging)
            return staging.to(device, non_blocking=True)

        ms = timer.median_ms(gather)
        out.append(
            {
                "dim": dim,
                "rows": sizes.host_rows,
                "lookups": len(ids),
                "ms": ms,
                "ns_per_lookup": ms * 1e6 / len(ids),
                "bytes_per_s": len(ids) * dim * FLOAT_BYTES / (ms / 1e3),
            }
        )
        del table, staging
    return out


def sequence(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """The cold-only exchange's local work per step: one vector per looked-up id (single-id
    bags), pooled into bags after the exchange; backward: gradients back to each id's row."""
    gen, out, rows = torch.Generator().manual_seed(2), [], min(sizes.rows)
    for dim in sizes.dims:
        weight = torch.empty(rows, dim, device=device).uniform_(-0.01, 0.01)
        for n in sizes.seq_lookups:
            ids = uniform_ids(n, rows, gen, device)
            out.append({"dim": dim, "lookups": n, "ms": _sequence_case(weight, ids, gen, timer)})
        del weight
    return out


@torch.no_grad()
def _sequence_case(
    weight: torch.Tensor, ids: torch.Tensor, gen: torch.Generator, timer: Timer
) -> float:
    device, dim = weight.device, weight.shape[1]
    bags = max(1, len(ids) // 8)
    bag = torch.randint(0, bags, (len(ids),), generator=gen).to(device)
    grad_out = torch.randn(bags, dim, device=device)

    def step() -> torch.Tensor:
        vectors = F.embedding(ids, weight)  # one output per id
        pooled = torch.zeros(bags, dim, device=device).index_add_(0, bag, vectors)
        weight.index_add_(0, ids, grad_out[bag], alpha=-0.01)  # the pooling's backward
        return pooled

    return timer.median_ms(step)


def fit_sequence(points: list[dict]) -> dict[str, float]:
    """t = fixed + lookups x (per_lookup + per_byte x dim x 4), least squares."""
    if len(points) < 3:
        return {}
    a = torch.tensor(
        [[1.0, p["lookups"], p["lookups"] * p["dim"] * FLOAT_BYTES] for p in points],
        dtype=torch.float64,
    )
    t = torch.tensor([p["ms"] / 1e3 for p in points], dtype=torch.float64)
    fixed, per_lookup, per_byte = torch.linalg.lstsq(a, t.unsqueeze(1)).solution.squeeze(1)
    return {
        "sequence_s_fixed": max(0.0, float(fixed)),
        "sequence_s_per_lookup": max(0.0, float(per_lookup)),
        "sequence_s_per_byte": max(0.0, float(per_byte)),
    }


def links(sizes: Sizes, device: torch.device, timer: Timer) -> list[dict]:
    """All-to-all and all-reduce between this node's GPUs, one process each, over NCCL (with
    `--device cpu`, 2 processes over gloo: a check of the code): per collective and size,
    the slowest rank's median ms. Empty with one GPU: there is no link to time."""
    world = torch.cuda.device_count() if device.type == "cuda" else 2
    if world < 2 or timer.over_budget():
        return []
    ctx = torch.multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_link_rank, args=(r, world, port, device.type, sizes, reports))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        per_rank = [reports.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [r for r in per_rank if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"the link measurement failed: {failed[0]}")
    slowest = {}
    for rows in per_rank:
        for row in rows:
            key = (row["collective"], row["bytes"])
            slowest[key] = max(slowest.get(key, 0.0), row["ms"])
    return [
        {"collective": c, "bytes": b, "ranks": world, "ms": ms, "bytes_per_s": b / (ms / 1e3)}
        for (c, b), ms in sorted(slowest.items())
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_rank(rank: int, world: int, port: int, kind: str, sizes: Sizes, reports) -> None:
    """One rank of `links`: its median ms per collective and size, or its error as text."""
    import datetime

    import torch.distributed as dist

    try:
        device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        timer = Timer(device, sizes.repeats, budget_s=3600)
        rows = []
        for nbytes in sizes.link_bytes:
            send = torch.ones(nbytes // FLOAT_BYTES // world * world, device=device)
            recv = torch.empty_like(send)

            def alltoall(send=send, recv=recv) -> None:
                dist.all_to_all_single(recv, send)

            def allreduce(send=send) -> None:
                dist.all_reduce(send)

            for name, fn in (("alltoall", alltoall), ("allreduce", allreduce)):
                dist.barrier()
                rows.append(
                    {
                        "collective": name,
                        "bytes": send.numel() * FLOAT_BYTES,
                        "ms": timer.median_ms(fn),
                    }
                )
        dist.barrier()
        dist.destroy_process_group()
        reports.put(rows)
    except Exception as e:  # noqa: BLE001 - the parent raises it, naming the rank
        reports.put(f"rank {rank}: {type(e).__name__}: {e}")


def fit_link(rows: list[dict], collective: str) -> dict[str, float] | None:
    """Latency and bytes/s of a collective from its sizes (least squares, t = a + bytes/b)."""
    points = [(r["bytes"], r["ms"] / 1e3) for r in rows if r["collective"] == collective]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / max(
        sum((x - mx) ** 2 for x, _ in points), 1e-30
    )
    if slope <= 0:
        return None
    return {"latency_s": max(0.0, my - slope * mx), "bytes_per_s": 1.0 / slope}


device_kind = gpu_kind  # the catalog kind of a GPU by its name (sharding.constants)


def unknown_kind(name: str, memory_gib: float | None) -> str:
    """A name for a device the catalog lacks, in the catalog's style: `l40s_45g`."""
    words = [
        t
        for t in re.split(r"[^0-9a-z]+", name.lower())
        if t and t not in ("nvidia", "tesla", "geforce")
    ] or ["device"]
    return f"{words[0]}_{round(memory_gib)}g" if memory_gib else words[0]


def constants(result: dict) -> dict:
    """The device constants (`sharding.types.DeviceCost` fields) in the CPU
    calibration's format: measured where the probe measures them, the datasheet model's
    (`sharding.constants.datasheet_rates`) for the rest, which `measured.assumed` names."""
    sizes, kind = result["sizes"], result["device"]["kind"]
    timed = result.get("tbe") or result["embedding"]  # FBGEMM's kernel where it ran
    emb = [e for e in timed if e["rows"] == max(sizes["rows"])] or timed
    at = {}  # per precision: DCNv2's dense part at the batch nearest the training batch
    for precision in PRECISIONS:
        dcn = [
            d
            for d in result["dense"]
            if d["model"] == "dcnv2_mlperf" and d["precision"] == precision
        ]
        if dcn:
            at[precision] = min(dcn, key=lambda d: abs(d["batch"] - sizes["train_batch"]))
    dense = {p: d["tflops"] * 1e12 for p, d in at.items()}
    measured = {
        "emb_read_bytes_per_s": _median([e["forward_bytes_per_s"] for e in emb]),
        "emb_bwd_factor": _median([e["bwd_over_fwd"] for e in emb]),
        "host_read_bytes_per_s": _median([h["bytes_per_s"] for h in result["host_gather"]]),
        "dense_flops_per_s": dense.get("bf16"),  # each precision's: dense_flops_per_s_by_precision
        **fit_sequence(result["sequence"]),
    }
    measured = {k: v for k, v in measured.items() if v is not None}
    k = DEVICE_CATALOG[kind] if kind else None
    sheet = datasheet_rates(k.hbm_gbyte_s, k.speed, HOST_TO_DEVICE_GBPS) if k else None
    base = sheet or datasheet_rates(1.0, 1.0, HOST_TO_DEVICE_GBPS)  # only its assumed fields
    link = {c: fit_link(result.get("links", []), c) for c in ("alltoall", "allreduce")}
    return {
        "kind": kind,
        "device": {**base, **measured},
        "dense_flops_per_s_by_precision": dense,  # the cost model prices the run's precision
        # between this node's GPUs (NCCL), where it has more than one
        "links": {"intra_node": link} if all(link.values()) else {},
        "measured": {
            "source": "python -m benchmarks.gpu_probe",
            "embedding_kernel": result.get("embedding_kernel"),
            "device_name": result["device"]["name"],
            "date": result["environment"]["date"],
            "torch": result["environment"]["torch"],
            "assumed": sorted(set(base) - set(measured)),
            "datasheet": sheet,  # what the cost model assumed for this kind
            "dense_at": at,
        },
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(
    device: torch.device,
    sizes: Sizes,
    budget_s: float,
    kind: str | None,
    save: Callable[[dict], None] = lambda result: None,
) -> dict:
    """Every section in turn; `save(result)` after each, so that what was measured survives
    a section that fails or a machine taken back."""
    torch.manual_seed(0)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info = {
            "name": props.name,
            "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count,
        }
        kind = kind or device_kind(props.name, info["memory_gib"])
    else:
        info = {"name": platform.processor() or platform.machine(), "memory_gib": None}
    peak = DEVICE_CATALOG[kind].speed * A100_BF16_FLOPS if kind else None
    hbm = DEVICE_CATALOG[kind].hbm_gbyte_s * 1e9 if kind else None
    # each section gets its share of the budget and stops measuring new shapes past it
    sections = (
        ("tbe", 0.2, lambda t: tbe(sizes, device, t)),
        ("embedding", 0.15, lambda t: embedding(sizes, device, t)),
        ("dense", 0.3, lambda t: dense(sizes, device, t, peak)),
        ("copies", 0.05, lambda t: copies(sizes, device, t)),
        ("host_gather", 0.1, lambda t: host_gather(sizes, device, t)),
        ("sequence", 0.1, lambda t: sequence(sizes, device, t)),
        ("links", 0.1, lambda t: links(sizes, device, t)),
    )
    result: dict = {
        "device": {**info, "kind": kind, "type": device.type},
        "environment": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "datasheet": {"hbm_bytes_per_s": hbm, "bf16_flops_per_s": peak},
        "sizes": asdict(sizes),
        "complete": False,  # true once every section has run
    }
    start, spent = time.monotonic(), 0.0
    for name, share, measure in sections:
        t0 = time.monotonic()
        print(f"[gpu_probe] {name} ...", flush=True)
        result[name] = measure(Timer(device, sizes.repeats, budget_s * share))
        spent = time.monotonic() - t0
        print(f"[gpu_probe] {name}: {len(result[name])} measurements in {spent:.1f} s", flush=True)
        result["elapsed_s"] = time.monotonic() - start
        if name == "tbe":  # which kernel the embedding constants come from
            result["embedding_kernel"] = EMBEDDING_KERNELS[bool(result["tbe"])]
        save(result)
    if hbm:
        for e in result["tbe"] + result["embedding"]:
            e["of_hbm_bandwidth"] = e["forward_bytes_per_s"] / hbm
    result["complete"] = True
    save(result)
    return result


def summary_lines(result: dict, consts: dict) -> list[str]:
    """Each measured constant beside the datasheet model's assumption for this kind."""
    d, sheet = consts["device"], consts["measured"]["datasheet"]
    env = result["environment"]
    lines = [
        f"device: {result['device']['name']} ({result['device']['kind'] or 'kind unknown'}),"
        f" torch {env['torch']}, CUDA {env['cuda']}; measured in {result['elapsed_s']:.0f} s",
        f"{'constant':24} {'measured':>16} {'datasheet model':>16}",
    ]
    for field, unit, scale in (
        ("emb_read_bytes_per_s", "GB/s", 1e-9),
        ("emb_bwd_factor", "x", 1.0),
        ("host_read_bytes_per_s", "GB/s", 1e-9),
        ("sequence_s_per_lookup", "ns", 1e9),
        ("sequence_s_per_byte", "ps", 1e12),
        ("sequence_s_fixed", "us", 1e6),
    ):
        if field in consts["measured"]["assumed"]:
            continue
        then = f"{sheet[field] * scale:.3g} {unit}" if sheet else "-"
        lines.append(f"{field:24} {f'{d[field] * scale:.3g} {unit}':>16} {then:>16}")
    for precision, rate in consts["dense_flops_per_s_by_precision"].items():
        factor = precision_factor(consts["kind"], precision) if consts["kind"] else None
        then = f"{sheet['dense_flops_per_s'] * factor * 1e-12:.3g} TFLOP/s" if sheet else "-"
        lines.append(f"{'dense, ' + precision:24} {f'{rate * 1e-12:.3g} TFLOP/s':>16} {then:>16}")
    lines.append(f"embedding kernel timed: {consts['measured']['embedding_kernel']}")
    for collective, link in (consts["links"].get("intra_node") or {}).items():
        rate = f"{link['bytes_per_s'] * 1e-9:.3g} GB/s"
        lines.append(f"{collective + ' between GPUs':24} {rate:>16}")
    if not consts["links"]:
        lines.append("links between GPUs: not measured (fewer than 2 GPUs here)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_probe",
        description="Measure a GPU's embedding, dense, copy and sequence constants for the "
        "cost model; writes gpu_probe.json and <kind>.json into --out.",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for the results")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a check, seconds")
    parser.add_argument("--kind", help="catalog kind (h200_141g ...); default: from the name")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="seconds in all; a section past its share stops",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA device here; run on a GPU machine, or --device cpu --quick to "
            "check the probe itself",
            file=sys.stderr,
        )
        return 2
    if args.kind is not None and args.kind not in DEVICE_CATALOG:
        print(
            f"error: --kind {args.kind} is not in the catalog: {sorted(DEVICE_CATALOG)}",
            file=sys.stderr,
        )
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:  # after each section: whole or not at all
        tmp = args.out / "gpu_probe.json.tmp"
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out / "gpu_probe.json")

    result = run(device, QUICK if args.quick else Sizes(), args.budget_s, args.kind, save)
    consts = constants(result)
    # a device the catalog lacks: its own name, and its measured figures (add it to
    # sharding/constants.py's DEVICE_CATALOG to plan for it)
    info = result["device"]
    name = info["kind"] or unknown_kind(info["name"], info["memory_gib"])
    (args.out / f"{name}.json").write_text(json.dumps(consts, indent=1) + "\n")
    print("\n".join(summary_lines(result, consts)))
    print(f"wrote {args.out / 'gpu_probe.json'} and {args.out / f'{name}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
