"""Training batches built ahead on a worker thread (recsys/data/prefetch.py): the source's
batches in its order, built while the step runs, errors raised where their batch would be,
and the time to build and to wait for them counted either way."""

from __future__ import annotations

import time

import pytest

from recsys.data.prefetch import InputStats, Prefetched


def _slow(n: int, seconds: float, fail_at: int | None = None):
    for i in range(n):
        time.sleep(seconds)
        if i == fail_at:
            raise ValueError(f"batch {i} is malformed")
        yield i


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_the_batches_and_their_order_are_the_sources(depth: int) -> None:
    stats = InputStats()
    assert list(Prefetched(iter(range(20)), depth, False, stats)) == list(range(20))
    assert stats.batches == 20


def test_batches_are_built_while_the_step_runs() -> None:
    """8 batches of 30 ms each, consumed by a 30 ms step: built ahead, the step waits for the
    first only; built when asked for, it waits for each."""
    waits = {}
    for depth in (0, 2):
        stats = InputStats()
        for _ in Prefetched(_slow(8, 0.03), depth, False, stats):
            time.sleep(0.03)  # the step
        waits[depth] = stats
        assert stats.batches == 8 and stats.build_s >= 8 * 0.03
    assert waits[0].wait_s >= waits[0].build_s  # every build on the critical path
    assert waits[2].wait_s < 0.5 * waits[2].build_s


def test_an_error_is_raised_where_its_batch_would_have_been() -> None:
    for depth in (0, 2):
        got = []
        batches = Prefetched(_slow(5, 0.0, fail_at=3), depth, False, InputStats())
        with pytest.raises(ValueError, match="batch 3 is malformed"):
            for b in batches:
                got.append(b)
        assert got == [0, 1, 2]
        if depth:  # asked again: the same error, not a wait for a worker that has ended
            with pytest.raises(ValueError, match="batch 3"):
                next(batches)


def test_gpu_batches_are_pinned_on_the_worker() -> None:
    class Batch:
        pinned = False

        def pin_memory(self):
            pinned = Batch()
            pinned.pinned = True
            return pinned

    stats = InputStats()
    got = list(Prefetched(iter([Batch(), Batch()]), 2, True, stats))
    assert all(b.pinned for b in got)
    assert stats.summary(2, True)["pinned"] is True


def test_closing_stops_a_worker_waiting_on_a_full_queue() -> None:
    batches = Prefetched(iter(range(1000)), 2, False, InputStats())
    assert next(batches) == 0
    batches.close()
    batches._worker.join(timeout=2)
    assert not batches._worker.is_alive()
