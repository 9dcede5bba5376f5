"""The gloo link probe (`benchmarks.comm_probe`) on two local ranks."""

from __future__ import annotations

from benchmarks.comm_probe import probe
from recsys.launch import raise_on_failure, spawn_ranks


def test_the_probe_times_small_all_to_alls_again_with_the_cores_busy() -> None:
    sizes = [16_384, 131_072, 2 << 20]
    out = raise_on_failure(spawn_ranks(probe, 2, (sizes, 2), timeout_s=120), "probe")[0]
    assert out["busy_sizes_bytes"] == [16_384, 131_072]  # up to BUSY_MAX_BYTES: chunks
    assert len(out["alltoall_busy_s"]) == 2 and min(out["alltoall_busy_s"]) > 0
    assert len(out["alltoall_s"]) == len(out["allreduce_s"]) == 3
