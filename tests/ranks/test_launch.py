"""The gloo multi-process harness: per-rank results, exit codes, and no hangs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import rank_jobs
import torch
from support import sigint_default

from recsys.launch import (
    LaunchResult,
    PopenRank,
    RankFailedError,
    first_cause,
    known_fix,
    raise_on_failure,
    spawn_ranks,
    stop_ranks,
)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_run_a_collective_and_return_results(world: int) -> None:
    job = spawn_ranks(rank_jobs.all_reduce_rank, world, args=(30.0,), timeout_s=120)
    assert job.exitcodes == [0] * world and not job.errors
    expected = world * (world + 1) / 2
    assert [r["rank"] for r in job.results] == list(range(world))
    assert all(r["sum"] == expected and r["world"] == world for r in job.results)


def test_a_command_forks_its_ranks_from_a_fork_of_itself(tmp_path: Path) -> None:
    """`serve_forks_from_here`: the fork server is this command's child (no second
    interpreter importing the stack), its ranks still run collectives, it starts once, and
    it ends with the command."""
    command = textwrap.dedent("""
        import json, os, sys
        sys.path.insert(0, "tests")
        import rank_jobs
        from recsys import launch
        started = [launch.serve_forks_from_here(), launch.serve_forks_from_here()]
        server = launch.forkserver._forkserver._forkserver_pid
        with open(f"/proc/{server}/stat") as f:
            server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
        job = launch.spawn_ranks(rank_jobs.all_reduce_rank, 2, args=(30.0,), timeout_s=120)
        print(json.dumps({"pid": os.getpid(), "server": server, "server_parent": server_parent,
                          "started": started, "results": job.results}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", command],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    assert said["started"] == [True, False] and said["server_parent"] == said["pid"]
    assert [(r["sum"], r["parent"]) for r in said["results"]] == [(3.0, said["server"])] * 2
    stat, deadline = Path(f"/proc/{said['server']}/stat"), time.monotonic() + 30

    def server_runs() -> bool:  # a zombie has ended (no parent is left to reap it at once)
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    while server_runs():
        assert time.monotonic() < deadline, "the fork server outlived its command by 30 s"
        time.sleep(0.05)


def test_whatever_ends_rank_zeros_planning_reaches_every_rank_at_once() -> None:
    """TorchRec's collective_plan sends nothing when rank 0's planning raises, and a plan
    that does not pickle kills rank 0 inside the broadcast: the other ranks then wait out
    the collective timeout (here 60 s). Ours: the plan, or the same error on every rank."""
    job = spawn_ranks(rank_jobs.plans_sent_from_rank_zero, 2, args=(60.0,), timeout_s=120)
    results = raise_on_failure(job, "plans sent from rank 0")
    for r in results:
        (kind, plan, _), (fit, why, _), (pickled, said, _) = r["results"]
        assert (kind, plan) == ("plan", ["m"])
        assert fit == "PlanDoesNotFitError" and why.startswith("no plan fits: 3 GiB"), r
        assert pickled == ("AttributeError" if r["rank"] == 0 else "RuntimeError"), r  # pickle's
        assert "lambda" in said and (r["rank"] == 0 or "could not make or send" in said), r
        assert all(seconds < 30 for *_, seconds in r["results"]), r  # none waited it out


def test_a_rank_that_raises_fails_the_job_naming_it() -> None:
    start = time.monotonic()
    job = spawn_ranks(rank_jobs.one_rank_raises, 2, args=(30.0,), timeout_s=120, grace_s=20)
    assert time.monotonic() - start < 60
    assert job.exitcodes[1] == 1 and job.exitcodes[0] != 0
    assert "rank 1 broke on purpose" in job.errors[1]
    with pytest.raises(RankFailedError, match="rank 1 broke on purpose") as e:
        raise_on_failure(job, "toy job")
    assert "rank 1 (exit code 1)" in str(e.value)


def test_a_failure_is_one_line_per_rank_with_the_tracebacks_in_the_log(tmp_path: Path) -> None:
    rank0 = (
        'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: '
        "[pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    )
    rank1 = 'Traceback (most recent call last):\n  File "y.py", line 2\nValueError: bad row'
    job = LaunchResult(results=[None, None], exitcodes=[1, 1], errors={1: rank1, 0: rank0})
    log = tmp_path / "train.log"
    log.write_text("earlier lines\n")
    with pytest.raises(RankFailedError) as e:
        raise_on_failure(job, "training (2 ranks)", log)
    assert str(e.value).splitlines() == [
        "training (2 ranks) failed on 2 of 2 ranks:",
        "  rank 1 (exit code 1): ValueError: bad row",
        "  rank 0 (exit code 1): RuntimeError: [pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:4242 [it lost a peer: another rank failed first]",
        f"  every rank's traceback: {log} (first failure: rank 1)",
    ]
    text = log.read_text()
    assert text.startswith("earlier lines\n") and text.count("Traceback") == 2
    assert "rank 1 (exit code 1) =====\nTraceback" in text and 'File "x.py"' in text


def test_the_same_error_on_every_rank_is_one_line(tmp_path: Path) -> None:
    same = 'Traceback (most recent call last):\n  File "z.py", line 3\nNotImplementedError: no'
    job = LaunchResult(results=[None] * 3, exitcodes=[1, 1, 1], errors={2: same, 0: same, 1: same})
    with pytest.raises(RankFailedError) as e:
        raise_on_failure(job, "training (3 ranks)", tmp_path / "train.log")
    assert str(e.value).splitlines()[1:] == [
        "  ranks 2, 0, 1 (the same error): NotImplementedError: no",
        f"  every rank's traceback: {tmp_path / 'train.log'} (first failure: rank 2)",
    ]
    assert e.value.first_failure == "rank 2: NotImplementedError: no"


def test_a_rank_nccls_watchdog_aborted_is_named_by_its_collective(tmp_path: Path) -> None:
    """A GPU rank whose collective times out is aborted by NCCL's watchdog (SIGABRT) and
    reports nothing itself; the watchdog's line in the run's log (the rank's native stderr)
    names the collective. Here that line as ProcessGroupNCCL writes it."""
    log = tmp_path / "train.log"
    log.write_text(
        "[rank1]:[E1204 17:20:01.426415540 ProcessGroupNCCL.cpp:629] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=37, OpType=ALLTOALL_BASE, NumelIn=4096, "
        "NumelOut=4096, Timeout(ms)=120000) ran for 120081 milliseconds before timing out.\n"
    )
    silent = "exited with code -6 without reporting an error (a native abort ...)"
    job = LaunchResult(
        results=[None, None], exitcodes=[1, -6], errors={0: "ValueError: rank 0 broke", 1: silent}
    )
    with pytest.raises(RankFailedError) as e:
        raise_on_failure(job, "training (2 ranks)", log)
    line = str(e.value).splitlines()[2]
    said = (
        "  rank 1 (exit code -6): NCCL's watchdog aborted it: collective #37 (ALLTOALL_BASE) "
        "timed out after 120 s (trainer.dist_timeout_s)"
    )
    assert line.startswith(said)
    assert "[a peer hung, died or was too slow" in line
    assert e.value.first_failure == "rank 0: ValueError: rank 0 broke"  # the cause, not the wait


@pytest.mark.parametrize(
    ("line", "fix"),
    [
        ("RuntimeError: Connection reset by peer", "lost a peer"),
        (
            "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms",
            "a peer hung",
        ),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 8 bytes",
            "out of memory",
        ),
        ("ValueError: something else", None),
    ],
)
def test_known_failures_name_their_meaning(line: str, fix: str | None) -> None:
    got = known_fix(line)
    assert got is None if fix is None else fix in got


def test_the_first_cause_is_not_a_peer_that_lost_its_connection() -> None:
    lost = "Traceback ...\nRuntimeError: [gloo] Connection closed by peer [127.0.0.1]:123"
    killed = "exited with code -9 without reporting an error"
    assert first_cause({1: lost, 0: killed}) == 0
    assert first_cause({1: lost, 0: "RuntimeError: Timed out waiting 5000ms"}) == 1  # no cause
    assert first_cause({2: "ValueError: bad", 0: killed}) == 2  # the first seen of two causes


def test_a_hung_rank_makes_the_others_time_out_then_is_killed() -> None:
    start = time.monotonic()
    job = spawn_ranks(rank_jobs.one_rank_hangs, 2, args=(5.0,), timeout_s=120, grace_s=5)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert job.exitcodes[0] == 1  # rank 0's collective timed out: its own error
    assert job.exitcodes[1] not in (0, None)  # killed by the launcher
    assert "killed" in job.errors[1]


def test_the_job_deadline_kills_everything() -> None:
    start = time.monotonic()
    job = spawn_ranks(rank_jobs.one_rank_hangs, 2, args=(600.0,), timeout_s=8, grace_s=5)
    assert time.monotonic() - start < 40
    assert all(code not in (0, None) for code in job.exitcodes)
    assert "deadline" in job.errors[1]


def test_a_rank_that_ends_without_a_report_is_explained_by_its_exit_code() -> None:
    from recsys.launch import _silent_exit

    aborted, killed = _silent_exit(-6), _silent_exit(-9)
    assert aborted.startswith("exited with code -6 without reporting an error")
    assert "NCCL's watchdog" in aborted and "trainer.dist_timeout_s" in aborted
    assert "OOM killer" in killed and "its message is in the run's log" in killed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopping_launcher_passes_on_the_signal_it_received(tmp_path: Path, sig) -> None:
    """Rank 0 records the first stop signal that reached it in the run's summary: after a
    Ctrl-C the launcher's own forward must not read as SIGTERM, whichever arrives first."""
    said = tmp_path / "said"
    rank = textwrap.dedent("""
        import pathlib, sys, time
        from recsys import interrupts
        said = pathlib.Path(sys.argv[1])
        try:
            with interrupts.interruptible():
                said.with_suffix(".ready").touch()
                time.sleep(60)
        except KeyboardInterrupt:
            said.write_text(interrupts.received())
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", rank, str(said)],
        cwd=Path(__file__).parents[2],
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + 30
    while not said.with_suffix(".ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_ranks([PopenRank(proc)], sig, grace_s=10)
    assert said.read_text() == sig.name and proc.returncode is not None


@pytest.mark.slow
def test_the_example_script_trains_a_users_model_as_the_plain_loop_does(tmp_path: Path) -> None:
    """examples/torchrec_script.py as its docstring runs it, under torchrun on 2 CPU ranks:
    the user's model (tables at `embeddings`) planned by HybridPlanner, sharded by DMP,
    trained by NestedPipeline to the plain loop's losses bit for bit, and exported whole."""
    from conftest import REPO

    def run(pipeline: str) -> list[list[float]]:
        out = tmp_path / pipeline
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(REPO / "examples" / "torchrec_script.py"),
                "--steps",
                "6",
                "--pipeline",
                pipeline,
                "--out",
                str(out),
            ],  # fmt: skip
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert "predicted" in done.stdout and "exported" in done.stdout, done.stdout
        return [json.loads((out / f"losses_rank{r}.json").read_text()) for r in range(2)]

    nested, plain = run("nested"), run("plain")
    assert nested == plain and len(nested[0]) == 6
    assert nested[0] != nested[1]  # each rank its own samples
    exported = torch.load(tmp_path / "nested" / "model.pt")
    table = exported["model.embeddings.embedding_bags.t0.weight"]
    assert table.shape == (20_000, 16) and table.abs().sum() > 0


def test_the_library_planner_shards_a_users_torchrec_model() -> None:
    """`sharding.HybridPlanner.collective_plan` in a plain TorchRec script: both ranks get
    one plan, DistributedModelParallel shards the collection at the model's own path (a
    Sharded module, not the unsharded one), and the model trains at the plan's shares."""
    job = spawn_ranks(rank_jobs.library_planner_trains, 2, args=(60.0,), timeout_s=300)
    out = raise_on_failure(job, "library planner")
    assert all(o["sharded"] == "ShardedEmbeddingBagCollection" for o in out)
    assert out[0]["shares"] == out[1]["shares"] and sum(out[0]["shares"]) == 64
    assert all(len(o["losses"]) == 3 and all(x == x for x in o["losses"]) for o in out)
