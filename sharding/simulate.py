"""A discrete-event simulation of training steps: where `types.StepCost.step_s` adds
stage maxima in closed form, this runs each rank's stages as tasks on the resources they
use and lets the schedule's overlap fall out.

Resources are in-order queues, as CUDA streams and a NIC's send queue are: `compute:r` (rank
r's device), `nic:r` (its share of its node's NICs: the all-to-alls' traffic across nodes,
and the all-reduce when it crosses nodes), `fabric:r` (its link within the node: NVLink, or
loopback on CPU ranks), `h2d:r` (its host-device link: the batch's copy, on GPU ranks),
`host:r` (the host cores that assemble its batch, on GPU ranks). A
cost without the split by link (`StepCost.emb_a2a_parts_s` empty) puts each exchange on one
`net:r` queue. On CPU ranks the network's own CPU work (gloo's TCP sends and receives,
`StepCost.comm_cpu_s`) also takes `compute:r`, queued in program order where the exchange is
issued: an exchange hidden under compute lengthens it (the forward chunks' CPU work is all
queued after the lookups, the closed form charges it to the dense work instead). A task
starts when every task it depends on has ended and its resource has finished the task
before it in program order. A collective is one task per rank and link whose result every
rank waits for (the barrier of an all-to-all); an all-to-all's task on a rank starts once
that rank's own input is ready (its sends leave as it calls the collective, under its
peers' compute: `types.exchange_past_s`), the all-reduce's once every rank's is. The
durations are the cost model's per-rank stage times, so the simulator and the closed form
share every constant; they differ only in how stages overlap.

Schedules (the train pipelines):
- `plain`: ids -> lookup -> embedding exchange -> dense forward and backward -> gradient
  exchange -> lookup backward and update, under the all-reduce (queued behind the gradients
  on the link) -> fixed overheads, per step.
- `sparse_dist`: TorchRec's; the next batch's id exchange runs under this batch's dense work.
- `nested`: also the embedding exchange and its gradients in N micro-batch chunks, each
  chunk's dense and per-sample work waiting for its own chunk only (each chunk pays the
  exchange's latency, each micro-batch past the first its fixed work); the update after the
  last gradient chunk, then the next batch's lookups under the all-reduce, and its forward
  chunks under the optimizer step and fixed overheads that end the step (the code's order).
- SemiSync (`stale=True`): TorchRec's; the next batch's lookups and embedding exchange run
  under this batch's dense work, before its update (one step stale).
Steady state: several steps are simulated and the step time is the last step's period, at
least the busiest rank's whole CPU work on ranks at a share of a core
(`StepCost.cpu_floor_s`, as in the closed form).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sharding.types import Schedule, StepCost


@dataclass(frozen=True)
class Task:
    name: str
    resource: str
    duration: float
    deps: tuple[str, ...] = ()


@dataclass
class Timeline:
    """Each task's start and end (s), in the order simulated."""

    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    resources: dict[str, str] = field(default_factory=dict)

    def end(self, name: str) -> float:
        return self.spans[name][1]


def run(tasks: Sequence[Task]) -> Timeline:
    """Simulate `tasks` (listed in program order; a task's dependencies come before it)."""
    free: dict[str, float] = {}
    out = Timeline()
    for t in tasks:
        missing = [d for d in t.deps if d not in out.spans]
        if missing:
            raise ValueError(f"task '{t.name}' depends on {missing}, not listed before it")
        if t.duration < 0:
            raise ValueError(f"task '{t.name}' has a negative duration {t.duration}")
        start = max([free.get(t.resource, 0.0), *(out.end(d) for d in t.deps)])
        out.spans[t.name] = (start, start + t.duration)
        out.resources[t.name] = t.resource
        free[t.resource] = start + t.duration
    return out


@dataclass
class SimResult:
    step_s: float  # the steady-state step time
    exposed_comm_s: float  # step time less the same schedule's with a free network
    timeline: Timeline  # every simulated step, for a Gantt chart
    last_step: int


def simulate(
    cost: StepCost,
    schedule: Schedule,
    micro_batches: int = 1,
    steps: int = 4,
    stale: bool = False,
) -> SimResult:
    """Steady-state step time of `cost`'s stages under `schedule` (`stale`: SemiSync's),
    and its exposed communication (the step less the same run's with instant communication)."""
    timeline = run(step_tasks(cost, schedule, micro_batches, steps, stale=stale))
    free_net = run(step_tasks(cost, schedule, micro_batches, steps, False, stale))
    # a rank at a share of a core is never quicker than its whole CPU work
    step = max(_period(timeline, steps), cost.cpu_floor_s(schedule, micro_batches))
    return SimResult(step, max(0.0, step - _period(free_net, steps)), timeline, steps - 1)


def _period(t: Timeline, steps: int) -> float:
    return t.end(f"s{steps - 1}:done") - t.end(f"s{steps - 2}:done")


def step_tasks(
    cost: StepCost,
    schedule: Schedule,
    micro_batches: int = 1,
    steps: int = 4,
    network: bool = True,
    stale: bool = False,
) -> list[Task]:
    """The tasks of `steps` consecutive training steps (module docstring); `stale`: SemiSync,
    the next batch's lookups and embedding exchange under this batch's dense work."""
    b = _StepTasks(cost, schedule, micro_batches, network)
    if b.n > 1:
        return _nested_tasks(b, steps)
    ahead = stale or schedule in (Schedule.sparse_dist, Schedule.nested)
    pending = b.ids(0, [], ahead)  # the first batch's ids
    prev_done: list[str] = []
    fwd_next = b.forward(0, pending) if stale else []
    for k in range(steps):
        fwd = fwd_next if stale else b.forward(k, (*pending, *prev_done))
        # the next batch's ids under this batch's dense work (the last step's too: the
        # steady state prefetches); with SemiSync its lookups and exchange as well, before
        # this batch's update (one step stale)
        if ahead:
            pending = b.ids(k + 1, fwd[0], ahead)
        if stale:
            fwd_next = b.forward(k + 1, pending)
        prev_done = b.backward_and_update(k, fwd)
        if not ahead and k + 1 < steps:
            pending = b.ids(k + 1, prev_done, ahead)
    return b.tasks


def _nested_tasks(b: _StepTasks, steps: int) -> list[Task]:
    """`pipelines.nested`'s order with N > 1 micro-batches: each chunk's dense and per-sample
    work waits for its own forward chunk, its gradient chunk goes out under the next one's;
    after the last gradient chunk the update, then the next batch's lookups (under the
    all-reduce) and its forward chunks at once, which cross under the optimizer step and
    the fixed overheads that end the step."""
    pending = b.ids(0, [], True)
    fwd = b.forward(0, pending)
    for k in range(steps):
        pending = b.ids(k + 1, fwd[0], True)  # sent after the first micro-batch
        grads, reduce = b.chunks(k, fwd, b.cost.input_s)
        update = [f"s{k}:update@{r}" for r in b.ranks]
        for r in b.ranks:
            b.tasks.append(Task(update[r], f"compute:{r}", b.cost.lookup_bwd_s[r], tuple(grads)))
        fwd = b.forward(k + 1, (*pending, *update))
        b.end_step(k, "overheads", [b.cost.overhead_s] * b.world, reduce)
    return b.tasks


class _StepTasks:
    """Builds a step's tasks stage by stage; each method returns the names to wait on."""

    def __init__(self, cost: StepCost, schedule: Schedule, micro_batches: int, network: bool):
        self.cost, self.world = cost, len(cost.dense_s)
        self.ranks = range(self.world)
        self.n = max(1, micro_batches) if schedule == Schedule.nested else 1
        self.net = 1.0 if network else 0.0
        self.seq = cost.split_s or [0.0] * self.world
        self.copy = cost.input_copy_s or [0.0] * self.world
        self.host = cost.host_input_s or [0.0] * self.world
        self.cpu = {k: [x * self.net for x in xs] for k, xs in cost.comm_cpu_s.items()}
        self.emb_cpu = [x / self.n for x in self.cpu.get("emb", ())]  # one chunk's, each way
        self.tasks: list[Task] = []

    def parts(
        self, durations: Sequence[float], split: dict[str, list[float]], chunks: int = 1
    ) -> dict[str, list[float]]:
        """An exchange's per-rank durations by queue: split by link where the cost has it;
        one of `chunks` chunks of it (`StepCost.chunk_s`: each pays the latency again)."""
        chosen = split or {"net": list(durations)}
        return {
            link: [self.cost.chunk_s(x, chunks) * self.net for x in xs]
            for link, xs in chosen.items()
        }

    def collective(
        self,
        name: str,
        by_link: dict[str, Sequence[float]],
        deps: Sequence[str],
        cpu_s: Sequence[float] = (),
        inputs: Sequence[str] = (),
    ) -> list[str]:
        """One task per rank and link on its queue and its CPU work (`cpu_s`, per rank) on
        the rank's compute queue; returns the barrier after them. Each rank's tasks start
        after `deps` and the rank's own input (`inputs[r]`: an all-to-all, whose sends leave
        as each rank calls it), or, without `inputs`, after every rank's (the all-reduce's
        ring); a zero-length task joins `deps` so that this stays linear in the ranks."""
        tasks = self.tasks
        tasks.append(Task(f"{name}:in", f"{name}:in", 0.0, tuple(deps)))
        ends = []
        for r in self.ranks:
            after = (f"{name}:in", inputs[r]) if inputs else (f"{name}:in",)
            for link, durations in by_link.items():
                ends.append(f"{name}@{r}/{link}")
                tasks.append(Task(ends[-1], f"{link}:{r}", durations[r], after))
            if cpu_s:
                ends.append(f"{name}@{r}/cpu")
                tasks.append(Task(ends[-1], f"compute:{r}", cpu_s[r], after))
        tasks.append(Task(f"{name}:out", f"{name}:out", 0.0, tuple(ends)))
        return [f"{name}:out"]

    def ids(self, k: int, after: Sequence[str], ahead: bool) -> list[str]:
        """Batch k's assembly on the host (`ahead`: a prefetch thread, in its own order;
        else on the training thread, after `after`), its copy to the device (in the
        host-device link's order), then its ids."""
        for r in self.ranks:
            host = f"s{k}:host@{r}"
            self.tasks.append(Task(host, f"host:{r}", self.host[r], () if ahead else tuple(after)))
            self.tasks.append(Task(f"s{k}:copy@{r}", f"h2d:{r}", self.copy[r], (host, *after)))
        copies = [f"s{k}:copy@{r}" for r in self.ranks]
        by_link = self.parts(self.cost.ids_a2a_s, self.cost.ids_a2a_parts_s)
        return self.collective(f"s{k}:ids", by_link, (), self.cpu.get("ids", ()), copies)

    def forward(self, k: int, deps: Sequence[str]) -> list[list[str]]:
        """Step k's lookups, then every forward chunk as soon as they are done."""
        cost = self.cost
        lookups = [f"s{k}:lookup@{r}" for r in self.ranks]
        for r in self.ranks:
            self.tasks.append(
                Task(lookups[r], f"compute:{r}", cost.lookup_fwd_s[r] + self.seq[r], tuple(deps))
            )
        fwd = self.parts(cost.emb_a2a_fwd_s, cost.emb_a2a_parts_s, self.n)
        return [
            self.collective(f"s{k}:emb{c}", fwd, (), self.emb_cpu, lookups) for c in range(self.n)
        ]

    def chunks(
        self, k: int, fwd: list[list[str]], per_sample_s: float = 0.0
    ) -> tuple[list[str], list[str]]:
        """Step k's dense work chunk by chunk (each waits for its own chunk only; with
        `per_sample_s`, its share of that too, and every chunk past the first its fixed
        work), each chunk's gradient exchange, and the all-reduce after the last chunk: the
        names to wait on for each."""
        cost, p = self.cost, f"s{k}"
        fixed = cost.micro_batch_s * (self.n - 1) / self.n
        bwd = self.parts(cost.emb_a2a_bwd_s, cost.emb_a2a_parts_s, self.n)
        grads: list[str] = []
        for c in range(self.n):
            dense = [f"{p}:dense{c}@{r}" for r in self.ranks]
            for r in self.ranks:
                self.tasks.append(
                    Task(
                        dense[r],
                        f"compute:{r}",
                        (cost.dense_s[r] + per_sample_s) / self.n + fixed,
                        tuple(fwd[c]),
                    )
                )
            grads += self.collective(f"{p}:grad{c}", bwd, (), self.emb_cpu, dense)
        reduce_on = cost.allreduce_link if cost.emb_a2a_parts_s else "net"
        allreduce = {reduce_on: [cost.allreduce_s * self.net] * self.world}
        return grads, self.collective(
            f"{p}:allreduce", allreduce, dense, self.cpu.get("allreduce", ())
        )

    def end_step(
        self, k: int, kind: str, durations: Sequence[float], deps: Sequence[str]
    ) -> list[str]:
        """The compute (`kind`, per rank) that ends step k on every rank."""
        done = [f"s{k}:{kind}@{r}" for r in self.ranks]
        for r in self.ranks:
            self.tasks.append(Task(done[r], f"compute:{r}", durations[r], tuple(deps)))
        self.tasks.append(Task(f"s{k}:done", "step", 0.0, tuple(done)))
        return [f"s{k}:done"]

    def backward_and_update(self, k: int, fwd: list[list[str]]) -> list[str]:
        """Step k's chunks (`chunks`), the update on every rank after every gradient chunk
        (under the all-reduce), then the fixed overheads after both."""
        grads, reduce = self.chunks(k, fwd)
        cost = self.cost
        update = [f"s{k}:update@{r}" for r in self.ranks]
        for r in self.ranks:
            self.tasks.append(Task(update[r], f"compute:{r}", cost.lookup_bwd_s[r], tuple(grads)))
        fixed = cost.rank_fixed_s or [cost.overhead_s + cost.input_s] * self.world
        return self.end_step(k, "overheads", fixed, (*update, *reduce))
