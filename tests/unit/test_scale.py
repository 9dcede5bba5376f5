"""The scale study's families: each scales its base preset and divides the network."""

from __future__ import annotations

import pytest
from conftest import REPO, compose_config

from benchmarks.scale import (
    Family,
    ScaleConfig,
    ScheduleLabel,
    cluster_at,
    label_of,
    schedule_of_label,
)
from sharding.types import Schedule


def test_families_scale_their_base_preset_and_divide_the_network() -> None:
    from recsys.config import register_configs

    register_configs()
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        compose(config_name="config")  # a Hydra context for the family builder
        cfg = compose(config_name="bench_scale")  # the families config group's defaults
        families = {k: Family(**v) for k, v in cfg.families.items()}
        assert list(families) == ["homogeneous", "mixed"]
        h = cluster_at("homogeneous", families["homogeneous"], 64, 2.0)
        assert sum(n.count * sum(d.count for d in n.devices) for n in h.nodes) == 64
        assert h.network.inter_node_gbit_s == 200  # 2x8_h100's 400, oversubscribed 2:1
        m = cluster_at("mixed", families["mixed"], 128, 1.0)
        assert [n.count for n in m.nodes] == [4, 4, 4, 4]  # hetero_64's 2 of each, twice
        assert cluster_at("mixed", families["mixed"], 96, 1.0) is None  # not a multiple of 64
        halves = cluster_at("mixed", Family("hetero_64", 32), 96, 1.0)  # a node of each kind
        assert [n.count for n in halves.nodes] == [3, 3, 3, 3]
        with pytest.raises(SystemExit, match="families.odd.step such that"):
            cluster_at("odd", Family("hetero_64", 16), 64, 1.0)  # half a node of each kind
    assert schedule_of_label("nested8") == ScheduleLabel(Schedule.nested, 8)
    assert schedule_of_label("sparse_dist") == ScheduleLabel(Schedule.sparse_dist, 1)
    assert schedule_of_label("semi_sync") == ScheduleLabel(Schedule.sparse_dist, 1, stale=True)
    assert schedule_of_label("base") == ScheduleLabel(Schedule.plain)  # TorchRec's, no overlap
    both = schedule_of_label("nested2+dedup+cluster")
    assert (both.micro_batches, both.dedup, both.clustered) == (2, True, True)
    fwd = schedule_of_label("nested4+dedup_fwd")
    assert (fwd.dedup, fwd.dedup_grads, both.dedup_grads) == (True, False, True)
    for bad in ("plain+dedup", "nested4+fast", "nested4+dedup+dedup_fwd"):
        with pytest.raises(ValueError, match="only nested"):
            schedule_of_label(bad)
    assert ScaleConfig().workers[-1] == 1536


def test_the_dense_part_is_priced_at_the_precision_asked() -> None:
    """`precision=bf16` (MLPerf's) prices the dense part on tensor cores: the same workers'
    step is shorter than at fp32, by no more than the dense part it prices."""
    from recsys.config import register_configs

    register_configs()
    from hydra import compose, initialize_config_dir

    from benchmarks.scale import scale_points

    def points(precision: str) -> dict:
        cfg = ScaleConfig(
            families={"homogeneous": Family("2x8_h100", 8)},
            workers=[8],
            planners=["round_robin"],
            schedules=["plain"],
            profile=None,
            precision=precision,
            validation=False,
        )
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            compose(config_name="config")
            return scale_points(cfg)[0][0]

    fp32, bf16 = points("fp32"), points("bf16")
    assert bf16["step_ms"] < 0.8 * fp32["step_ms"]
    assert bf16["lookup_ms"] == pytest.approx(fp32["lookup_ms"])  # tables stay fp32
    with pytest.raises(SystemExit, match="precision=fp8 is not one of"):
        points("fp8")


def test_gpu_hosts_batch_assembly_is_priced_as_the_study_is_told() -> None:
    """`host_s_per_sample`: 0 (the default) prices the batch ready, so a pipelined step is
    the devices' and the links'; a rate puts each rank's batch assembly under the step, a
    floor on it (4096 samples at 10 us: 40.96 ms); null takes this machine's calibrated
    one-core rate, the trainer's one prefetch thread a rank."""
    from recsys.config import register_configs

    register_configs()
    from hydra import compose, initialize_config_dir

    from benchmarks.scale import scale_points
    from sharding.calibration import host_assembly_s

    def step_ms(host: float | None) -> float:
        cfg = ScaleConfig(
            families={"homogeneous": Family("2x8_h100", 8)},
            workers=[8],
            planners=["round_robin"],
            schedules=["nested4"],
            profile=None,
            host_s_per_sample=host,
            validation=False,
        )
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            compose(config_name="config")
            return scale_points(cfg)[0][0]["step_ms"]

    assert ScaleConfig().host_s_per_sample == 0.0
    ready, slow, here = step_ms(0.0), step_ms(1e-5), step_ms(None)
    assert ready < 40.96 and slow == pytest.approx(40.96)
    assert here == pytest.approx(max(ready, 4096 * host_assembly_s() * 1000))
    with pytest.raises(SystemExit, match="host_s_per_sample=-1e-06 is not a time"):
        step_ms(-1e-6)


def test_a_training_configs_label_names_its_dedup() -> None:
    """What the simulator's validation prices a measured run as: dedup both ways, or the
    forward only (`dedup_grads=false`), clustering only where dedup sends less with it."""
    from recsys.app.train import to_typed

    nested = ["pipeline=nested", "pipeline.micro_batches=8"]
    fwd = ["pipeline.dedup=true", "pipeline.dedup_grads=false", "pipeline.cluster_samples=true"]
    for extra, want in (
        ([], "nested8"),
        (["pipeline.dedup=true"], "nested8+dedup"),
        (fwd, "nested8+dedup_fwd+cluster"),
    ):
        assert label_of(to_typed(compose_config(nested + extra))) == want
        assert schedule_of_label(want).dedup_grads == ("dedup_fwd" not in want)
