"""Progress every command shows: a tqdm bar on a terminal; elsewhere (a log file, a pipe, a
scheduler's output file) a plain line once the first unit is done (the work has started),
then every tenth of the work or 30 s, whichever comes first, never a wall of `\\r`."""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm import tqdm


class Progress:
    """`total` units of work from `initial`; `update(n)` as they are done. `loss=True`: the
    line carries the loss last given to `set_postfix` (training). `scale`: units per shown
    unit (1e6 for bytes shown as MB)."""

    def __init__(
        self,
        total: float,
        initial: float = 0,
        desc: str = "",
        unit: str = "step",
        enabled: bool = True,
        stream: IO[str] | None = None,
        loss: bool = False,
        scale: float = 1.0,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.enabled, self.total, self.desc, self.unit = enabled, total, desc, unit
        self.done = self.initial = self.shown_done = initial
        self.show_loss, self.loss, self.scale = loss, "", scale
        self.bar = tqdm(
            total=self._shown(total),
            initial=self._shown(initial),
            desc=desc,
            unit=unit,
            dynamic_ncols=True,
            file=self.stream,
            disable=not self.tty,
        )
        self.every = max(1.0, (total - initial) / 10)
        self.next = initial + self.every
        self.t0 = self.last = time.monotonic()

    def _shown(self, x: float) -> float:
        return x / self.scale if self.scale != 1 else x  # whole steps stay whole

    def set_postfix(self, loss: str) -> None:
        self.loss = loss
        self.bar.set_postfix(loss=loss)

    def update(self, n: float = 1) -> None:
        self.done += n
        self.bar.update(self._shown(n))
        now = time.monotonic()
        first = self.shown_done == self.initial
        due = first or self.done >= self.next or now - self.last >= 30 or self.done >= self.total
        if self.enabled and not self.tty and due and self.done > self.shown_done:
            self.shown_done = self.done
            self.next = (self.done // self.every + 1) * self.every
            self.last = now
            speed = (self.done - self.initial) / self.scale / max(now - self.t0, 1e-9)
            share = self.done / self.total if self.total else 1.0
            loss = f"loss {self.loss or 'n/a'}, " if self.show_loss else ""
            print(
                f"{self.desc}: {self.unit} {self.done / self.scale:,.0f}/"
                f"{self.total / self.scale:,.0f} ({share:.0%}), {loss}{speed:,.1f} "
                f"{self.unit}/s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
