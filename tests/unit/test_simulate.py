"""The step simulator: the event engine on hand-checked schedules, and the schedules
against the cost model's closed form where they must agree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharding.simulate import Task, run, simulate
from sharding.types import Schedule, StepCost


def test_two_stages_on_one_resource_run_one_after_the_other() -> None:
    t = run([Task("a", "gpu", 2.0), Task("b", "gpu", 3.0)])
    assert t.spans == {"a": (0.0, 2.0), "b": (2.0, 5.0)}


def test_stages_on_two_resources_overlap_unless_one_waits_for_the_other() -> None:
    t = run([Task("a", "gpu", 2.0), Task("send", "nic", 3.0), Task("b", "gpu", 1.0, ("send",))])
    assert t.spans["send"] == (0.0, 3.0)  # beside a, not after it
    assert t.spans["b"] == (3.0, 4.0)  # waits for the send, not only for a


def test_a_shared_resource_serialises_two_stages_in_program_order() -> None:
    t = run(
        [
            Task("x", "gpu", 1.0),
            Task("y", "nic", 4.0, ("x",)),
            Task("z", "nic", 1.0),
            Task("w", "gpu", 1.0, ("z",)),
        ]
    )
    assert t.spans["y"] == (1.0, 5.0)
    assert t.spans["z"] == (5.0, 6.0)  # ready at 0, but the queue is in order
    assert t.spans["w"] == (6.0, 7.0)


def test_a_dependency_listed_later_or_a_negative_duration_is_refused() -> None:
    with pytest.raises(ValueError, match="depends on \\['b'\\], not listed before it"):
        run([Task("a", "gpu", 1.0, ("b",)), Task("b", "gpu", 1.0)])
    with pytest.raises(ValueError, match="negative duration"):
        run([Task("a", "gpu", -1.0)])


def _cost(world: int = 2, dense: float = 10.0, emb: float = 4.0, ids: float = 1.0) -> StepCost:
    return StepCost(
        lookup_fwd_s=[1.0] * world,
        lookup_bwd_s=[2.0] * world,
        ids_a2a_s=[ids] * world,
        emb_a2a_fwd_s=[emb] * world,
        emb_a2a_bwd_s=[emb] * world,
        dense_s=[dense] * world,
        allreduce_s=1.5,
        overhead_s=0.5,
        input_s=0.25,
    )


@pytest.mark.parametrize("schedule", [Schedule.plain, Schedule.sparse_dist])
def test_equal_ranks_take_the_closed_forms_step(schedule: Schedule) -> None:
    cost = _cost()
    assert simulate(cost, schedule).step_s == pytest.approx(cost.step_s(schedule))


def _fast_sender() -> StepCost:
    """Rank 0 looks up and computes in a third of rank 1's time but sends and receives
    most of the embeddings: its part of each exchange (4) outlasts rank 1's (1)."""
    return StepCost(
        lookup_fwd_s=[1.0, 3.0],
        lookup_bwd_s=[2.0, 2.0],
        ids_a2a_s=[1.0, 1.0],
        emb_a2a_fwd_s=[4.0, 1.0],
        emb_a2a_bwd_s=[4.0, 1.0],
        dense_s=[4.0, 12.0],
        allreduce_s=1.5,
        overhead_s=0.5,
        input_s=0.25,
    )


@pytest.mark.parametrize("schedule", [Schedule.plain, Schedule.sparse_dist])
def test_a_fast_ranks_sends_cross_under_a_slow_ranks_compute(schedule: Schedule) -> None:
    """Each rank's part of an all-to-all starts when its own work before it ends: the
    forward exchange ends at max(1 + 4, 3 + 1) = 5 after the lookups began, 2 past the
    slowest rank's lookups (not 4); the gradients at max(4 + 4, 12 + 1) = 13, 1 past the
    slowest dense work. Simulator and closed form agree."""
    cost = _fast_sender()
    # slowest lookups forward, dense, the lookups' backward (the reduce, 1.5, under it), overheads
    fixed = 3.0 + 12.0 + 2.0 + 0.75
    ids = 1.0 if schedule == Schedule.plain else 0.0  # SparseDist: under the dense work
    assert cost.step_s(schedule) == pytest.approx(fixed + ids + 2.0 + 1.0)
    assert simulate(cost, schedule).step_s == pytest.approx(cost.step_s(schedule))
    # the same parts with the work swapped onto the rank that sends most: all exposed
    late = replace(cost, lookup_fwd_s=[3.0, 1.0], dense_s=[12.0, 4.0])
    assert late.step_s(schedule) == pytest.approx(fixed + ids + 4.0 + 4.0)
    assert simulate(late, schedule).step_s == pytest.approx(late.step_s(schedule))


def test_the_plain_loop_exposes_the_whole_exchange() -> None:
    """Ids, forward, gradients; the all-reduce (1.5), queued behind the gradients, crosses
    under the lookups' backward (2.0)."""
    r = simulate(_cost(), Schedule.plain)
    assert r.exposed_comm_s == pytest.approx(1.0 + 4.0 + 4.0)
    # a reduce longer than the lookups' backward shows what it outlasts it by
    r = simulate(replace(_cost(), allreduce_s=3.5), Schedule.plain)
    assert r.exposed_comm_s == pytest.approx(1.0 + 4.0 + 4.0 + 1.5)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_nested_leaves_about_one_nth_of_the_exchange_exposed_when_compute_covers_it(n: int):
    """NestPipe's shape, in `pipelines.nested`'s order: with N > 1 micro-batches the last
    gradient chunk stays exposed (1/N of one exchange), and the first forward chunk for as
    long as it outlasts the optimizer step and overheads it crosses under (0.5 here); the
    all-reduce hides under the update and the next lookups, the rest under dense work. One
    micro-batch is SparseDist: both exchanges exposed (the all-reduce under the lookups'
    backward). The closed form agrees."""
    emb, cost = 4.0, _cost(dense=40.0, emb=4.0)
    r = simulate(cost, Schedule.nested, n)
    if n == 1:
        assert r.exposed_comm_s == pytest.approx(2 * emb)
    else:
        assert r.exposed_comm_s == pytest.approx(emb / n + max(0.0, emb / n - cost.overhead_s))
    assert r.step_s == pytest.approx(cost.step_s(Schedule.nested, n))


def test_each_chunk_pays_the_latency_and_each_micro_batch_its_fixed_work() -> None:
    """With 0.5 of latency in each 4.0 exchange and 0.4 of fixed work per micro-batch past
    the first, more micro-batches stop paying: each chunk moves 3.5/N and pays 0.5 again,
    the micro-batches' work grows by 0.4 each, and beyond N = 4 the chunks' latencies
    outlast the 8.25 of dense and per-sample work they cross under. The simulator and the
    closed form agree at every N."""
    from dataclasses import replace

    cost = replace(_cost(dense=8.0, emb=4.0), emb_latency_s=0.5, micro_batch_s=0.4)
    steps = {n: simulate(cost, Schedule.nested, n).step_s for n in (1, 2, 4, 8, 16)}
    for n, step in steps.items():
        assert step == pytest.approx(cost.step_s(Schedule.nested, n))
    assert cost.chunk_s(4.0, 8) == pytest.approx(3.5 / 8 + 0.5)
    # N = 8: the last gradient chunk, the lookups and update (3.0) over the all-reduce, the
    # first forward chunk over the 0.5 of overheads, then 14 chunks and the ids (13.25)
    # over the dense, per-sample and 7 x 0.4 of fixed work (11.05)
    chunk = 3.5 / 8 + 0.5
    assert steps[8] == pytest.approx(chunk + 3.0 + chunk + 14 * chunk + 1.0)
    assert steps[4] < steps[2] < steps[1] and steps[4] < steps[8] < steps[16]


def test_semi_sync_hides_the_forward_exchange_but_not_the_gradients() -> None:
    cost = _cost(dense=40.0, emb=4.0)
    semi = simulate(cost, Schedule.sparse_dist, stale=True)
    sparse = simulate(cost, Schedule.sparse_dist)
    # forward, gradients; the all-reduce under the lookups' backward
    assert sparse.exposed_comm_s == pytest.approx(4.0 + 4.0)
    assert semi.exposed_comm_s == pytest.approx(4.0)  # the gradients
    assert semi.step_s == pytest.approx(sparse.step_s - 4.0)


CPU = {"ids": [0.5, 0.5], "emb": [1.0, 1.0], "allreduce": [0.2, 0.2]}  # gloo's, CPU ranks


@pytest.mark.parametrize("schedule", [Schedule.plain, Schedule.sparse_dist])
def test_the_networks_cpu_work_takes_the_compute_queue_as_in_the_closed_form(schedule) -> None:
    """On CPU ranks each exchange's CPU work runs on the rank's compute queue beside its
    transfer: hidden in the plain loop's exposed exchanges, lengthening SparseDist's dense
    work by the next batch's ids' CPU work (0.5)."""
    from dataclasses import replace

    cost = replace(_cost(), comm_cpu_s=CPU)
    r = simulate(cost, schedule)
    assert r.step_s == pytest.approx(cost.step_s(schedule))
    assert r.step_s == pytest.approx(_cost().step_s(schedule) + 0.5 * (schedule != Schedule.plain))
    assert r.exposed_comm_s == pytest.approx(
        simulate(_cost(), schedule).exposed_comm_s + 0.5 * (schedule != Schedule.plain)
    )


@pytest.mark.parametrize("schedule", [Schedule.plain, Schedule.sparse_dist])
def test_the_all_reduces_cpu_work_holds_the_update_back_by_what_outlasts_the_gradients(
    schedule,
) -> None:
    """The all-reduce's CPU work (5.0 here) starts with the gradient exchange (4.0 on the
    wire) and takes the rank's core before the lookups' backward (2.0): the update ends 3.0
    after the gradients, not 2.0, and the all-reduce (1.5 on the wire) stays hidden."""
    cpu = {"ids": [0.0, 0.0], "emb": [0.0, 0.0], "allreduce": [5.0, 5.0]}
    cost = replace(_cost(dense=40.0), comm_cpu_s=cpu)
    assert cost.backward_tail_s(4.0) == pytest.approx(3.0)
    assert _cost().backward_tail_s(4.0) == pytest.approx(2.0)
    assert simulate(cost, schedule).step_s == pytest.approx(cost.step_s(schedule))
    assert cost.step_s(schedule) == pytest.approx(_cost(dense=40.0).step_s(schedule) + 1.0)


def test_nested_chunks_cpu_work_lengthens_the_dense_work_it_runs_beside() -> None:
    """nested4 under 40 s of dense work: the forward chunks' CPU work (4 x 0.25) runs after
    the next lookups, before the overheads (0.5), so the first chunk (1.0 on the wire) is
    waited for 0.5 longer; the next batch's ids' (0.5) and three gradient chunks'
    (3 x 0.25) lengthen the dense work; the last gradient chunk's runs beside its own
    exposed transfer. The closed form charges the micro-batches the ids' and 3/4 of both
    exchanges' CPU work (0.5 + 1.5) instead: 0.25 more."""
    from dataclasses import replace

    no_cpu = _cost(dense=40.0)
    cost = replace(no_cpu, comm_cpu_s=CPU)
    simulated = simulate(cost, Schedule.nested, 4).step_s
    assert simulated == pytest.approx(simulate(no_cpu, Schedule.nested, 4).step_s + 0.5 + 1.25)
    closed = cost.step_s(Schedule.nested, 4)
    assert closed == pytest.approx(no_cpu.step_s(Schedule.nested, 4) + 2.0)
    assert closed - simulated == pytest.approx(0.25)


def test_an_exchange_split_by_link_takes_its_slower_link_and_copies_hide_when_prefetched() -> None:
    from dataclasses import replace

    cost = _cost(dense=10.0, emb=4.0, ids=1.0)
    split = replace(
        cost,
        emb_a2a_parts_s={"nic": [4.0, 4.0], "fabric": [1.0, 1.0]},
        ids_a2a_parts_s={"nic": [0.5, 0.5], "fabric": [1.0, 1.0]},
        allreduce_link="nic",
    )
    for schedule in (Schedule.plain, Schedule.sparse_dist):  # each exchange: its slower link
        assert simulate(split, schedule).step_s == pytest.approx(cost.step_s(schedule))
    timeline = simulate(split, Schedule.plain).timeline
    assert {timeline.resources[t].split(":")[0] for t in timeline.spans if "@" in t} == {
        "compute",
        "nic",
        "fabric",
        "h2d",
        "host",
    }
    # the batch's copy to the device: exposed in the plain loop, under SparseDist's dense work
    copied = replace(split, input_copy_s=[2.0, 2.0])
    assert simulate(copied, Schedule.plain).step_s == pytest.approx(cost.step_s() + 2.0)
    assert simulate(copied, Schedule.sparse_dist).step_s == pytest.approx(
        cost.step_s(Schedule.sparse_dist)
    )
    # and the host's batch assembly before it: in the plain loop on the way, pipelined ahead
    # (a floor once it is the longest resource)
    fed = replace(copied, host_input_s=[3.0, 1.0])
    assert simulate(fed, Schedule.plain).step_s == pytest.approx(cost.step_s() + 5.0)
    assert simulate(fed, Schedule.plain).step_s == pytest.approx(fed.step_s(Schedule.plain))
    slow = replace(copied, host_input_s=[40.0, 1.0])
    assert simulate(slow, Schedule.sparse_dist).step_s == pytest.approx(40.0)
    assert slow.step_s(Schedule.sparse_dist) == pytest.approx(40.0)
    assert simulate(copied, Schedule.plain).exposed_comm_s == pytest.approx(
        simulate(split, Schedule.plain).exposed_comm_s
    )  # a copy is not communication
