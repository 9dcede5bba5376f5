"""`hybrid`, our planner: access frequency and each device's own speed and memory.

1. Batch split: each rank's share of the global batch is proportional to its dense speed
   (Whale's hardware-aware data parallelism), instead of equal shares; then also shares
   capped where the largest-batch ranks' exchange costs more than the dense work it saves.
2. Hot rows replicated (HugeCTR's hybrid embedding): for each table the hottest h rows
   become a data-parallel part on every rank. Two rules pick h, and the plans of both are
   finished and compared: where the all-reduce of their gradients costs less than the
   all-to-all they save on the largest-batch rank, the cold rest then exchanging only its
   own lookups (a variable-length exchange); or the least of what the table costs
   (`_table_cost`), the cold rest exchanged per lookup or kept pooled, counting the lookups
   the hot rows make local (multi-hot tables). h comes from the table's coverage curve;
   h = rows is a small table replicated whole.
3. The rest is cut into pieces small enough to balance (column-wise; a cold part in row
   parts, each its own table), and placed longest first where the step then ends soonest
   as the cost model adds it up (`sharding.placer`): the slowest rank's lookups plus the
   slowest rank's exchange (the larger of the bytes a rank sends and receives on each
   link), never over a rank's memory.
4. Memory: a piece too large for any rank is cut further (columns, then row parts), and
   pieces that fit no device's fast memory go to host memory with an HBM cache of their
   hottest rows (sized by the coverage curve and the free HBM); when placement still fails,
   every piece is cut finer and the hot rows get less room, until it fits or cannot.
5. Shapes (GPU clusters): each pooled table in turn whole, in column
   pieces or as a table-row-wise group, kept where the cost model's whole step (the ids'
   exchange and the schedule included, which the placer's score leaves out) gets faster.
The predicted step of the slowest rank is what this minimises, under each rank's capacity.
`HybridOptions` switch ideas 1-3 off one by one: the gain decomposition of
`benchmarks.planners` plans with each.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from sharding.batch_split import (
    capped_batch,
    capped_time,
    dense_s_per_sample,
    equal_batch,
    proportional_batch,
)
from sharding.bound import BoundGuide, bound_guides, lookup_rates, lookups_spread_s
from sharding.cost_model import exposed_exchange_passes, ring_bytes, vectors_per_sample
from sharding.memory import batch_bytes_per_sample, dense_bytes
from sharding.placer import Piece, Placer
from sharding.plan_check import check_inputs
from sharding.plan_eval import check_fits, evaluate, finish_table, shards_cost
from sharding.row_parts import cold_part_rows
from sharding.types import (
    ALL_RANKS,
    FLOAT_BYTES,
    ID_BYTES,
    Plan,
    PlanDoesNotFitError,
    PlanInputs,
    Shard,
    TablePlan,
    TableStats,
    Tier,
)

MIN_COLS = 4  # TorchRec's column-wise shards keep dims that are multiples of 4
MAX_REPLICATED_SHARE = 0.85  # of the smallest rank's fast memory, for all hot rows together
MAX_FIT_TRIES = 24  # memory retries, each with pieces half as large
MAX_ROW_PARTS_PER_RANK = 8  # a piece cut for memory: at most this many row parts a rank
BALANCE_PIECES = 4  # pieces are cut to about 1 / (this x ranks) of all pieces' cost
# which pooled tables `_place` offers as table-row-wise groups: none; those whose column
# pieces' ids outweigh a vector (`_group_worth`); those and every other whole one, each
# placed as a group only where that ends the step sooner than on one rank
NO_GROUPS, WORTH_GROUPS, EACH_GROUP = 0, 1, 2


@dataclass(frozen=True)
class HybridOptions:
    """Which of hybrid's ideas it may use (all by default)."""

    speed_aware: bool = True  # batch shares by device speed; False: equal shares
    hot_rows: bool = True  # replicate a table's hottest rows; False: whole small tables only
    row_parts: bool = True  # cut cold parts in row parts for balance (memory cuts stay)
    pooled_hot: bool = True  # hot rows also before a cold part that keeps the pooled exchange


def hybrid(inputs: PlanInputs, options: HybridOptions | None = None) -> Plan:
    """The cheapest under the cost model of these candidates:
    - batch splits (`batch_candidates`), each placed with every idea allowed;
    - for the best split, the same without row parts and without split tables (the
      sequence exchange has a fixed cost per step that no single table's decision sees),
      and with the hot rows the bound's optimum picks at its prices; and the family whose
      hot parts sit before pooled cold parts (`pooled_hot`);
    - each family's best with whole-table replication (`_tune_replication`) and each
      table's shape (`_reshape`) searched; past SEARCH_FULL_RANKS ranks the better family
      only.
    Without `options.speed_aware`, equal shares only."""
    options = options or HybridOptions()
    check_inputs(inputs)
    check_fits(inputs)
    if not options.speed_aware:
        return _variants(inputs, equal_batch(inputs.global_batch, inputs.world), options)[0]
    guides = bound_guides(inputs)
    # batch splits ranked on the speed shares' placement; the two most promising that are
    # not near copies of one already placed are placed anew (greedy), the best then polished
    try:
        best = evaluate(_hybrid(inputs, speed_batch(inputs), options, polish=False), inputs, False)
    except PlanDoesNotFitError:  # a fast rank's larger batch left its tables no room
        best = evaluate(
            _hybrid(inputs, equal_batch(inputs.global_batch, inputs.world), options, polish=False),
            inputs,
            False,
        )
    ranked = sorted(
        distinct_batches(other_batches(inputs, guides, best), best.batch_per_rank),
        key=lambda batch: _step_ms(
            evaluate(
                replace(best, batch_per_rank=batch, devices=[]), inputs, False, check_tables=False
            )
        ),
    )
    for batch in ranked[:BATCHES_PLACED]:
        try:
            plan = evaluate(_hybrid(inputs, batch, options, polish=False), inputs, bound=False)
        except PlanDoesNotFitError:  # this split leaves some rank's tables no room
            continue
        best = min(best, plan, key=_step_ms)
    # hot parts before pooled cold parts are each priced alone (`_table_cost`), which
    # misses what many add up to (their all-reduce, less room to balance): the plans
    # without them are finished too
    alone = replace(options, pooled_hot=False)
    finals = _fitting(lambda: _variants(inputs, best.batch_per_rank, alone, guides))
    if options.hot_rows and guides[0].split:  # the bound's own hot rows at its prices
        recipe = _Recipe(best.batch_per_rank, alone, hot=guides[0].hot_rows())
        finals += _fitting(lambda: (recipe.plan(inputs), recipe))
    candidates = [min(finals, key=lambda x: _step_ms(x[0]))] if finals else []
    if options.pooled_hot and pooled_cold(best) or not candidates:  # the same rule as `best`
        pooled = _fitting(lambda: _variants(inputs, best.batch_per_rank, options, guides))
        candidates += [c for c in pooled if pooled_cold(c[0]) or not candidates]
    if not candidates:  # only `best`'s own greedy placement fits
        candidates = [(best, _Recipe(best.batch_per_rank, options))]
    if inputs.world > SEARCH_FULL_RANKS:  # planning time: the searches refine the best only
        candidates = [min(candidates, key=lambda x: _step_ms(x[0]))]
    plan = min((_reshape(inputs, *_tune_replication(inputs, *c)) for c in candidates), key=_step_ms)
    # the final placement with whichever batch split suits it best
    return with_speed_aware_batch(plan, inputs, guides)


@dataclass(frozen=True)
class _Recipe:
    """How a candidate plan is made (`_hybrid`'s arguments), to make it again with changes."""

    batch: list[int]
    options: HybridOptions
    hot: dict | None = None
    pooled: frozenset = frozenset()  # tables in `hot` whose cold part keeps the pooled exchange
    uncut: bool = False
    groups: int = NO_GROUPS  # or WORTH_GROUPS, EACH_GROUP (`_place`)
    shapes: dict | None = None  # per table: GROUP or its number of column pieces (`_reshape`)

    def plan(self, inputs: PlanInputs, polish: bool = True) -> Plan:
        return evaluate(self.placement(inputs, polish).plan(), inputs, bound=False)

    def placement(self, inputs: PlanInputs, polish: bool = True) -> _Placement:
        return _placement(
            inputs,
            self.batch,
            self.options,
            self.hot,
            polish,
            self.uncut,
            self.groups,
            self.shapes,
            self.pooled,
        )


def _fitting(make: Callable[[], tuple[Plan, _Recipe]]) -> list[tuple[Plan, _Recipe]]:
    """`[make()]`, or `[]` where the candidate finds no room: a search goes on without it
    (a batch split, a variant or a trial that fits nowhere is no reason to plan nothing)."""
    try:
        return [make()]
    except PlanDoesNotFitError:
        return []


REPLICATION_TRIALS = (8, 4)  # moves tried: up to SEARCH_FULL_RANKS ranks, on more
BATCHES_PLACED = 2  # batch splits besides speed shares placed anew
DISTINCT_BATCH = 0.02  # of the global batch: a split no rank's batch moves more is a copy
# on more ranks than this, the searches make fewer trials and refine the best candidate
# family only (planning time: docs/planning.md's goals)
SEARCH_FULL_RANKS = 32


def _tune_replication(inputs: PlanInputs, plan: Plan, recipe: _Recipe) -> tuple[Plan, _Recipe]:
    """Hill-climbing on whole-table replication, judged by the cost model itself (each
    table's own estimate in `_replicated_rows` cannot see which rank's exchange sets the
    step): replicate the smallest exchanged tables, or stop replicating the largest
    replicated ones, first in bulk (the smallest half, quarter, eighth; the largest half,
    quarter), then one table at a time, keeping a change when the whole plan steps faster."""
    if inputs.world < 2:
        return plan, recipe
    hot = {t.name: t.replicated_rows for t in plan.tables}
    recipe = replace(recipe, pooled=pooled_cold(plan))
    rows = {t.name: t.rows for t in plan.tables}
    size = {t.name: t.rows * t.dim for t in plan.tables}
    add = sorted((n for n, h in hot.items() if h == 0), key=size.get)
    drop = sorted((n for n, h in hot.items() if h == rows[n]), key=lambda n: -size[n])
    moves = [{n: rows[n] for n in add[: len(add) // k]} for k in (2, 4, 8)]
    moves += [{n: 0 for n in drop[: len(drop) // k]} for k in (2, 4)]
    singles = [x for pair in zip(drop, add, strict=False) for x in pair]
    moves += [{n: 0 if hot[n] else rows[n]} for n in singles + drop[len(add) :] + add[len(drop) :]]
    moves = [m for m in moves if m][: REPLICATION_TRIALS[inputs.world > SEARCH_FULL_RANKS]]
    # trials compared on greedy placements, the one kept then polished; one that finds no
    # room is skipped
    start = _fitting(lambda: (replace(recipe, hot=hot).plan(inputs, polish=False), recipe))
    if not start:
        return plan, recipe
    current, kept = start[0][0], None
    for move in moves:
        trial = replace(recipe, hot=hot | move)
        candidate = _fitting(lambda t=trial: (t.plan(inputs, polish=False), t))
        if candidate and _step_ms(candidate[0][0]) < _step_ms(current) * (1 - 1e-9):
            current, kept, hot = candidate[0][0], trial, trial.hot
    polished = _fitting(lambda: (kept.plan(inputs), kept)) if kept is not None else []
    if polished and _step_ms(polished[0][0]) < _step_ms(plan):
        return polished[0]
    return plan, recipe


RESHAPE_TRIALS = (256, 64)  # shape trials a climb makes at most: up to SEARCH_FULL_RANKS, more
RESHAPE_ROUNDS = 4  # climbs, each followed by a fresh placement with its shapes
CLIMB_MOVES = 4  # the placer's local-search moves after each trial shape
GROUP = "group"  # a table's cold part as a table-row-wise group (`Placer.place_group`)


def _reshape(inputs: PlanInputs, plan: Plan, recipe: _Recipe) -> Plan:
    """Hill-climbing on each pooled table's shape, judged by the cost model itself (the
    placer's score leaves out the ids' exchange, which each column piece receives in full,
    and the schedule, which may hide it under dense work). A round climbs (`_climb`) from
    the recipe's placement, then places every piece anew longest first with the shapes it
    found; rounds go on while that placement steps faster than the best so far. On GPU
    clusters (RESHAPE_TRIALS: fewer trials on large ones); CPU clusters keep the greedy
    placement their measured results in docs/benchmarks.md were made with."""
    if inputs.cpu:
        return plan
    best = plan
    for _ in range(RESHAPE_ROUNDS):
        try:
            made = recipe.placement(inputs)
        except PlanDoesNotFitError:  # this recipe's placement finds no room any more
            break
        shapes = _climb(made, inputs)
        if shapes is None:
            break
        best = min(best, evaluate(made.plan(), inputs, bound=False), key=_step_ms)
        recipe = replace(recipe, shapes=shapes)
        try:
            again = recipe.plan(inputs)
        except PlanDoesNotFitError:  # placed in another order, the shapes find no room
            break
        if _step_ms(again) >= _step_ms(best):
            break
        best = again
    return best


def _climb(made: _Placement, inputs: PlanInputs) -> dict | None:
    """For the tables whose cold part costs most first, each in turn: whole on one rank, in
    2, 4, ... column pieces, or (where `group_ready`) a table-row-wise group, placed where
    the step then ends soonest with the rest kept (then the placer's local search); a change
    kept when the whole plan steps faster. The shapes of every table after, None if none
    changed."""
    placer = made.placer
    grouping = group_ready(inputs)
    tiers: dict[str, set] = {}
    for p, s in placer.placed:
        tiers.setdefault(p.table.name, set()).add(s.tier)
    wholes = [
        p
        for name, p in made.wholes.items()
        if not p.sparse_exchange
        and made.plans[name].cold_parts == 1
        and tiers.get(name) == {Tier.hbm}
    ]
    wholes.sort(key=lambda p: -float(placer.cost(p).min()))
    shapes = {p.table.name: 0 for p in wholes}
    for q, s in placer.placed:
        if q.table.name in shapes:
            shapes[q.table.name] = GROUP if s.node_reduce else shapes[q.table.name] + 1
    best = _quick_ms(made, inputs)
    changed, trials = False, 0
    most = RESHAPE_TRIALS[inputs.world > SEARCH_FULL_RANKS]
    for p in wholes:
        for shape in _shapes(p, inputs, grouping):
            if shape == shapes[p.table.name] or trials >= most:
                continue
            trials += 1
            state = placer.snapshot()
            placer.take(p.table.name)
            if _put(placer, p, shape, inputs):
                placer.improve(max_moves=CLIMB_MOVES)
                ms = _quick_ms(made, inputs)
                if ms < best * (1 - 1e-9):
                    best, changed = ms, True
                    shapes[p.table.name] = shape
                    continue
            placer.restore(state)
    return shapes if changed else None


def _quick_ms(made: _Placement, inputs: PlanInputs) -> float:
    """The placement's step under the cost model, without the checks and report of
    `evaluate`."""
    shards = [s for t in made.tables() for s in t.shards]
    cost = shards_cost(shards, made.batch, inputs)
    return cost.step_s(inputs.schedule, inputs.micro_batches) * 1000


def _shapes(p: Piece, inputs: PlanInputs, grouping: bool) -> list:
    """The shapes `_reshape` tries for a table's whole cold part: a group, then 1, 2, 4, ...
    column pieces (at most one a rank, dims multiples of MIN_COLS)."""
    dim = p.table.dim
    cols = [
        k
        for k in (2**j for j in range(12))
        if k <= inputs.world and dim % k == 0 and dim // k >= MIN_COLS
    ]
    return ([GROUP] if grouping and _groupable(p, inputs) else []) + cols


def _put(placer: Placer, p: Piece, shape, inputs: PlanInputs) -> bool:
    """Place a table's cold part in `shape` in device memory; False where it finds no room."""
    if shape == GROUP:
        return placer.place_group(replace(p, group=True, either=False)) is not None
    for _ in range(shape):
        piece = replace(p, cols=p.table.dim // shape)
        if not (placer.free_hbm >= placer.hbm_need(piece)).any():
            return False
        placer.place(piece, inputs.coverage[p.table.name])
    return True


def speed_batch(inputs: PlanInputs) -> list[int]:
    """Shares of the global batch in proportion to each rank's dense speed."""
    return proportional_batch(inputs.global_batch, [d.dense_flops_per_s for d in inputs.devices])


def other_batches(inputs: PlanInputs, guides: list[BoundGuide], plan: Plan) -> list[list[int]]:
    """Batch splits worth trying besides speed shares, without repeats: capped where the
    exchange of the ranks with the largest batch costs more than the dense work it saves
    (for `plan`); equal; the splits at the lower bound's optima (`bound_guides`: per node,
    or capped at one rank's batch), and halfway between those and speed shares."""
    speed = speed_batch(inputs)
    out = [_exchange_aware_batch(plan, inputs), equal_batch(inputs.global_batch, inputs.world)]
    for guide in guides:
        guided = _guided_batch(inputs, guide)
        halfway = [(a + b) / 2 + 1e-9 for a, b in zip(speed, guided, strict=True)]
        out += [guided, proportional_batch(inputs.global_batch, halfway)]
    unique: list[list[int]] = []
    for batch in out:
        if batch not in unique and batch != speed and batch != plan.batch_per_rank:
            unique.append(batch)
    return unique


def distinct_batches(batches: list[list[int]], *placed: list[int]) -> list[list[int]]:
    """`batches` less those within DISTINCT_BATCH of the global batch on every rank of a
    split in `placed` or of one kept before them: a near copy of a split already placed
    would be placed again instead of a different one (the ranking prices every split on
    one placement, so the copies of that placement's own split rank first)."""
    kept: list[list[int]] = []
    for batch in batches:
        tolerance = DISTINCT_BATCH * sum(batch)
        if all(
            max(abs(a - b) for a, b in zip(batch, other, strict=True)) > tolerance
            for other in (*placed, *kept)
        ):
            kept.append(batch)
    return kept


def with_speed_aware_batch(
    plan: Plan, inputs: PlanInputs, guides: list[BoundGuide] | None = None
) -> Plan:
    """The plan's placement with the best of hybrid's batch splits, judged by the cost
    model: what speed-aware shares alone add to another planner's plan."""
    best = evaluate(plan, inputs, bound=False)
    guides = guides or bound_guides(inputs)
    for batch in [speed_batch(inputs), *other_batches(inputs, guides, best)]:
        moved = replace(plan, batch_per_rank=batch, devices=[])
        best = min(best, evaluate(moved, inputs, bound=False, check_tables=False), key=_step_ms)
    return best


def _guided_batch(inputs: PlanInputs, guide: BoundGuide) -> list[int]:
    """The batch split at the bound's optimum: its share per node (in proportion to speed
    within the node), or on one node speed shares capped at its largest batch."""
    sample_s = dense_s_per_sample(inputs)
    big_b = inputs.global_batch
    if not guide.node_shares:
        return capped_batch(big_b, sample_s, int(math.ceil(guide.largest_batch)))
    weights = np.zeros(inputs.world)
    mates: dict[int, list[int]] = {}
    for r in inputs.ranks:
        mates.setdefault(r.node, []).append(r.rank)
    speed = {node: (1.0 / sample_s[ranks]).sum() for node, ranks in mates.items()}
    for r in inputs.ranks:
        weights[r.rank] = guide.node_shares[r.node] * (1.0 / sample_s[r.rank]) / speed[r.node]
    return proportional_batch(big_b, list(np.maximum(weights, 1e-9)))


def _variants(
    inputs: PlanInputs, batch: list[int], options: HybridOptions, guides: list | None = None
) -> tuple[Plan, _Recipe]:
    """The best of: the placement with every idea allowed, without row parts, without
    split tables, with pieces cut for memory only (fewer, larger pieces send fewer ids),
    with large pooled tables as table-row-wise groups, and (up to EACH_GROUP_MAX_RANKS)
    with every whole pooled table a group where that ends the step sooner; each of the last
    three with its best batch split when `guides` are given."""
    recipe = _Recipe(batch, options)
    best = (recipe.plan(inputs), recipe)
    tables = best[0].tables
    tries = []
    if options.row_parts and any(t.cold_parts > 1 and t.replicated_rows for t in tables):
        tries.append(replace(recipe, options=replace(options, row_parts=False)))
    if options.hot_rows and any(0 < t.replicated_rows < t.rows for t in tables):
        tries.append(replace(recipe, options=replace(options, hot_rows=False, row_parts=False)))
    for trial in tries:
        for made in _fitting(lambda t=trial: (t.plan(inputs), t)):
            best = min(best, made, key=lambda x: _step_ms(x[0]))
    lean = replace(recipe, options=best_options(best[0], options))
    others = [replace(lean, uncut=True)]
    if group_ready(inputs):  # large pooled tables TorchRec's table-row-wise way instead
        others.append(replace(lean, groups=WORTH_GROUPS))
        others.append(replace(lean, groups=EACH_GROUP))
    for trial in others:
        made = _fitting(lambda t=trial: (t.plan(inputs), t))
        if not made:
            continue
        plan = made[0][0]
        if guides is not None:
            plan = with_speed_aware_batch(plan, inputs, guides)
            trial = replace(trial, batch=plan.batch_per_rank)
        best = min(best, (plan, trial), key=lambda x: _step_ms(x[0]))
    return best


def _group_worth(p: Piece, pieces: int, inputs: PlanInputs, smallest_hbm: float) -> bool:
    """A pooled whole table goes table-row-wise when the ids its `pieces` column pieces
    would add outweigh a vector: each column piece receives every id (8 bytes a lookup),
    while the group receives each id once and reduce-scatters whole vectors within the
    node; by memory too, when even narrow columns are large (`smallest_hbm`: the least
    device memory of any rank, less the reserve)."""
    if not _groupable(p, inputs):
        return False
    ids = p.table.lookups_per_sample * p.lookup_share * ID_BYTES
    narrowest = p.rows * inputs.row_bytes(MIN_COLS)
    return (pieces - 1) * ids >= p.cols * FLOAT_BYTES or narrowest > smallest_hbm


def _groupable(p: Piece, inputs: PlanInputs) -> bool:
    """A pooled piece (a whole table or a pooled cold part) with a row for every rank."""
    return not (p.sparse_exchange or p.rows < inputs.world)


def group_ready(inputs: PlanInputs) -> bool:
    """Table-row-wise groups need GPUs (TorchRec has no such sharding on CPU) and nodes of
    equal size (TorchRec's groups are `local_world_size` consecutive ranks)."""
    sizes = np.bincount([r.node for r in inputs.ranks])
    return not inputs.cpu and len(set(sizes.tolist())) == 1 and sizes[0] > 1


def pooled_cold(plan: Plan) -> frozenset[str]:
    """The tables of `plan` that keep a hot part and exchange their cold part pooled."""
    return frozenset(
        t.name
        for t in plan.tables
        if 0 < t.replicated_rows < t.rows and not any(s.sparse_exchange for s in t.shards)
    )


def best_options(plan: Plan, options: HybridOptions) -> HybridOptions:
    """The options a plan needed: hot rows only if it split a table."""
    split = any(0 < t.replicated_rows < t.rows for t in plan.tables)
    return options if split else replace(options, hot_rows=False, row_parts=False)


def _step_ms(plan: Plan) -> float:
    """What candidates are ranked by: the predicted step, a plan that does not fit last (a
    batch split can overflow a rank's memory: `sharding.memory`)."""
    return plan.est_step_ms if plan.feasible else math.inf


def exchange_s_per_byte(inputs: PlanInputs, batch: list[int]) -> float:
    """Seconds (forward + backward) that one byte per sample of a table's vectors adds to
    the exchange when the exchange is balanced: the larger of the busiest node's share
    across nodes, x (1 - x) B / (its ranks) at the inter-node rate (x: its batch share), and
    the busiest rank's within its node, b (B_node - b) / B_node at the intra-node rate (see
    sharding.bound: neither can be beaten, and a balanced placement gets close to both)."""
    b = np.asarray(batch, dtype=np.float64)
    node = np.array([r.node for r in inputs.ranks])
    node_b = np.bincount(node, weights=b)
    ranks = np.bincount(node)
    big_b = b.sum()
    net = inputs.network
    inter = float(np.max(node_b * (big_b - node_b) / big_b / ranks)) / net.alltoall.bytes_per_s
    intra = float(np.max(b * (node_b[node] - b) / node_b[node])) / net.intra_alltoall.bytes_per_s
    return 2 * max(inter, intra)


def _exchange_aware_batch(plan: Plan, inputs: PlanInputs) -> list[int]:
    """The cap on any rank's batch that minimises dense work + input work + exchange, the
    exchange taken as balanced (`exchange_s_per_byte`)."""
    big_b, w = inputs.global_batch, inputs.world
    by_name = {t.name: t for t in inputs.tables}
    volume = sum(
        s.cols * FLOAT_BYTES * vectors_per_sample(s, by_name[s.table])
        for s in plan.shards()
        if not s.dp
    )
    sample_s = dense_s_per_sample(inputs)
    input_s = np.array([d.input_s_per_sample + d.sample_overhead_s for d in inputs.devices])
    caps = np.unique(np.linspace(math.ceil(big_b / w), max(plan.batch_per_rank), 64).round())
    passes = exposed_exchange_passes(inputs.schedule, inputs.micro_batches)
    # every cap's split at once, continuous (the integer split rounds it)
    level = capped_time(big_b, sample_s, caps)
    shares = np.minimum(caps[:, None], level[:, None] / sample_s[None, :])
    shares *= big_b / shares.sum(axis=1, keepdims=True)
    cost = [
        np.max(b * sample_s)
        + np.max(b * input_s)
        + passes / 2 * exchange_s_per_byte(inputs, b) * volume
        for b in shares
    ]
    return capped_batch(big_b, sample_s, int(caps[int(np.argmin(cost))]))


def _hybrid(inputs: PlanInputs, batch: list[int], options: HybridOptions, **how) -> Plan:
    """One placement's plan (`_placement`)."""
    return _placement(inputs, batch, options, **how).plan()


def _placement(
    inputs: PlanInputs,
    batch: list[int],
    options: HybridOptions,
    hot: dict | None = None,
    polish: bool = True,
    uncut: bool = False,
    groups: int = NO_GROUPS,
    shapes: dict | None = None,
    pooled: frozenset = frozenset(),
) -> _Placement:
    """One placement (`hot`: replicated rows per table, the cold parts of those in `pooled`
    keeping the pooled exchange, else `_replicated_rows` decides both;
    `polish`: the local search after the greedy pass; `uncut`: no cuts for balance, only
    for memory; `groups`: which whole tables may go TorchRec's table-row-wise way, where
    `group_ready`; `shapes`: per table, `_reshape`'s GROUP or number of column pieces); on a
    memory failure, again with half the room for hot rows and either pieces half as large
    (a piece found no room for its rows) or twice the device memory kept for buffers (a
    piece host memory holds found no device room for its buffers: smaller pieces would
    only add buffers), until it fits (or pieces cannot get smaller)."""
    limit, share, reserve = math.inf, MAX_REPLICATED_SHARE, 1.0
    for _ in range(MAX_FIT_TRIES):
        try:
            return _place(
                inputs,
                batch,
                options,
                (limit, share, reserve),
                (hot, pooled),
                polish,
                uncut,
                groups,
                shapes or {},
            )
        except _NoBufferRoom:
            if reserve >= inputs.world:
                break
            share, reserve = share / 2, reserve * 2
        except _TooLarge as e:
            if e.need <= 1:
                break
            limit, share = e.need / 2, share / 2
    raise PlanDoesNotFitError(
        f"cluster '{inputs.cluster}': every table fits in total, but no cut of the pieces "
        f"found places them all within each device's and host's memory; the largest device "
        f"offers {max(inputs.hbm_budget()) / 2**30:.2f} GiB and host "
        f"{max(inputs.host_budget()) / 2**30:.2f} GiB after the reserve. Fix: fewer or smaller "
        f"tables, more devices, or a smaller planner.storage_reservation"
    )


class _TooLarge(Exception):
    def __init__(self, need: float) -> None:
        self.need = need  # bytes of the piece that found no room


class _NoBufferRoom(Exception):
    """A piece host memory holds found no device room for its buffers."""


def _replicate(
    inputs: PlanInputs,
    batch: list[int],
    options: HybridOptions,
    share: float,
    asked: tuple[dict | None, frozenset],
    placer: Placer,
) -> tuple[dict[str, TablePlan], list[tuple[float, int, Piece]]]:
    """The replicated hot rows of every table, within `share` of the smallest device's memory
    (hottest-per-byte tables first; `asked`: the rows asked for and the tables whose cold
    part stays pooled, or None: `_replicated_rows` decides), taken from `placer`'s room;
    each table's plan so far, and its cold part as one piece with its cost, to be cut."""
    hot, pooled = asked
    budget = share * float(placer.free_hbm.min())  # the room its batch leaves
    plans: dict[str, TablePlan] = {}
    pieces: list[tuple[float, int, Piece]] = []
    order = sorted(inputs.tables, key=lambda t: -inputs.coverage[t.name](1) / t.dim)
    prices = _Prices.of(inputs, batch)
    for t in order:
        if hot is None:
            h, sparse = _replicated_rows(inputs, t, budget, prices, options)
        else:  # as many of the given rows as the budget holds
            h = min(hot.get(t.name, 0), int(max(0.0, budget) // inputs.row_bytes(t.dim)))
            sparse = t.name not in pooled
        sparse = sparse and 0 < h < t.rows and inputs.cold_only_exchange
        budget -= h * inputs.row_bytes(t.dim)
        placer.free_hbm -= h * inputs.row_bytes(t.dim)  # a copy on every rank
        cov_h = inputs.coverage[t.name](h) if h else 0.0
        everyone = list(range(inputs.world)) if h else []
        shards = [Shard(t.name, ALL_RANKS, h, t.dim, dp=True, lookup_share=cov_h)] if h else []
        kind = "data_parallel" if h == t.rows else ""
        plans[t.name] = TablePlan(
            t.name,
            t.rows,
            t.dim,
            kind,
            everyone,
            Tier.hbm,
            hot_rows=h,
            replicated_rows=h,
            shards=shards,
        )
        if h < t.rows:
            whole = Piece(t, t.rows - h, t.dim, 1.0 - cov_h, sparse_exchange=sparse, hot=h)
            pieces.append((float(placer.cost(whole).min()), len(pieces), whole))
    return plans, pieces


def _place(
    inputs: PlanInputs,
    batch: list[int],
    options: HybridOptions,
    room: tuple[float, float, float],
    asked: tuple[dict | None, frozenset],
    polish: bool,
    uncut: bool,
    groups: int,
    shapes: dict,
) -> _Placement:
    limit, share, placer_reserve = room  # `_placement`'s
    placer = Placer(inputs, batch, speed_aware=True)
    placer.buffer_reserve = placer_reserve
    plans, pieces = _replicate(inputs, batch, options, share, asked, placer)
    total = sum(c for c, _, _ in pieces)
    target = total / (BALANCE_PIECES * inputs.world) if pieces and not uncut else math.inf
    # a piece larger than any rank's room is cut whatever its cost
    limit = min(limit, float(max(placer.free_hbm.max(), placer.free_host.max(), 1.0)))
    split: list[tuple[float, int, Piece]] = []
    cuts: dict[str, tuple[float, list[Piece]]] = {}  # a group's pieces, if it finds no room
    tie = itertools.count()  # equal costs pop in the order pushed
    smallest_hbm = min(inputs.hbm_budget())

    def push(cost: float, cut: list[Piece]) -> None:
        for q in cut:
            heapq.heappush(split, (-cost / len(cut), next(tie), q))
        plans[cut[0].table.name].cold_parts = len(cut) if cut[0].cols == cut[0].table.dim else 1

    for cost, _, p in pieces:
        cut = _cut(p, cost, target, inputs, options.row_parts, limit)
        shape = shapes.get(p.table.name)  # `_reshape`'s, where memory allows it
        if isinstance(shape, int) and p.rows * inputs.row_bytes(p.table.dim // shape) <= limit:
            cut = [replace(p, cols=p.table.dim // shape)] * shape
        worth = shape == GROUP or (
            shape is None and groups and _group_worth(p, len(cut), inputs, smallest_hbm)
        )
        either = shape is None and groups == EACH_GROUP and len(cut) == 1 and _groupable(p, inputs)
        if worth or either:
            cuts[p.table.name] = (cost, cut)  # rows over a node, instead of these pieces
            cut = [replace(p, group=True, either=not worth)]
        push(cost, cut)
    placer.expect([q for _, _, q in split])
    while split:
        _, _, p = heapq.heappop(split)
        if p.group:
            if placer.place_group(p) is not None:
                continue
            push(*cuts[p.table.name])  # no node holds it (or it is better alone): its pieces
            continue
        if not placer.fits_somewhere(p):
            if not (placer.room >= p.buffer_bytes(placer.total)).any():  # however it is cut
                raise PlanDoesNotFitError(no_room_for_buffers(inputs, p, placer))
            if placer.buffers_fit_nowhere(p):
                raise _NoBufferRoom
            raise _TooLarge(p.rows * inputs.row_bytes(p.cols))
        placer.place(p, inputs.coverage[p.table.name])
    if polish:
        placer.improve(max_moves=2 * len(placer.placed))
    placer.share_caches()
    return _Placement(inputs, batch, placer, plans, {p.table.name: p for _, _, p in pieces})


def no_room_for_buffers(inputs: PlanInputs, p: Piece, placer: Placer) -> str:
    """Why a piece fits nowhere however it is cut: its buffers alone exceed every rank's
    room (cutting it further only adds buffers)."""
    gib = 2**30
    return (
        f"cluster '{inputs.cluster}': table {p.table.name}'s input and output buffers for "
        f"{placer.total:,.0f} samples ({p.buffer_bytes(placer.total) / gib:.3f} GiB) fit no "
        f"device's room (largest: {placer.room.max() / gib:.3f} GiB, after the dense "
        f"part's {dense_bytes(inputs) / gib:.3f} GiB and {batch_bytes_per_sample(inputs):,.0f} "
        f"bytes per sample of each rank's batch; sharding.memory). Fix: a smaller batch "
        f"(trainer.batch_size), devices with more memory, or fewer tables."
    )


@dataclass
class _Placement:
    """A placement in the making: the placer's ranks and each table's replicated part
    (`plans`) and whole cold part (`wholes`), which `_reshape` cuts anew."""

    inputs: PlanInputs
    batch: list[int]
    placer: Placer
    plans: dict[str, TablePlan]
    wholes: dict[str, Piece]
    # per table, its placed shards and the table finished from them: `_climb` asks for the
    # plan after each trial, which moves one table's pieces
    finished: dict[str, tuple[list, TablePlan]] = field(default_factory=dict)

    def plan(self) -> Plan:
        tables = [replace(t, shards=list(t.shards)) for t in self.tables()]
        return Plan("hybrid", self.inputs.cluster, tables, self.batch)

    def tables(self) -> list[TablePlan]:
        """Each table finished from its placed shards (kept: not to be changed)."""
        placed: dict[str, list[tuple[int, Shard]]] = {name: [] for name in self.plans}
        for p, shard in self.placer.placed:
            placed[p.table.name].append((p.part, shard))
        tables = []
        for t in self.inputs.tables:  # row parts in part order, column pieces as placed
            shards = placed[t.name]
            kept = self.finished.get(t.name)
            if kept is None or kept[0] != shards:  # == on the same Shard objects: fast
                base = self.plans[t.name]
                ordered = [s for _, s in sorted(shards, key=lambda x: x[0])]
                kept = shards, finish_table(replace(base, shards=base.shards + ordered))
                self.finished[t.name] = kept
            tables.append(kept[1])
        return tables


@dataclass(frozen=True)
class _Prices:
    """What replicating a table's rows trades, per byte, for one batch split."""

    exchange_s: float  # seconds a byte per sample of vectors adds to the exchange
    seq_lookup: np.ndarray  # per rank: sequence work per cold lookup ...
    seq_byte: np.ndarray  # ... and per byte of its vector
    split_table: np.ndarray  # per rank: a split table's work a step ...
    split_lookup: np.ndarray  # ... and per lookup of its own samples into it
    batch: np.ndarray
    lookup_s: float  # seconds per byte looked up (forward and backward), fastest device
    level_s: float  # every table's lookups spread over the cluster's embedding speed

    @staticmethod
    def of(inputs: PlanInputs, batch: list[int]) -> _Prices:
        devs = inputs.devices
        return _Prices(
            exchange_s_per_byte(inputs, batch),
            np.array([d.sequence_s_per_lookup for d in devs]),
            np.array([d.sequence_s_per_byte for d in devs]),
            np.array([d.split_s_per_table for d in devs]),
            np.array([d.split_s_per_lookup for d in devs]),
            np.asarray(batch, dtype=np.float64),
            1 / max(lookup_rates(inputs)),
            lookups_spread_s(inputs),
        )


def _replicated_rows(
    inputs: PlanInputs,
    t: TableStats,
    budget_bytes: float,
    prices: _Prices,
    options: HybridOptions,
) -> tuple[int, bool]:
    """Hottest rows worth replicating, and whether the cold rest exchanges only its own
    lookups (True) or stays pooled. With `options.pooled_hot`: the least, over the table
    kept whole, replicated whole or split at each h either way, of `_table_cost`.
    Without: the exchange a replica saves less its all-reduce and the cold part's
    sequence work, the cold part always exchanged alone (a lookup a sample at most
    counted). Without `options.hot_rows`: the whole table or nothing."""
    if inputs.world < 2 or budget_bytes <= 0:
        return 0, False
    candidates = sorted({t.rows, *(2**k for k in range(int(math.log2(max(t.rows, 1))) + 1))})
    fits = [h for h in candidates if h * inputs.row_bytes(t.dim) <= budget_bytes]
    if not options.hot_rows:
        fits = [h for h in fits if h == t.rows]
    if options.pooled_hot:
        cost = _table_cost(inputs, t, prices)
        modes = [False, True] if inputs.cold_only_exchange else [False]
        best = min(
            [
                (cost(0, False), 0, False),
                *(
                    (cost(h, sparse), h, sparse)
                    for h in fits
                    for sparse in modes
                    if not (sparse and h == t.rows)
                ),
            ]
        )
        return best[1], best[2]
    cov = inputs.coverage[t.name]
    exchange_s = prices.exchange_s * t.dim * FLOAT_BYTES
    seq_s = _sequence_s(inputs, t, prices)
    split_s = _split_s(t, prices)
    split = options.hot_rows and inputs.cold_only_exchange
    best_h, best_gain = 0, 0.0
    for h in fits if split else [h for h in fits if h == t.rows]:
        allreduce_s = ring_bytes(h * t.dim * t.weight_bytes, inputs.world)
        gain = -allreduce_s / inputs.network.allreduce.bytes_per_s
        if not split or h == t.rows:  # pooled, a cold part still sends a vector a sample
            gain += exchange_s * float(h == t.rows)
        else:  # a table looked up in no sample saves nothing; more than one lookup a
            # sample counts as one (this rule's, which `_table_cost` does not make)
            looked_up = min(1.0, t.lookups_per_sample)
            gain += cov(h) * looked_up * exchange_s
            gain -= (1 - cov(h)) * t.lookups_per_sample * seq_s + split_s
        if gain > best_gain:
            best_h, best_gain = h, gain
    return best_h, 0 < best_h < t.rows


def _split_s(t: TableStats, prices: _Prices) -> float:
    """A split table's own work a step (its remap, keys and sum; either exchange), at the
    rank where it is most."""
    return float(
        np.max(prices.split_table + prices.batch * t.lookups_per_sample * prices.split_lookup)
    )


def _sequence_s(inputs: PlanInputs, t: TableStats, prices: _Prices) -> float:
    """Sequence work per cold lookup a sample of a cold part exchanged alone: its owner's
    for every sample (the placer favours fast owners: the fastest's), and each rank's
    pooling of its own samples' (the busiest rank's)."""
    seq = prices.seq_lookup + t.dim * FLOAT_BYTES * prices.seq_byte
    return seq.min() * inputs.global_batch + float(np.max(prices.batch * seq))


def _table_cost(inputs: PlanInputs, t: TableStats, prices: _Prices):
    """cost(h, sparse): seconds a step the table adds with its hottest h rows replicated
    and the rest pooled (`sparse` False) or exchanged per lookup, as one table's estimate:
    - the exchange: a vector per sample pooled, one per cold lookup exchanged alone, none
      replicated whole; and the ids (forward only), which every column piece of a pooled
      part receives, where row parts share them;
    - the lookups made local: the hot rows' lookups move from the cold part's owners to
      every rank's own samples; the owners' share costs what it holds them above the
      cluster's balanced lookup time (its pieces at most one a rank: multi-hot tables and
      many ranks);
    - the replicated rows' all-reduce, a split table's own work (`_split_s`), and the
      sequence work of a cold part exchanged alone (its owner's for every sample, each
      rank's for its own)."""
    w, lookups = inputs.world, t.lookups_per_sample
    vector_s = prices.exchange_s * t.dim * FLOAT_BYTES
    id_s = prices.exchange_s * ID_BYTES / 2
    seq_s = _sequence_s(inputs, t, prices)
    split_s = _split_s(t, prices)
    owners_s = inputs.global_batch * lookups * t.dim * t.weight_bytes * prices.lookup_s
    columns = min(w, max(1, t.dim // MIN_COLS))
    level = max(prices.level_s, 1e-12)

    def above_level(share: float, most: int) -> tuple[float, int]:
        """The owners' time above the level for `share` of the lookups, and in how many
        pieces (at most `most`) the placer cuts them (about 1 / BALANCE_PIECES of a rank)."""
        pieces = int(min(most, max(1, math.ceil(BALANCE_PIECES * owners_s * share / level))))
        return max(0.0, owners_s * share / pieces - prices.level_s), pieces

    def cost(h: int, sparse: bool) -> float:
        if h == t.rows:
            cold, over, exchange = 0.0, 0.0, 0.0
        else:
            cold = 1 - inputs.coverage[t.name](h) if h else 1.0
            if sparse:  # row parts: each cold id to one part, a vector back per lookup
                over, _ = above_level(cold, min(w, t.rows - h))
                exchange = lookups * cold * (vector_s + id_s) + cold * lookups * seq_s
            else:
                over, pieces = above_level(cold, columns)
                exchange = vector_s + pieces * lookups * cold * id_s
        allreduce = ring_bytes(h * t.dim * t.weight_bytes, w) / inputs.network.allreduce.bytes_per_s
        return exchange + over + allreduce + (split_s if 0 < h < t.rows else 0.0)

    return cost


def _cut(
    p: Piece, cost: float, target: float, inputs: PlanInputs, row_parts: bool, limit: float
) -> list[Piece]:
    """A piece cut until each costs about `target` (at most one a rank) and needs at most
    `limit` bytes, in powers of two. A cold part exchanged as sequences is cut in row parts
    (an EmbeddingCollection shards table-wise here, and row parts keep every cold lookup
    one vector, where column pieces would each send one); other pieces column-wise (dims
    multiples of MIN_COLS), and in row parts only when even the narrowest columns are too
    large (each row part then sends a whole vector per sample)."""
    t, world = p.table, inputs.world

    def need(rows: int, cols: int) -> float:
        return rows * inputs.row_bytes(cols)

    def rows_cut(k: int) -> list[Piece]:
        most = min(p.rows, MAX_ROW_PARTS_PER_RANK * world)  # each part adds its buffers
        while need(math.ceil(p.rows / k), p.cols) > limit and 2 * k <= most:
            k *= 2
        rows = cold_part_rows(p.rows, k)
        return [
            Piece(
                t,
                rows[j],
                p.cols,
                p.lookup_share * rows[j] / p.rows,
                p.sparse_exchange,
                part=j,
                hot=p.hot,
            )
            for j in range(k)
        ]

    if p.sparse_exchange:
        k = 1
        while row_parts and cost / k > target and 2 * k <= min(world, p.rows):
            k *= 2
        return rows_cut(k)
    k = 1
    while (
        t.dim % (2 * k) == 0
        and t.dim // (2 * k) >= MIN_COLS
        and ((cost / k > target and 2 * k <= world) or need(p.rows, t.dim // k) > limit)
    ):
        k *= 2
    if need(p.rows, t.dim // k) > limit:  # the narrowest columns are still too large
        return rows_cut(2)
    return [Piece(t, p.rows, t.dim // k, p.lookup_share, False, hot=p.hot) for _ in range(k)]
