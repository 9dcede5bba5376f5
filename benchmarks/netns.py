"""Two network namespaces joined by a veth pair, rate-limited with tbf: a real, slower link
between two ranks on one machine. Needs root and iproute2. Traffic stays inside the two
namespaces this makes; both are removed on exit, also after an error.

tbf's bucket (`burst`) refills while the link is idle, so a transfer that comes in chunks
with idle gaps between them (as a chunked all-to-all does) runs partly above the rate: a
real link has no such credit. `chunked_rate` measures it. On this machine (2026-11-30,
1200 Mbit/s, chunks of 128 KB to 1 MB with 5 ms gaps, `python -m benchmarks.link_probe`):
a 256 KB burst gave 1.2x to 3.7x the rate; 24 KB gave 0.92x to 0.93x, the same as a
continuous stream (tbf counts headers too). `peakrate` still lets a 64 KB GSO packet
through at once, which small chunks feel (32 KB chunks at 5x the rate).
`HONEST_BURST` is the burst with no credit to speak of.

tbf cuts a packet larger than its bucket into MTU-sized ones, in software, on the cores
that train. So each end's GSO packets are kept below the bucket (`gso_limit`): TCP then
hands the link ~21 KB packets, as it hands a NIC with segmentation offload 64 KB ones, and
tbf passes them whole. The shaping then costs far less CPU per byte: 4.2 ns/B against
11 ns/B with 1.5 KB packets in a scratch probe (2026-12-02, 800 Mbit/s bulk transfer, the
whole machine's CPU, not saved; chunked rate unchanged, 0.9x-1.0x), and 0.66 ns/B against
4.0 in `benchmarks.calibrate`'s fit of gloo's all-to-all (`LinkCost.cpu_s_per_byte`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from recsys.emulation import add_veth, address_end, run_tool, shape, sigterm_exits
from recsys.launch import PopenRank, stop_ranks, supervise

_PREFIX = "recsys"
HONEST_BURST = "24kb"  # tbf burst: chunked transfers no faster than a continuous stream
LEGACY_BURST = "256kb"  # the burst measured results before 2026-12 used (credit: see above)
GSO_MAX = 65536  # the kernel's default (and veth's largest without BIG TCP)
_REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class VethLink:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    ifnames: tuple[str, str]
    rate: str
    burst: str = HONEST_BURST

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


@contextmanager
def veth_link(
    rate: str = "1gbit",
    tag: str | None = None,
    burst: str = HONEST_BURST,
    gso_max_size: int | None = None,
) -> Iterator[VethLink]:
    """The link, shaped at `rate` with tbf's `burst`; each end's GSO packets at most
    `gso_max_size` bytes (None: `gso_limit(burst)`, which tbf passes whole)."""
    tag = tag or str(os.getpid() % 100000)
    ns = (f"{_PREFIX}{tag}a", f"{_PREFIX}{tag}b")
    ifs = (f"rv{tag}a", f"rv{tag}b")
    addrs = ("10.231.7.1", "10.231.7.2")  # inside our own namespaces only
    with sigterm_exits():  # a killed benchmark removes its namespaces too
        try:
            for n in ns:
                run_tool("ip", "netns", "add", n)
            add_veth(((ns[0], ifs[0]), (ns[1], ifs[1])))
            for n, i, a in zip(ns, ifs, addrs, strict=True):
                address_end(n, i, a)
                gso = gso_max_size or gso_limit(burst)
                run_tool("ip", "-n", n, "link", "set", i, "gso_max_size", str(gso))
                shape(n, i, rate, burst)
            yield VethLink(ns, addrs, ifs, rate, burst)
        finally:
            for n in ns:
                subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def gso_limit(burst: str) -> int:
    """The largest GSO packet (bytes) the link's sender builds: one that fits tbf's bucket,
    headers included, so tbf passes it whole instead of cutting it to the MTU in software."""
    return min(GSO_MAX, size_bytes(burst) * 7 // 8)


def tx_bytes(link: VethLink) -> int:
    """Bytes sent so far by both ends of the link (the kernel's interface counters)."""
    return sum(tx_bytes_by_side(link))


def tx_bytes_by_side(link: VethLink) -> list[int]:
    """Bytes sent so far by each end of the link: one direction each."""
    sent = []
    for side in (0, 1):
        out = subprocess.run(
            link.prefix(side) + ["cat", f"/sys/class/net/{link.ifnames[side]}/statistics/tx_bytes"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        sent.append(int(out.stdout.strip()))
    return sent


def rate_bits(rate: str) -> float:
    """tc's rate syntax in bits per second: '1200mbit' -> 1.2e9."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"link rate '{rate}': use tc's units, e.g. 400mbit or 1gbit")


def size_bytes(size: str) -> int:
    """tc's size syntax in bytes: '24kb' -> 24576."""
    units = {"kb": 1024, "mb": 1024**2, "b": 1}
    for unit, scale in units.items():
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * scale)
    raise ValueError(f"size '{size}': use tc's units, e.g. 24kb")


def chunked_rate(link: VethLink, chunk_bytes: int, gap_s: float = 0.005, chunks: int = 16) -> float:
    """The rate (bits/s) a chunked TCP transfer with `gap_s` idle between chunks achieves
    from side 1 to side 0, over the chunks' transfer times only."""
    import json

    port = 29500 + os.getpid() % 400
    args = [link.addresses[0], str(port), str(chunk_bytes), str(chunks)]
    probe = [sys.executable, "-m", "benchmarks.link_probe"]
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    receiver = subprocess.Popen(
        link.prefix(0) + probe + ["recv", *args],
        env=env,
        cwd=_REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sender = subprocess.run(
            link.prefix(1) + probe + ["send", *args, str(gap_s)],
            env=env,
            cwd=_REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        receiver.wait(timeout=30)
    finally:
        receiver.kill()
    if sender.returncode:
        raise RuntimeError(f"link probe failed: {sender.stderr[-1000:]}")
    return float(json.loads(sender.stdout.strip().splitlines()[-1])["bits_per_s"])


def _env_for(link: VethLink, rank: int, port: int) -> dict:
    """torchrun-style environment for rank `rank` of 2, rank 0 in the first namespace."""
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=link.addresses[0],
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=link.ifnames[rank],
        PYTHONPATH=str(_REPO),
    )


def run_pair(link: VethLink, args: list[str], timeout_s: float = 600) -> None:
    """Start rank 0 and rank 1 of `python <args>`, one in each namespace, supervised as every
    launcher's ranks are (`recsys.launch.supervise`): a rank that fails ends its peer after
    a grace, and the pair ends at `timeout_s`."""
    port = 29000 + os.getpid() % 1000
    with tempfile.TemporaryDirectory(prefix="recsys-pair-") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in (0, 1)]
        procs = []
        for r in (0, 1):
            with open(logs[r], "w") as out:
                cmd = link.prefix(r) + [sys.executable, *args]
                procs.append(
                    PopenRank(
                        subprocess.Popen(
                            cmd,
                            env=_env_for(link, r, port),
                            cwd=_REPO,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                )
        try:
            result = supervise(procs, lambda block_s: time.sleep(block_s) or [], timeout_s, 30.0)
        finally:
            stop_ranks(procs)
        if result.errors:
            tails = "\n".join(f"rank {r}: {log.read_text()[-2000:]}" for r, log in enumerate(logs))
            why = "; ".join(f"rank {r} {e}" for r, e in sorted(result.errors.items()))
            raise RuntimeError(f"a rank across the veth link failed ({why}):\n{tails}")


def train_pair(link: VethLink, overrides: list[str], steps: int, run_dir: Path) -> tuple[int, dict]:
    """`recsys.train` with `overrides` for `steps` steps, one rank on each side of the link
    (one thread each); returns the bytes the link carried and the run's summary, with the
    bytes each direction carried (`link_bytes_by_direction`: side 0's sends, then side 1's)."""
    import json

    before = tx_bytes_by_side(link)
    args = [
        "-m",
        "recsys.train",
        *overrides,
        f"trainer.max_steps={steps}",
        "trainer.progress_bar=false",
        "trainer.threads_per_rank=1",
        "dataset.eval_batches=1",
        "trainer.warmup_steps=5",
        f"hydra.run.dir={run_dir}",
    ]
    run_pair(link, args)
    sent = [after - b for after, b in zip(tx_bytes_by_side(link), before, strict=True)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return sum(sent), {**summary, "link_bytes_by_direction": sent}
