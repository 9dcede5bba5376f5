"""Training batches built ahead of the step: a worker thread makes the next `depth` batches
(reading, hashing, the split tables' id remap) and, for a GPU rank, pins their memory, so
the step's `next()` takes a finished batch and its copy to the device can overlap compute
(`non_blocking=True` gains nothing from pageable memory). The batches and their order are
the source's own: a batch is a pure function of (split, index, rank).

`InputStats` counts, either way (depth 0: built on the training thread when asked for), the
time each batch took to build and the time the training thread waited for one: input is off
the critical path when the wait is near zero (summary.json's `input`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_END = object()


@dataclass
class InputStats:
    batches: int = 0
    build_s: float = 0.0  # building them (on the worker thread when prefetching)
    wait_s: float = 0.0  # the training thread waiting in next()

    def summary(self, depth: int, pinned: bool) -> dict[str, Any]:
        per = 1000 / max(self.batches, 1)
        return {
            "prefetch_batches": depth,
            "pinned": pinned,
            "batches": self.batches,
            "build_ms_per_batch": self.build_s * per,
            "wait_ms_per_batch": self.wait_s * per,
        }


@dataclass
class _Failed:
    error: BaseException


class Prefetched(Iterator):
    """`batches`, each built `depth` ahead on a worker thread (0: on the caller's, when
    asked for), pinned if `pin`; an error building one is raised where that batch would
    have been returned. `close()` (or the end of the batches) stops the worker."""

    def __init__(self, batches: Iterator, depth: int, pin: bool, stats: InputStats) -> None:
        self._batches, self._pin, self.stats = batches, pin, stats
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if depth > 0:
            self._queue = queue.Queue(maxsize=depth)
            self._worker = threading.Thread(target=self._fill, name="prefetch", daemon=True)
            self._worker.start()

    def _build(self) -> Any:
        start = time.perf_counter()
        batch = next(self._batches)
        if self._pin:
            batch = batch.pin_memory()
        self.stats.build_s += time.perf_counter() - start
        return batch

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._build()
            except StopIteration:
                item = _END
            except BaseException as e:  # noqa: BLE001 - raised on the training thread
                item = _Failed(e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is _END or isinstance(item, _Failed):
                return

    def __next__(self) -> Any:
        start = time.perf_counter()
        if self._queue is None:
            item = self._build()  # StopIteration ends the iteration
        else:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # asked again: still the end
                raise StopIteration
            if isinstance(item, _Failed):
                self._queue.put(item)  # asked again: the same error
                raise item.error
        self.stats.wait_s += time.perf_counter() - start
        self.stats.batches += 1
        return item

    def close(self) -> None:
        self._stop.set()
