"""What a command makes outside its own directories (an emulated cluster's network
namespaces and cpu cgroups, multiprocessing's socket directory) is removed even when the
command is killed outright.

`guard()` starts, once per process, a small process holding a pipe from this one; told what
to remove (`Guard.watch_dir`, `Guard.watch_emulation`), it removes all of it when the pipe
closes, that is when this process ends for any reason, SIGKILL included. The command removes
what it made itself on every other exit path; the guard's work is then already done. The
guard imports the standard library only: it runs as a script, without the training stack.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def namespaces(tag: str) -> list[str]:
    """The network namespaces of the emulation tagged `tag`: `rx-<tag>-sw`, `rx-<tag>-n<i>`
    (another tag that begins with `tag`, such as another run's, is not matched)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    mine = re.compile(rf"rx-{re.escape(tag)}-(sw|n\d+)")
    return [n for n in names if mine.fullmatch(n)]


def kill(pids: list[str] | list[int]) -> None:
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_cgroup(cgroup: Path, timeout_s: float = 10) -> None:
    """Kill what still runs in `cgroup` and its children, then remove them bottom-up;
    RuntimeError naming it if it stays."""
    if not cgroup.exists():
        return
    for child in sorted((p for p in cgroup.iterdir() if p.is_dir()), reverse=True):
        remove_cgroup(child, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        kill(pids)
        try:
            cgroup.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not remove cgroup {cgroup} (pids {pids})") from None
            time.sleep(0.05)


def remove_emulation(tag: str, cgroup: Path) -> list[str]:
    """Remove the namespaces of the emulation tagged `tag` (killing what runs there) and its
    cgroup tree `cgroup`; returns what it removed."""
    removed = namespaces(tag)
    for ns in removed:
        kill(
            subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout.split()
        )
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    if cgroup.exists():
        remove_cgroup(cgroup)
        removed.append(str(cgroup))
    return removed


class Guard:
    """The guard process of this process (module docstring); one line of JSON per thing to
    remove goes down the pipe."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,  # Ctrl-C to the command's group spares it
        )
        self.pid = os.getpid()

    def _tell(self, item: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(item) + "\n")
        self.proc.stdin.flush()

    def watch_dir(self, path: str | Path) -> None:
        self._tell({"dir": str(path)})

    def watch_emulation(self, tag: str, cgroup: Path) -> None:
        self._tell({"emulation": tag, "cgroup": str(cgroup)})


_GUARD: Guard | None = None


def guard() -> Guard:
    """This process's guard (a fork of a process with one gets its own)."""
    global _GUARD
    if _GUARD is None or _GUARD.pid != os.getpid():
        _GUARD = Guard()
    return _GUARD


def _main() -> None:
    """The guard: read what to remove until the pipe closes, then remove it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    items = [json.loads(line) for line in sys.stdin if line.strip()]
    for item in items:
        try:
            if "dir" in item:
                shutil.rmtree(item["dir"], ignore_errors=True)
            else:
                remove_emulation(item["emulation"], Path(item["cgroup"]))
        except Exception:  # noqa: BLE001, S110 - the rest still goes
            pass


if __name__ == "__main__":
    _main()
