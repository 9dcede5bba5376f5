"""One memory accounting for every plan (sharding.memory): each part counted, a skewed batch
paying for its activations, and the activations measured on the model itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planners import NET, inputs_for

from sharding.memory import (
    BATCHES_IN_FLIGHT,
    DENSE_BYTES_PER_PARAM,
    batch_bytes_per_sample,
    input_bytes_per_sample,
    rank_memory,
)
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.types import (
    ClusterSpec,
    DeviceGroup,
    NodeGroup,
    Plan,
    Schedule,
    Shard,
    TablePlan,
    TableStats,
    Tier,
)

TABLES = [TableStats("a", 10_000, 64, lookups_per_sample=3.0), TableStats("b", 500, 32)]


def _two_gpus(hbm_gib: float = 1.0) -> ClusterSpec:
    node = NodeGroup(host_memory_gib=1.0, devices=[DeviceGroup("a100_80g", 2, hbm_gib=hbm_gib)])
    return ClusterSpec(name="two", nodes=[node], network=NET)


def test_every_part_is_counted_on_the_rank_that_holds_it() -> None:
    inputs = inputs_for(_two_gpus(), TABLES, batch=100)
    inputs.activation_bytes_per_sample = 1000.0
    shards = [Shard("a", 0, 10_000, 64), Shard("b", -1, 500, 32, dp=True)]
    batch = [150, 50]
    mem = rank_memory(inputs, shards, batch)
    row = 64 * 4 + 4  # weights and row-wise Adagrad's one float
    replica = 500 * (32 * 4 + 4)
    assert mem[0]["tables"] == 10_000 * row + replica and mem[1]["tables"] == replica
    assert mem[0]["dense"] == mem[1]["dense"] == inputs.dense_params * DENSE_BYTES_PER_PARAM
    # table a's buffers on rank 0: for all 200 samples its 3 ids and a length in, one
    # pooled vector out and its gradient back; the replica's outputs are the rank's own
    assert mem[0]["buffers"] == 200 * (3 * 8 + 4 + 2 * 64 * 4) and mem[1]["buffers"] == 0
    # each rank's batch: the inputs in flight, the pooled embeddings it receives (and their
    # gradients), its activations, at its own share
    inputs_per_sample = (3 * 8 + 4) + (1 * 8 + 4) + (13 + 1) * 4
    assert input_bytes_per_sample(inputs) == inputs_per_sample
    per_sample = BATCHES_IN_FLIGHT[Schedule.sparse_dist] * inputs_per_sample + 2 * 96 * 4 + 1000
    assert mem[0]["batch"] == 150 * per_sample and mem[1]["batch"] == 50 * per_sample
    for m in mem:
        assert m["hbm"] == sum(m[k] for k in ("tables", "buffers", "dense", "batch"))
    plain = replace(inputs, schedule=Schedule.plain)
    assert batch_bytes_per_sample(plain) == per_sample - 2 * inputs_per_sample


def test_a_skewed_batch_pays_for_its_activations() -> None:
    """A placement that fits at equal shares does not fit when one rank takes most of the
    batch and its activations outgrow its memory; every planner is judged so."""
    inputs = inputs_for(_two_gpus(hbm_gib=0.05), TABLES, batch=2048)
    inputs.activation_bytes_per_sample = 8_000.0  # 32 MB at 4,096 samples
    tables = [
        TablePlan(
            "a", 10_000, 64, "table_wise", [0], Tier.hbm, 10_000, 0, [Shard("a", 0, 10_000, 64)]
        ),
        TablePlan("b", 500, 32, "table_wise", [1], Tier.hbm, 500, 0, [Shard("b", 1, 500, 32)]),
    ]
    even = evaluate(Plan("p", "two", tables, [2048, 2048]), inputs)
    assert even.feasible
    skewed = evaluate(Plan("p", "two", tables, [3900, 196]), inputs)
    assert not skewed.feasible
    rank0 = skewed.devices[0]
    assert rank0["hbm_used_bytes"] > rank0["hbm_cap_bytes"]
    assert rank0["hbm_parts_bytes"]["batch"] > even.devices[0]["hbm_parts_bytes"]["batch"]
    # hybrid's own plan fits, whatever batch split it settles on
    assert evaluate(PLANNERS["hybrid"](inputs), inputs).feasible


def test_no_room_for_the_dense_part_and_batch_is_one_clear_message() -> None:
    from sharding.types import PlanDoesNotFitError

    inputs = inputs_for(_two_gpus(hbm_gib=0.02), TABLES, batch=4096)
    inputs.activation_bytes_per_sample = 8_000.0
    with pytest.raises(
        PlanDoesNotFitError,
        match=r"no device has room for tables after the "
        r"dense part .*\(trainer\.batch_size\)",
    ):
        PLANNERS["hybrid"](inputs)


def test_activations_are_measured_on_the_model(typed_cfg) -> None:
    """The DLRM-DCNv2 dense part's saved tensors, measured on the trainer's model, agree with
    the suites' measurement of TorchRec's modules; wider layers save more."""
    from recsys.models.cost_inputs import model_cost
    from sharding.activations import dcnv2_activation_bytes
    from sharding.suites import BOTTOM, CROSS_LAYERS, CROSS_RANK, DENSE_IN, TOP

    model = typed_cfg(["model=dcnv2_mlperf"]).model
    measured = model_cost(model).activation_bytes_per_sample
    width = len(model.num_embeddings_per_feature) * model.embedding_dim
    suites = dcnv2_activation_bytes(DENSE_IN, BOTTOM, width, CROSS_LAYERS, CROSS_RANK, TOP)
    assert measured == pytest.approx(suites, rel=1e-3)
    # at least each layer's output and each cross layer's input, 4 bytes a float
    assert measured > 4 * (sum(BOTTOM) + sum(TOP) + CROSS_LAYERS * (width + 128))
    wider = dcnv2_activation_bytes(DENSE_IN, BOTTOM, 2 * width, CROSS_LAYERS, CROSS_RANK, TOP)
    assert wider > suites
    assert model_cost(typed_cfg([]).model).activation_bytes_per_sample > 0  # dlrm_small


def test_feeding_a_skewed_batch_costs_its_ranks_host_work_and_copy() -> None:
    """A GPU rank's batch is assembled on the host and copied to the device at its own
    share: added to the plain loop's step, a floor under a pipelined schedule."""
    from sharding.plan_eval import plan_cost

    inputs = inputs_for(_two_gpus(), TABLES, batch=1000)
    tables = [
        TablePlan(
            "a", 10_000, 64, "table_wise", [0], Tier.hbm, 10_000, 0, [Shard("a", 0, 10_000, 64)]
        ),
        TablePlan("b", 500, 32, "table_wise", [1], Tier.hbm, 500, 0, [Shard("b", 1, 500, 32)]),
    ]
    even = plan_cost(Plan("p", "two", tables, [1000, 1000]), inputs)
    skew = plan_cost(Plan("p", "two", tables, [1900, 100]), inputs)
    d = inputs.devices[0]
    assert d.host_s_per_sample > 0
    assert skew.input_copy_s[0] == pytest.approx(
        1900 * input_bytes_per_sample(inputs) / d.host_read_bytes_per_s
    )
    assert skew.host_input_s == pytest.approx(
        [1900 * d.host_s_per_sample, 100 * d.host_s_per_sample]
    )
    serial = skew.host_input_s[0] + skew.input_copy_s[0]
    assert skew.step_s(Schedule.plain) == pytest.approx(skew.device_step_s(Schedule.plain) + serial)
    assert skew.feed_s()[0] > even.feed_s()[0] * 1.8  # the busiest rank feeds 1.9x the samples
    # pipelined: fed ahead on the host and the copy link, so the step is at least that long
    slow_host = replace(skew, host_input_s=[1.0, 0.0])
    assert slow_host.step_s(Schedule.sparse_dist) == 1.0
    assert skew.step_s(Schedule.sparse_dist) == max(
        skew.device_step_s(Schedule.sparse_dist), skew.host_input_s[0], skew.input_copy_s[0]
    )
