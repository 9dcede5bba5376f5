"""Two network namespaces joined by a veth pair, rate-limited with tbf: a real, slower link
between two ranks on one machine. Needs root and iproute2. Traffic stays inside the two
namespaces this makes; both are removed on exit, also after an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_PREFIX = "recsys"


@dataclass(frozen=True)
class VethLink:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    ifnames: tuple[str, str]
    rate: str

    def prefix(self, side: int) -> list[str]:
        """Command prefix that runs a program inside namespace `side` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[side]]


def available() -> str | None:
    """None if a veth link can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def veth_link(rate: str = "1gbit", tag: str | None = None) -> Iterator[VethLink]:
    tag = tag or str(os.getpid() % 100000)
    ns = (f"{_PREFIX}{tag}a", f"{_PREFIX}{tag}b")
    ifs = (f"rv{tag}a", f"rv{tag}b")
    addrs = ("10.231.7.1", "10.231.7.2")  # inside our own namespaces only
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", ifs[0], "netns", ns[0], "type", "veth", "peer", "name", ifs[1],
             "netns", ns[1])  # fmt: skip
        for n, i, a in zip(ns, ifs, addrs, strict=True):
            _run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", i)
            _run("ip", "-n", n, "link", "set", i, "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
            _run("tc", "-n", n, "qdisc", "add", "dev", i, "root", "tbf", "rate", rate,
                 "burst", "256kb", "latency", "50ms")  # fmt: skip
        yield VethLink(ns, addrs, ifs, rate)
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
