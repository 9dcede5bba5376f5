"""Two network namespaces joined by a veth pair, rate-limited with tbf: a real, slower link
between two ranks on one machine. Needs root and iproute2. Traffic stays inside the two
namespaces this makes; both are removed on exit, also after an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "recsys"
_REPO = Path(__file__).resolve().parents[1]


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


def tx_bytes(link: VethLink) -> int:
    """Bytes sent so far by both ends of the link (the kernel's interface counters)."""
    total = 0
    for side in (0, 1):
        out = subprocess.run(
            link.prefix(side) + ["cat", f"/sys/class/net/{link.ifnames[side]}/statistics/tx_bytes"],
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        total += int(out.stdout.strip())
    return total


def _env_for(link: VethLink, rank: int, port: int) -> dict:
    """torchrun-style environment for rank `rank` of 2, rank 0 in the first namespace."""
    return dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR=link.addresses[0], MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME=link.ifnames[rank], PYTHONPATH=str(_REPO))  # fmt: skip


def run_pair(link: VethLink, args: list[str], timeout_s: float = 600) -> None:
    """Start rank 0 and rank 1 of `python <args>`, one in each namespace; wait for both."""
    port = 29000 + os.getpid() % 1000
    procs = [
        subprocess.Popen(link.prefix(r) + [sys.executable, *args], env=_env_for(link, r, port),
                         cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(
                f"ranks across the veth link did not finish in {timeout_s} s"
            ) from None
    if any(p.returncode for p in procs):
        tails = "\n".join(o[-2000:] for o in outputs)
        raise RuntimeError(f"a rank across the veth link failed:\n{tails}")


def train_pair(link: VethLink, overrides: list[str], steps: int, run_dir: Path) -> tuple[int, dict]:
    """`recsys.train` with `overrides` for `steps` steps, one rank on each side of the link
    (one thread each); returns the bytes the link carried and the run's summary."""
    import json

    before = tx_bytes(link)
    args = ["-m", "recsys.train", *overrides, f"trainer.max_steps={steps}",
            "trainer.progress_bar=false", "trainer.threads_per_rank=1", "dataset.eval_batches=1",
            "trainer.warmup_steps=5", f"hydra.run.dir={run_dir}"]  # fmt: skip
    run_pair(link, args)
    return tx_bytes(link) - before, json.loads((run_dir / "summary.json").read_text())
