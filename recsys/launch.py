"""Start ranks: spawn local gloo processes, or join a torchrun / Slurm launch.

Every distributed wait has a timeout: the process group's (`timeout_s`) for collectives,
and the spawner's own deadline for the whole job. A rank that dies or hangs makes the
others fail with an error that names it, never a hang.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, forkserver, reduction, resource_tracker
from multiprocessing.context import ForkServerProcess
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from recsys import reaper
from recsys.interrupts import die_when_closed, die_with_parent, ignore_further, signum

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_S = 15.0  # stopped ranks get this long to write what they have before SIGKILL


class RankFailedError(RuntimeError):
    """One or more ranks of a job failed; the message names them and their errors,
    `first_failure` the likely cause in one line."""

    first_failure: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_externally() -> bool:
    """True under torchrun (RANK/WORLD_SIZE set) or inside a multi-task Slurm job step."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def external_rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's world size as torchrun or Slurm set them."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])


def init_distributed(timeout_s: float, backend: str = "gloo") -> tuple[int, int]:
    """Join the process group from env:// (torchrun, our spawner) or Slurm via submitit.

    Backend: gloo unless told; never from `torch.cuda.is_available()`: the trainer passes
    its cluster's (`recsys.trainer.build.backend_for`: NCCL for GPU clusters), and the CPU
    link probes (`benchmarks.comm_probe`) and test jobs run gloo on CPU tensors wherever
    they run.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        # MASTER_PORT from the job's environment where set (submitit's default is drawn
        # from the job id), the rest from Slurm's
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    missing = [k for k in _ENV_KEYS if k not in os.environ]
    if missing:
        raise RuntimeError(f"cannot join the process group: environment lacks {missing}")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed(clean: bool) -> None:
    """Leave the process group. After a clean run, wait for every rank first: tearing gloo
    down while a peer still talks to it can abort that peer."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


@dataclass
class LaunchResult:
    results: list[Any]  # what each rank's function returned (None where it failed)
    exitcodes: list[int | None]  # None: still running when killed at the deadline
    errors: dict[int, str]  # rank -> traceback text, in the order the failures were seen


@dataclass(frozen=True)
class Placement:
    """Where a rank runs other than this machine's own network and cores: its environment
    (over torchrun's local one), a network namespace to join (`/var/run/netns/<netns>`) and
    a cgroup to join (a directory under the cgroup filesystem). `recsys.emulation` places
    each rank of an emulated node so."""

    env: dict[str, str]
    netns: str | None = None
    cgroup: str | None = None


_CLONE_NEWNET = 0x40000000


def _join_netns(name: str) -> None:
    """This process (one thread: just forked) into the network namespace `name`; the
    threads and sockets it makes from now on live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as ns:
        if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"joining network namespace {name}: {os.strerror(err)}")


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple,
    out: Any,
    alive: int,
    env: dict[str, str],
    fds: tuple[int, int],
    place: Placement | None,
) -> None:
    # forked by the fork server, whose life this rank prolongs: it watches the launcher
    die_with_parent()
    # Ctrl-C stops a rank even where the fork server started with it ignored (its launcher
    # passes on the stop signal it received: `stop_ranks`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_when_closed(alive)
    os.environ.clear()  # the launcher's environment now, not the fork server's at its start
    os.environ.update(env)
    for fd, target in zip(fds, (1, 2), strict=True):  # and its stdout and stderr now
        os.dup2(fd, target)
        os.close(fd)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if place is not None:
        os.environ.update(place.env)
        if place.netns:
            _join_netns(place.netns)
        if place.cgroup:  # from now on under its CPU quota (the stack is imported already)
            Path(place.cgroup, "cgroup.procs").write_text(str(os.getpid()))

    def report(status: str, payload: Any) -> None:
        out.put((rank, status, payload))
        out.close()
        out.join_thread()  # the result reaches the parent whatever happens below

    run_and_exit(fn, args, report)


def run_and_exit(fn: Callable[..., Any], args: tuple, report: Callable[[str, Any], None]) -> None:
    """A rank's life: `fn(*args)`, `report("ok", result)` or `report("error", traceback)`,
    leave the process group, exit (0 or 1)."""
    try:
        status, payload, code = "ok", fn(*args), 0
    except BaseException:  # noqa: B036 - report everything, then exit non-zero
        status, payload, code = "error", traceback.format_exc(), 1
    # a stop signal now (Ctrl-C reaches a rank twice: from the terminal and from its
    # launcher) must not cut the report short; the launcher kills a rank that lingers
    ignore_further()
    report(status, payload)
    shutdown_distributed(clean=code == 0)
    exit_now(code)


def exit_now(code: int) -> None:
    """Flush, then leave without interpreter teardown. Some native thread (torch / gloo /
    fbgemm) is sometimes still joinable at exit and its destructor aborts the process
    ("terminate called without an active exception", exit -6) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# what the fork server imports once, before it forks ranks (a module it cannot import is
# skipped; each rank imports what it needs in any case)
_PRELOAD = ["torch", "torchrec", "recsys.trainer.loop"]
# the arguments of multiprocessing.forkserver.main this was written against (Python 3.11)
_SERVER_ARGS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def serve_forks_from_here() -> bool:
    """Make the fork server `spawn_ranks` uses a fork of this process as it is now, and say
    whether it did.

    A command's entry calls it first, before any work: then its ranks start from the
    training stack this process has already imported, where multiprocessing's own fork
    server would start a fresh interpreter and import it again (seconds of CPU, and of
    waiting, per command). The server is forked before the command has done anything, so
    its ranks still share nothing with the command's later state but what is pickled to
    them, as with multiprocessing's server. Where this Python's fork server is not the one
    this was written against (`_SERVER_ARGS`), or a server already runs, or torchrun or
    Slurm started this process as a rank, it does nothing (and `spawn_ranks` starts
    multiprocessing's own)."""
    server = forkserver._forkserver
    if launched_externally() or list(inspect.signature(forkserver.main).parameters) != _SERVER_ARGS:
        return False  # torchrun or Slurm started this rank; or another Python's fork server
    for name in _PRELOAD:
        importlib.import_module(name)
    with server._lock:
        if server._forkserver_pid is not None:
            return False
        resource_tracker.ensure_running()  # before the fork: the ranks share this one
        address = connection.arbitrary_address("AF_UNIX")
        reaper.guard().watch_dir(os.path.dirname(address))  # gone even if this is killed
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # as multiprocessing's: it ends once no client is left
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the server: serves until every client has gone, never returns
                code = 1
                try:
                    os.close(alive_w)
                    forkserver.main(listener.fileno(), alive_r, [])
                except SystemExit:
                    code = 0
                finally:
                    os._exit(code)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


class _Fd:
    """The launcher's file descriptor `fd` as it is when a rank starts, sent to the forked
    rank (it would otherwise write to the fork server's, fixed when the server started)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:  # pickled while the rank starts: the fd goes with it
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return dup.detach()


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 3600.0,
    grace_s: float = 20.0,
    placements: Sequence[Placement] | None = None,
) -> LaunchResult:
    """Run `fn(*args)` in `world_size` fresh processes on a free local port (`placements`:
    rank r in `placements[r]`'s namespace and cgroup, with its environment).

    `fn` must be importable (it is pickled by name). Once a rank fails, the others get
    `grace_s` seconds to fail on their own (they should: their collectives error out or time
    out) before they are killed; after `timeout_s` every rank still running is killed.

    The ranks are forked by multiprocessing's fork server, which imports the training stack
    once (TorchRec takes seconds to import) and then forks each rank of every job this
    process starts; like spawned ones, they share no state with this process but what is
    pickled to them (and its environment, set in each rank).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    out = ctx.Queue()
    port = free_port()
    alive_r, alive_w = os.pipe()  # the ranks read; they stop once this end closes
    rank_args = (world_size, port, args, out, _Fd(alive_r), dict(os.environ), (_Fd(1), _Fd(2)))
    places = list(placements) if placements is not None else [None] * world_size
    procs = [
        _ForkedRank(target=_rank_entry, args=(fn, r, *rank_args, places[r]), daemon=False)
        for r in range(world_size)
    ]

    def reports(block_s: float) -> list[tuple[int, str, Any]]:
        try:
            return [out.get(timeout=block_s)]
        except queue.Empty:
            return []

    try:
        try:
            for p in procs:
                p.start()
        finally:
            os.close(alive_r)
        return supervise(procs, reports, timeout_s, grace_s)
    finally:  # every rank started ends once this closes, whatever happened here
        os.close(alive_w)


class RankProcess(Protocol):
    """What `supervise` needs of a rank's process (multiprocessing.Process has it)."""

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...

    def join(self) -> None: ...


class _ForkedRank(ForkServerProcess):
    """A rank forked by the fork server, as `supervise` sees a process."""

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


class PopenRank:
    """A rank started as a command (`subprocess.Popen(..., start_new_session=True)`) as
    `supervise` sees a process: signals go to its whole process group."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def join(self) -> None:
        self.popen.wait()


def supervise(
    procs: Sequence[RankProcess],
    reports: Callable[[float], list[tuple[int, str, Any]]],
    timeout_s: float,
    grace_s: float,
) -> LaunchResult:
    """Wait for every rank; `reports(block_s)` returns the (rank, "ok" | "error", payload)
    reports that arrived within `block_s`. Once a rank fails, the others get `grace_s` to
    fail on their own, then are killed; after `timeout_s` every rank still running is."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s

    def drain(block_s: float) -> int:
        got = reports(block_s)
        for rank, status, payload in got:
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
        return len(got)

    def note_dead_ranks() -> None:
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in errors:
                drain(0.5)  # its own report may still be on its way
                errors.setdefault(r, _silent_exit(p.exitcode))

    try:
        _wait(procs, drain, note_dead_ranks, errors, deadline, timeout_s, grace_s)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (recsys.interrupts): every rank first
        stop_ranks(procs, signum(e))
        raise
    for p in procs:
        p.join()
    while any(results[r] is None and r not in errors for r in range(world_size)):
        if not drain(1.0):  # results a rank sent just before it exited
            break
    note_dead_ranks()
    return LaunchResult(results=results, exitcodes=[p.exitcode for p in procs], errors=errors)


def _silent_exit(code: int) -> str:
    """What a rank that ended without a report most likely met, by its exit code."""
    why = {
        -signal.SIGABRT: "a native abort, e.g. NCCL's watchdog ending a collective that timed "
        "out (trainer.dist_timeout_s) or a failed check in gloo or FBGEMM",
        -signal.SIGKILL: "killed by SIGKILL, e.g. by the kernel's OOM killer (a smaller "
        "trainer.batch_size or model) or by a user",
        -signal.SIGSEGV: "a crash in native code",
    }.get(code, "a native abort")
    return (
        f"exited with code {code} without reporting an error ({why}: its message is in "
        f"the run's log)"
    )


def stop_ranks(
    procs: Sequence[RankProcess], sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S
) -> None:
    """`sig` to every rank still running (each stops, rank 0 writing the summary so far),
    then SIGKILL to any still running `grace_s` later. A launcher passes on the signal it
    received: a rank records the first that reached it, and Ctrl-C reaches the ranks both
    from the terminal and from their launcher, in either order."""
    for p in procs:
        if p.is_alive():
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def _wait(procs, drain, note_dead_ranks, errors, deadline, timeout_s, grace_s) -> None:
    """`supervise`'s loop: until every rank has exited, or killed at a deadline."""
    first_failure: float | None = None
    while any(p.is_alive() for p in procs):
        drain(0.2)
        note_dead_ranks()
        now = time.monotonic()
        if errors and first_failure is None:
            first_failure = now
        timed_out = now > deadline
        if timed_out or (first_failure is not None and now - first_failure > grace_s):
            why = (
                f"still running at the job deadline ({timeout_s:.0f} s); killed"
                if timed_out
                else f"still running {grace_s:.0f} s after another rank failed; killed (hung?)"
            )
            for r, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                    errors.setdefault(r, why)
            return


# what a rank's last error line means, and what to do; first match wins
KNOWN_FAILURES = (
    (
        ("Connection closed by peer", "Connection reset by peer", "Broken pipe"),
        "it lost a peer: another rank failed first",
    ),
    (
        ("Timed out", "timed out", "Timeout", "timeout caused pair closure"),
        "a peer hung, died or was too slow; see the other ranks (trainer.dist_timeout_s)",
    ),
    (
        ("can't allocate memory", "MemoryError", "out of memory"),
        "out of memory: a smaller trainer.batch_size or model, or a cluster with more memory",
    ),
)


def known_fix(error_line: str) -> str | None:
    for needles, fix in KNOWN_FAILURES:
        if any(n in error_line for n in needles):
            return fix
    return None


# A root cause that the last line of a traceback hides: a write that failed for want of disk
# (torch's zip writer then says "unexpected pos 704 vs 598"; DCP wraps it again)
_DISK_FULL = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


def cause_line(text: str) -> str:
    """The line of a rank's error that names its cause: the outermost line that mentions a
    full disk (it says what was being written), else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    full = next((line for line in reversed(lines) if any(d in line for d in _DISK_FULL)), None)
    if full is not None:
        return f"disk full (ENOSPC): {full} [free space there, or write elsewhere]"
    return lines[-1] if lines else "no message"


def first_cause(errors: dict[int, str]) -> int:
    """The rank whose failure most likely started it: the first seen that is not a
    consequence of another's (a lost peer or a collective timeout). A rank killed outright
    (SIGKILL, out of memory) reports nothing, so its peers' lost connections are often
    seen first."""
    consequences = KNOWN_FAILURES[0][1], KNOWN_FAILURES[1][1]
    for r, text in errors.items():
        if text.strip() and known_fix(cause_line(text)) not in consequences:
            return r
    return next(iter(errors))


# NCCL's watchdog, in a rank's native stderr (the run's log) before it aborts the rank:
# "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST,
# NumelIn=.., NumelOut=.., Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
_NCCL_TIMEOUT = re.compile(
    r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), "
    r"OpType=(\w+)[^)]*?Timeout\(ms\)=(\d+)\)"
)


def nccl_timeouts(log_text: str) -> dict[int, str]:
    """Per rank, the collective NCCL's watchdog timed out (the first such line of each), as
    one line naming it: what a rank that aborts on it never reports itself."""
    found: dict[int, str] = {}
    for m in _NCCL_TIMEOUT.finditer(log_text):
        rank, seq, op, ms = int(m[1]), m[2], m[3], int(m[4])
        found.setdefault(
            rank,
            f"NCCL's watchdog aborted it: collective #{seq} ({op}) timed "
            f"out after {ms / 1000:g} s (trainer.dist_timeout_s)",
        )
    return found


def _named_timeouts(launch: LaunchResult, log_file: Path | None) -> dict[int, str]:
    """The ranks' errors, each silent exit that NCCL's watchdog explains in the run's log
    replaced by what timed out."""
    errors = dict(launch.errors)
    silent = [r for r, text in errors.items() if text.startswith("exited with code")]
    if silent and log_file is not None and log_file.exists():
        timeouts = nccl_timeouts(log_file.read_text(errors="replace")[-2_000_000:])
        for r in silent:
            if r in timeouts:
                errors[r] = f"{errors[r]}\n{timeouts[r]}"
    return errors


def raise_on_failure(launch: LaunchResult, what: str, log_file: Path | None = None) -> list[Any]:
    """The per-rank results, or RankFailedError with one line per failed rank (its last
    error line and, when known, what it means). The tracebacks are appended to `log_file`
    when given (the run's log), else the first failure's is part of the message."""
    if not launch.errors and all(c == 0 for c in launch.exitcodes):
        return launch.results
    launch = LaunchResult(launch.results, launch.exitcodes, _named_timeouts(launch, log_file))
    lines = [f"{what} failed on {len(launch.errors)} of {len(launch.exitcodes)} ranks:"]
    same: dict[str, list[int]] = {}  # one line per distinct error, naming its ranks
    for r in launch.errors:
        same.setdefault(cause_line(launch.errors[r]), []).append(r)
    for last, ranks in same.items():
        fix = known_fix(last)
        who = (
            f"rank {ranks[0]} (exit code {launch.exitcodes[ranks[0]]})"
            if len(ranks) == 1
            else f"ranks {', '.join(map(str, ranks))} (the same error)"
        )
        lines.append(f"  {who}: {last[:400]}" + (f" [{fix}]" if fix else ""))
    first = first_cause(launch.errors)
    try:
        if log_file is None:
            raise OSError("no log file")
        with open(log_file, "a") as f:
            for r, text in launch.errors.items():
                f.write(f"\n===== {what}: rank {r} (exit code {launch.exitcodes[r]}) =====\n")
                f.write(text.rstrip() + "\n")
        lines.append(f"  every rank's traceback: {log_file} (first failure: rank {first})")
    except OSError:  # no log, or it cannot be written (a full disk): the traceback here
        lines.append(f"First failure, rank {first}:\n{launch.errors[first]}")
    error = RankFailedError("\n".join(lines))
    error.first_failure = f"rank {first}: {cause_line(launch.errors[first])[:300]}"
    raise error
