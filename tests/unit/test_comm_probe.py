"""The gloo link probe (`benchmarks.comm_probe`) that calibrates the links' constants."""

from __future__ import annotations

import time

from benchmarks.comm_probe import busy_core


def test_busy_core_keeps_a_thread_computing_while_the_caller_waits() -> None:
    """What the busy all-to-alls run under: the process burns CPU while its main thread
    sleeps (as a rank's main thread waits in a collective), and stops after."""
    start = time.process_time()
    with busy_core():
        time.sleep(0.3)
    during = time.process_time() - start
    assert during > 0.15, f"the busy thread computed {during:.3f} s of 0.3"
    start = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - start < 0.05  # it stopped
