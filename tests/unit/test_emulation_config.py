"""The emulated cluster's schema: presets resolve to their shares and nodes; bad sections and a
machine that cannot emulate are refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import cluster_of, compose_config

from recsys import emulation
from recsys.app.train import to_typed, train
from sharding.cluster import ClusterConfigError, cfs_period_us, resolve_cluster


def test_presets_resolve_to_their_shares_and_nodes() -> None:
    ranks = resolve_cluster(cluster_of("emu_mixed4"))
    assert [(r.node, r.share) for r in ranks] == [(0, 0.6), (0, 0.6), (1, 0.25), (1, 0.25)]
    assert sum(r.share for r in ranks) <= 1.8  # the emulation, not contention, sets speeds
    ranks = resolve_cluster(cluster_of("emu_mixed3"))
    assert [(r.node, r.local_rank, r.share) for r in ranks] == [
        (0, 0, 0.8),
        (1, 0, 0.25),
        (1, 1, 0.25),
    ]
    assert emulation.link_rate(cluster_of("emu_mixed4")) == "200mbit"


def test_the_default_cfs_period_is_the_shortest_whole_ms_the_smallest_share_allows() -> None:
    assert cfs_period_us(cluster_of("emu_mixed4")) == 4000  # 0.25 of 4 ms: the 1 ms minimum
    assert cfs_period_us(cluster_of("emu_2node")) == 2000  # 0.8: 1,250 us at least
    spec = cluster_of("emu_mixed4", ["cluster.nodes.1.devices.0.share=0.35"])
    assert cfs_period_us(spec) == 3000
    spec = cluster_of("emu_mixed4", ["cluster.emulation.cfs_period_us=100000"])
    assert cfs_period_us(spec) == 100_000  # as asked


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["cluster.emulation.enabled=false"], "needs kind cpu .* and emulation.enabled=true"),
        (["cluster.nodes.0.devices.0.share=1.5"], r"fraction of one core in \(0, 1\]"),
        (["cluster.nodes.0.devices.0.share=0"], r"fraction of one core in \(0, 1\]"),
        (
            ["cluster.nodes.0.devices.0.kind=h100_80g", "cluster.nodes.0.devices.0.share=null"],
            "an emulated cluster runs CPU ranks",
        ),
        (
            ["cluster.emulation.cfs_period_us=3000"],
            r"cfs_period_us=3000 gives the share 0.25 a quota of 750 us, under the kernel's 1000 "
            r"us minimum; use at least 4000, or 0",
        ),
    ],
)
def test_bad_emulation_sections_are_refused_by_key(overrides: list[str], match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        resolve_cluster(cluster_of("emu_mixed4", overrides))


def test_without_root_or_with_too_many_cores_it_refuses_in_one_line(
    monkeypatch, tmp_path: Path
) -> None:
    spec = cluster_of("emu_mixed4")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = emulation.refuse_reason(spec)
    assert "needs root" in why and "cluster=local_cpu2" in why and "\n" not in why
    cfg = to_typed(compose_config(["cluster=emu_mixed4", "planner=round_robin"]))
    with pytest.raises(emulation.EmulationError, match="needs root"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was made
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})  # a 1-core machine
    why = emulation.refuse_reason(spec)
    assert "add up to 1.7 cores but this machine offers 1" in why


def test_a_rank_reads_its_own_cgroups_quota_periods(tmp_path: Path) -> None:
    """`quota_periods`: the CFS periods and throttled periods of the cgroup /proc/self/cgroup
    names, under cgroup v1's cpu controller (which may share its line with cpuacct) or v2;
    (0, 0) where none is found (a rank without a quota)."""
    v1, v2, proc = tmp_path / "v1", tmp_path / "v2", tmp_path / "cgroup"
    stat = v1 / "recsys-emu_mixed4-1" / "n1" / "r2" / "cpu.stat"
    stat.parent.mkdir(parents=True)
    stat.write_text("nr_periods 2256\nnr_throttled 1441\nthrottled_time 4950000000\n")
    proc.write_text("12:memory:/\n4:cpu,cpuacct:/recsys-emu_mixed4-1/n1/r2\n0::/\n")
    assert emulation.quota_periods(proc, v1, v2) == (2256, 1441)
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.stat").write_text("usage_usec 10\nnr_periods 40\nnr_throttled 3\n")
    proc.write_text("0::/job\n")
    assert emulation.quota_periods(proc, v1, v2) == (40, 3)
    proc.write_text("0::/elsewhere\n")
    assert emulation.quota_periods(proc, v1, v2) == (0, 0)
    assert emulation.quota_periods(tmp_path / "missing", v1, v2) == (0, 0)
