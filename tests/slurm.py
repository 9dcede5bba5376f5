"""A real one-machine Slurm cluster for the tests: munged, slurmctld and slurmd (Debian's
packages, which `make test` installs where it can: `make local-slurm`) started in a
temporary directory with a key, state, spool, logs and ports of their own, and stopped after.
Its partition has this machine's CPUs; accounting is off (no slurmdbd), so submitit warns on
every poll that `sacct` fails and falls back to squeue."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def why_not() -> str | None:
    """Why no local Slurm cluster can run here (None: it can)."""
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): `make local-slurm` "
            f"installs Debian's slurmd, slurmctld, slurm-client and munge as root"
        )
    if os.geteuid() != 0:
        return "a local Slurm cluster runs its daemons as root; this user is not"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _conf(root: Path, host: str) -> str:
    cpus = len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as f:
        mem_mb = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) // 2048
    munge = root / "munge" / "munge.socket"
    return f"""ClusterName=recsystest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def local_slurm(root: Path, timeout_s: float = 60) -> Iterator[dict[str, str]]:
    """The cluster up; yields the environment its clients need (SLURM_CONF)."""
    munge = root / "munge"
    for d in (munge, root / "state", root / "spool"):
        d.mkdir(parents=True)
    munge.chmod(0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, socket.gethostname()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []
    subprocess.run(
        [
            _binary("munged"),
            f"--key-file={key}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'seed'}",
            "--force",
        ],
        check=True,
    )
    try:
        for daemon in ("slurmctld", "slurmd"):
            log = open(root / f"{daemon}.out", "w")  # noqa: SIM115 - the daemon's for its life
            # a session of their own: nothing they signal reaches the tests' processes
            procs.append(
                subprocess.Popen(
                    [_binary(daemon), "-D", "-f", str(conf)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True
            ).stdout.split()
            if out and all(s == "idle" for s in out):
                break
            if time.monotonic() > deadline:
                logs = "".join(
                    (root / f).read_text()[-1500:] for f in ("slurmctld.out", "slurmd.out")
                )
                raise RuntimeError(f"the local Slurm cluster did not come up: {out}\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        pid = munge / "munged.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass


def processes_with(marker: str) -> list[str]:
    """Command lines of live processes that contain `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{d.name}: {cmd.strip()}")
    return found
