"""Time gloo all-to-all and all-reduce at several sizes between the ranks of a job.

Runs in ranks started by `recsys.launch.spawn_ranks` (loopback) or, inside network
namespaces, as `python -m benchmarks.comm_probe <out.json> <sizes...>` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from recsys import launch

REPEATS = 8


def _time(op, repeats: int) -> tuple[float, float]:
    """Median wall seconds of `op`, and median CPU seconds this process spent in it (every
    thread: gloo's send and receive threads too). Each call starts from a barrier, as a
    training step's collective starts from the compute before it: back to back, a call's
    time on one rank carries the tail of the previous call on the others (a 1 MB
    all-to-all across `emu_mixed3`'s link: 55 ms back to back, 32 ms from a barrier)."""
    op()  # warm up: connection setup, buffers
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        op()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]


def probe(sizes_bytes: list[int], repeats: int = REPEATS) -> dict:
    """Per size (bytes each rank sends in total): median seconds of all_to_all_single and
    all_reduce, and the all-to-all's CPU seconds on this rank (`alltoall_cpu_s`). Every
    rank returns the same structure; rank 0's is the one used."""
    torch.set_num_threads(1)
    rank, world = launch.init_distributed(120.0)
    out = {"sizes_bytes": sizes_bytes, "alltoall_s": [], "alltoall_cpu_s": [], "allreduce_s": []}
    for size in sizes_bytes:
        n = max(world, size // 4 // world * world)
        send, recv = torch.ones(n), torch.empty(n)
        a2a = lambda r=recv, s=send: dist.all_to_all_single(r, s)  # noqa: E731
        wall, cpu = _time(a2a, repeats)
        out["alltoall_s"].append(wall)
        out["alltoall_cpu_s"].append(cpu)
        grad = torch.ones(max(1, size // 4))
        out["allreduce_s"].append(_time(lambda g=grad: dist.all_reduce(g), repeats)[0])
    return out


if __name__ == "__main__":
    result = probe([int(s) for s in sys.argv[2:]])
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    launch.shutdown_distributed(clean=True)
