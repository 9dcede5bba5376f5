"""An emulated mixed, multi-node cluster on this one machine (needs root).

A cluster layout with `emulation.enabled=true` runs as follows (tag T, nodes 0..n-1):
- each node is a network namespace `rx-T-n<i>` holding one end of a veth pair
  (`rx<k>n<i>`, address 10.232.0.<i+1>); the other end (`rx<k>s<i>`) sits on a bridge in a
  switch namespace `rx-T-sw`. tbf shapes both ends at `network.inter_node_gbit_s` with a burst
  too small to give chunked traffic credit (`emulation.burst`), so each node's NIC sends and
  receives at the nominal rate. Ranks of one node talk over that node's loopback (the
  kernel routes traffic to a local address through `lo`), unshaped;
- each rank runs in its own cpu cgroup `recsys-T/n<i>/r<rank>` with a CFS quota of its
  device entry's `share` of one core (cgroup v1 `cpu.cfs_quota_us` here; v2 `cpu.max` where
  that controller is mounted), with one intra-op thread, pinned where the layout says.
  `run_ranks` starts ranks as the local launcher does, forked by its fork server with the
  training stack imported (a 0.25 share would spend 4x as long on imports, which no step
  times); each joins its node's namespace and its own cgroup before the job runs. `exec`
  joins the node's cgroup before the command starts.

`emulated(spec)` sets it all up and removes every namespace, link and cgroup it made on
every exit path; `run_ranks` runs a function on every rank inside it, as `spawn_ranks`
does locally. The command line keeps an emulation up for other launchers (torchrun):

    python -m recsys.emulation up emu_2node       # make it; prints the torchrun commands
    python -m recsys.emulation exec emu_2node 0 -- torchrun ...   # in node 0's ns + cgroup
    python -m recsys.emulation down emu_2node     # remove it
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsys import reaper
from sharding.cluster import cfs_period_us, resolve_cluster
from sharding.errors import UserError
from sharding.resources import CONF_DIR
from sharding.types import ClusterSpec, RankDevice

REPO = Path(__file__).resolve().parents[1]
MASTER_PORT = 29500  # inside node 0's own namespace: nothing else listens there
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
_CGROUP_V2 = Path("/sys/fs/cgroup")


class EmulationError(UserError, RuntimeError):
    """An emulated cluster cannot be set up here; the message says why and what to do."""


def quota_periods(
    proc_cgroup: Path = Path("/proc/self/cgroup"), v1: Path = _CGROUP_V1, v2: Path = _CGROUP_V2
) -> tuple[int, int]:
    """This process's cgroup's CFS periods so far and how many of them it ran out of its
    quota in (`cpu.stat`'s nr_periods and nr_throttled; cgroup v1's cpu controller or v2):
    an emulated rank's, in its own cgroup. (0, 0) where no quota applies or none is found."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        _, controllers, path = line.split(":", 2)
        root = v2 if not controllers else v1 if "cpu" in controllers.split(",") else None
        stat = root / path.lstrip("/") / "cpu.stat" if root else None
        if stat is None or not stat.exists():
            continue
        fields = dict(row.split() for row in stat.read_text().splitlines() if row.strip())
        return int(fields.get("nr_periods", 0)), int(fields.get("nr_throttled", 0))
    return 0, 0


def link_rate(spec: ClusterSpec) -> str:
    """tc's rate for the layout's inter-node link: 0.2 Gbit/s -> '200mbit'."""
    return f"{spec.network.inter_node_gbit_s * 1000:g}mbit"


def _cgroup_root() -> tuple[Path, int] | None:
    """The cpu controller's mount and its cgroup version, or None."""
    controllers = _CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return _CGROUP_V2, 2
    if (_CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return _CGROUP_V1, 1
    return None


def _cpu_root() -> Path:
    """Where this machine's cpu cgroups live (v1's mount if none is found: names only)."""
    found = _cgroup_root()
    return found[0] if found else _CGROUP_V1


def refuse_reason(spec: ClusterSpec, ranks: list[RankDevice] | None = None) -> str | None:
    """None if `spec` can be emulated here, else one line: why not and what to do."""
    ranks = ranks or resolve_cluster(spec)
    name = f"emulated cluster '{spec.name}'"
    if os.geteuid() != 0:
        return (
            f"{name} needs root (it makes network namespaces and cpu cgroups): run as "
            f"root, or pick a local cluster such as cluster=local_cpu2"
        )
    if not shutil.which("ip") or not shutil.which("tc"):
        return f"{name} needs iproute2 (ip, tc): apt-get install iproute2"
    if _cgroup_root() is None:
        return f"{name} needs the cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 cpu)"
    cores = len(os.sched_getaffinity(0))
    total = sum(r.share or 1.0 for r in ranks)
    if total > cores + 1e-9:
        return (
            f"{name}: its ranks' shares add up to {total:g} cores but this machine offers "
            f"{cores}; lower nodes[..].devices[..].share (leave the host a margin)"
        )
    return None


def run_tool(*args: str) -> None:
    """One setup command (ip, tc); an EmulationError naming it and its message if it fails."""
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise EmulationError(f"`{shlex.join(args)}` failed: {out.stderr.strip()}")


# The pieces of a link between namespaces (made here and by benchmarks/netns.py's veth pair)


def add_veth(ends: tuple[tuple[str, str], tuple[str, str]]) -> None:
    """A veth pair: `((namespace, interface), (namespace, interface))`, one end in each."""
    (ns_a, if_a), (ns_b, if_b) = ends
    run_tool(
        "ip",
        "link",
        "add",
        if_a,
        "netns",
        ns_a,
        "type",
        "veth",
        "peer",
        "name",
        if_b,
        "netns",
        ns_b,
    )


def address_end(ns: str, ifname: str, address: str) -> None:
    """The end `ifname` in `ns` up at `address`/24, with its namespace's loopback."""
    run_tool("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
    run_tool("ip", "-n", ns, "link", "set", ifname, "up")
    run_tool("ip", "-n", ns, "link", "set", "lo", "up")


def shape(ns: str, ifname: str, rate: str, burst: str) -> None:
    """What leaves `ifname` goes at most `rate` (tc's units), tbf's bucket `burst`."""
    run_tool(
        "tc",
        "-n",
        ns,
        "qdisc",
        "add",
        "dev",
        ifname,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        burst,
        "latency",
        "50ms",
    )


@dataclass(frozen=True)
class Emulation:
    """Names of what an emulated cluster is made of (all derived from the tag)."""

    spec: ClusterSpec
    ranks: tuple[RankDevice, ...]
    tag: str

    @property
    def _k(self) -> int:  # interface names have at most 15 characters
        return zlib.crc32(self.tag.encode()) % 100_000

    @property
    def nodes(self) -> int:
        return max(r.node for r in self.ranks) + 1

    @property
    def switch_ns(self) -> str:
        return f"rx-{self.tag}-sw"

    def node_ns(self, node: int) -> str:
        return f"rx-{self.tag}-n{node}"

    def node_if(self, node: int) -> str:
        return f"rx{self._k}n{node}"

    def switch_if(self, node: int) -> str:
        return f"rx{self._k}s{node}"

    def address(self, node: int) -> str:
        return f"10.232.0.{node + 1}"

    @property
    def cgroup(self) -> Path:
        return _cpu_root() / f"recsys-{self.tag}"

    def node_cgroup(self, node: int) -> Path:
        return self.cgroup / f"n{node}"

    def rank_cgroup(self, rank: int) -> Path:
        return self.node_cgroup(self.ranks[rank].node) / f"r{rank}"

    def rank_env(self, rank: int, port: int = MASTER_PORT) -> dict[str, str]:
        """torchrun's environment for `rank`, its gloo traffic on its node's interface."""
        r = self.ranks[rank]
        on_node = [x for x in self.ranks if x.node == r.node]
        path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
        return dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(len(self.ranks)),
            LOCAL_RANK=str(r.local_rank),
            LOCAL_WORLD_SIZE=str(len(on_node)),
            MASTER_ADDR=self.address(0),
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME=self.node_if(r.node),
            PYTHONPATH=path,
            # c10d warns on every connection that a namespace has no hostname
            TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        )

    def command(self, node: int, cgroup: Path, argv: list[str]) -> list[str]:
        """`argv` run inside `cgroup` and node `node`'s namespace: the shell joins the
        cgroup before it execs, so nothing of the program runs outside its quota."""
        join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        return ["sh", "-c", join, str(cgroup), "ip", "netns", "exec", self.node_ns(node), *argv]

    def link_bytes(self) -> int:
        """Bytes the nodes have sent to each other so far (their veths' tx counters)."""
        total = 0
        for n in range(self.nodes):
            out = subprocess.run(
                ["ip", "-n", self.node_ns(n), "-j", "-s", "link", "show", "dev", self.node_if(n)],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )
            total += json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]
        return total


def _make_cgroup(path: Path, share: float | None, period_us: int, version: int) -> None:
    path.mkdir(exist_ok=True)
    quota = -1 if share is None else round(share * period_us)  # >= 1 ms: cfs_period_us
    if version == 1:
        (path / "cpu.cfs_period_us").write_text(str(period_us))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period_us}")


@contextmanager
def capped_cgroup(share: float, period_us: int) -> Iterator[Path]:
    """A cpu cgroup holding `share` of each `period_us` period, made as a rank's is (root),
    for a process to join by writing its pid to `cgroup.procs`; killed and removed after."""
    found = _cgroup_root()
    if os.geteuid() != 0 or found is None:
        raise EmulationError("a capped cgroup needs root and a cpu cgroup controller")
    root, version = found
    path = root / f"recsys-capped-{os.getpid()}"
    _make_cgroup(path, share, period_us, version)
    try:
        yield path
    finally:
        reaper.remove_cgroup(path)


def _enable_cpu_v2(path: Path) -> None:
    (path / "cgroup.subtree_control").write_text("+cpu")


def setup(emu: Emulation) -> None:
    """Make the namespaces, links and cgroups of `emu` (call `teardown` after, always)."""
    spec, rate = emu.spec, link_rate(emu.spec)
    burst = spec.emulation.burst
    run_tool("ip", "netns", "add", emu.switch_ns)
    run_tool("ip", "-n", emu.switch_ns, "link", "add", f"rx{emu._k}br", "type", "bridge")
    run_tool("ip", "-n", emu.switch_ns, "link", "set", f"rx{emu._k}br", "up")
    for n in range(emu.nodes):
        ns, node_if, switch_if = emu.node_ns(n), emu.node_if(n), emu.switch_if(n)
        run_tool("ip", "netns", "add", ns)
        add_veth(((ns, node_if), (emu.switch_ns, switch_if)))
        address_end(ns, node_if, emu.address(n))
        run_tool("ip", "-n", emu.switch_ns, "link", "set", switch_if, "master", f"rx{emu._k}br")
        run_tool("ip", "-n", emu.switch_ns, "link", "set", switch_if, "up")
        for where, dev in ((ns, node_if), (emu.switch_ns, switch_if)):
            shape(where, dev, rate, burst)
    version = (_cgroup_root() or (None, 1))[1]
    period = cfs_period_us(spec)
    _make_cgroup(emu.cgroup, None, period, version)
    if version == 2:
        _enable_cpu_v2(emu.cgroup)
    for n in range(emu.nodes):
        shares = [r.share for r in emu.ranks if r.node == n]
        node_share = None if None in shares else sum(s for s in shares if s is not None)
        _make_cgroup(emu.node_cgroup(n), node_share, period, version)
        if version == 2:
            _enable_cpu_v2(emu.node_cgroup(n))
        for r in emu.ranks:
            if r.node == n:
                _make_cgroup(emu.rank_cgroup(r.rank), r.share, period, version)


def teardown(emu: Emulation) -> list[str]:
    """Remove every namespace and cgroup of `emu` (whatever part of it exists; killing
    what still runs there; another emulation's, even one whose tag begins with this one's,
    is left alone); returns what it removed."""
    try:
        return reaper.remove_emulation(emu.tag, emu.cgroup)
    except RuntimeError as e:
        raise EmulationError(str(e)) from None


def leftovers(prefix: str) -> list[str]:
    """Namespaces and cgroups of every emulation whose tag starts with `prefix` that exist
    now (for tests: a run's tag is `<cluster>-<pid>`)."""
    cgroups = _cpu_root().glob(f"recsys-{prefix}*")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"rx-{prefix}")] + [str(p) for p in cgroups]


def dead_runs(name: str) -> list[str]:
    """Tags `<name>-<pid>` of emulated runs of the preset `name` whose launcher no longer
    runs but whose namespaces or cgroups are still here (it was killed outright)."""
    tags = {
        m[1]
        for x in leftovers(f"{name}-")
        if (m := re.search(rf"(?:rx-|recsys-)({re.escape(name)}-(\d+))(?:-|$)", x))
    }
    return sorted(t for t in tags if not _alive(int(t.rsplit("-", 1)[1])))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside, SIGTERM raises SystemExit (unless the program handles SIGTERM itself), so the
    `finally` blocks that remove namespaces, links and cgroups run when a run is killed."""
    restore = None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        restore = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)


@contextmanager
def emulated(spec: ClusterSpec, tag: str | None = None) -> Iterator[Emulation]:
    """The emulated cluster `spec`, removed again on every exit path (SIGTERM included)."""
    ranks = resolve_cluster(spec)
    why = refuse_reason(spec, ranks)
    if why:
        raise EmulationError(why)
    emu = Emulation(spec, tuple(ranks), tag or f"{spec.name}-{os.getpid()}")
    reaper.guard().watch_emulation(emu.tag, emu.cgroup)  # removed if this process is killed
    with sigterm_exits():
        try:
            teardown(emu)  # what a killed run with this tag left
            setup(emu)
            yield emu
        finally:
            teardown(emu)


def run_ranks(
    emu: Emulation,
    fn: Callable[..., Any],
    args: tuple = (),
    timeout_s: float = 3600.0,
    grace_s: float = 20.0,
):
    """`fn(*args)` on every rank of `emu`, each in its node's namespace and its own cgroup: the
    local launcher's ranks (`launch.spawn_ranks`, forked with the training stack imported),
    each placed there as it starts; a `launch.LaunchResult`. `fn` must be importable by name."""
    from recsys.launch import Placement, spawn_ranks

    places = [
        Placement(emu.rank_env(r.rank), emu.node_ns(r.node), str(emu.rank_cgroup(r.rank)))
        for r in emu.ranks
    ]
    return spawn_ranks(fn, len(emu.ranks), args, timeout_s, grace_s, places)


def _cluster(name: str) -> ClusterSpec:
    from hydra import compose, initialize_config_dir

    from recsys.config import cluster_overrides, register_configs, to_object

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=cluster_overrides(name))
    return to_object(cfg).cluster


def _cli_emulation(name: str) -> Emulation:
    spec = _cluster(name)
    if not spec.emulation.enabled:
        raise EmulationError(f"cluster '{name}' has no emulation section (emulation.enabled)")
    return Emulation(spec, tuple(resolve_cluster(spec)), name)


_USAGE = """usage: python -m recsys.emulation up|down CLUSTER
       python -m recsys.emulation exec CLUSTER NODE -- COMMAND...

up:   make the emulated cluster CLUSTER (a conf/cluster preset with emulation.enabled) and
      leave it up; prints each node's namespace, address and a torchrun command for it.
exec: run COMMAND inside node NODE's namespace and cpu cgroup (the node's ranks' shares
      together), e.g. one torchrun node.
down: remove it (kills what still runs inside), and what runs of CLUSTER left whose
      launcher was killed outright; a live run's emulation is left alone."""


def main(argv: list[str]) -> int:
    # plain argv, not Hydra: `exec` passes a whole command line through; clusters are still
    # composed by Hydra (_cluster)
    if len(argv) < 2 or argv[0] not in ("up", "down", "exec"):
        print(_USAGE, file=sys.stderr)
        return 2
    action, name = argv[0], argv[1]
    try:
        emu = _cli_emulation(name)
        if action == "down":  # the one `up` made, and runs of it whose launcher is dead
            removed = teardown(emu)
            for tag in dead_runs(name):
                removed += teardown(Emulation(emu.spec, emu.ranks, tag))
            print(f"removed {len(removed)}: {', '.join(removed) or 'nothing was up'}")
            return 0
        why = refuse_reason(emu.spec, list(emu.ranks))
        if why:
            raise EmulationError(why)
        if action == "up":
            teardown(emu)
            setup(emu)
            _print_up(emu)
            return 0
        if len(argv) < 4 or argv[3] != "--" or not argv[2].isdigit():
            print(_USAGE, file=sys.stderr)
            return 2
        node = int(argv[2])
        if not 0 <= node < emu.nodes or not emu.node_cgroup(node).exists():
            raise EmulationError(
                f"node {node} of '{name}' is not up: python -m recsys.emulation "
                f"up {name} (nodes 0..{emu.nodes - 1})"
            )
        env = dict(os.environ, GLOO_SOCKET_IFNAME=emu.node_if(node), OMP_NUM_THREADS="1")
        cmd = emu.command(node, emu.node_cgroup(node), argv[4:])
        return subprocess.run(cmd, env=env).returncode
    except EmulationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def torchrun_args(emu: Emulation, node: int, port: int = 29400) -> list[str]:
    """torchrun's arguments (after `torchrun`) for node `node`: every address is a
    namespace's own (the machine's hostname means nothing inside them), node 0 hosts the
    c10d store."""
    per_node = sum(r.node == node for r in emu.ranks)
    return [
        f"--nnodes={emu.nodes}",
        f"--nproc-per-node={per_node}",
        f"--node-rank={node}",
        "--rdzv-backend=c10d",
        "--rdzv-id=emu",
        f"--rdzv-endpoint={emu.address(0)}:{port}",
        f"--rdzv-conf=is_host={int(node == 0)}",
        f"--local-addr={emu.address(node)}",
    ]


def _print_up(emu: Emulation) -> None:
    per_node = [sum(r.node == n for r in emu.ranks) for n in range(emu.nodes)]
    print(
        f"emulated cluster '{emu.tag}' is up: {emu.nodes} nodes, {link_rate(emu.spec)} between them"
    )
    for n in range(emu.nodes):
        print(
            f"  node {n}: namespace {emu.node_ns(n)}, address {emu.address(n)}, "
            f"{per_node[n]} ranks, cgroup {emu.node_cgroup(n)}"
        )
    print("torchrun, one node per namespace (c10d rendezvous hosted by node 0):")
    for n in range(emu.nodes):
        torchrun = shlex.join(["torchrun", *torchrun_args(emu, n)])
        print(
            f"  python -m recsys.emulation exec {emu.tag} {n} -- {torchrun} -m recsys.train "
            f"cluster={emu.tag} hydra.run.dir=outputs/emu"
        )
    print(f"remove it: python -m recsys.emulation down {emu.tag}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
