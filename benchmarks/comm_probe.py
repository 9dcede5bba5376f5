"""Time gloo all-to-all and all-reduce at several sizes between the ranks of a job.

Runs in ranks started by `recsys.launch.spawn_ranks` (loopback) or, inside network
namespaces, as `python -m benchmarks.comm_probe <out.json> <sizes...>` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from recsys import launch

REPEATS = 8
# all-to-alls also timed with the rank's core busy, up to this size: a pipeline's chunks
BUSY_MAX_BYTES = 1 << 20


@contextmanager
def busy_core():
    """A thread of this rank computing (small matmuls, which release the GIL) throughout:
    the rank busy, as a training rank is while its pipelined exchanges run."""
    stop, a = threading.Event(), torch.randn(128, 128)

    def spin() -> None:
        while not stop.is_set():
            torch.mm(a, a)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _time(op, repeats: int) -> tuple[float, float]:
    """Median wall seconds of `op`, and median CPU seconds this process spent in it (every
    thread: gloo's send and receive threads too)."""
    op()  # warm up: connection setup, buffers
    dist.barrier()
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        op()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]


def probe(sizes_bytes: list[int], repeats: int = REPEATS) -> dict:
    """Per size (bytes each rank sends in total): median seconds of all_to_all_single and
    all_reduce, and the all-to-all's CPU seconds on this rank (`alltoall_cpu_s`); then, up
    to `BUSY_MAX_BYTES`, the all-to-all's seconds with every rank's core busy
    (`alltoall_busy_s`, at `busy_sizes_bytes`). Every rank returns the same structure; rank
    0's is the one used."""
    torch.set_num_threads(1)
    rank, world = launch.init_distributed(120.0)
    busy_sizes = [s for s in sizes_bytes if s <= BUSY_MAX_BYTES]
    out = {"sizes_bytes": sizes_bytes, "alltoall_s": [], "alltoall_cpu_s": [], "allreduce_s": [],
           "busy_sizes_bytes": busy_sizes, "alltoall_busy_s": []}  # fmt: skip

    def a2a_of(size: int):
        n = max(world, size // 4 // world * world)
        send, recv = torch.ones(n), torch.empty(n)
        return lambda: dist.all_to_all_single(recv, send)

    for size in sizes_bytes:
        wall, cpu = _time(a2a_of(size), repeats)
        out["alltoall_s"].append(wall)
        out["alltoall_cpu_s"].append(cpu)
        grad = torch.ones(max(1, size // 4))
        out["allreduce_s"].append(_time(lambda g=grad: dist.all_reduce(g), repeats)[0])
    with busy_core():
        for size in busy_sizes:
            out["alltoall_busy_s"].append(_time(a2a_of(size), repeats)[0])
    return out


if __name__ == "__main__":
    result = probe([int(s) for s in sys.argv[2:]])
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    launch.shutdown_distributed(clean=True)
