"""Pipeline schedules, torch-free: what each of ``torch.distributed.pipelining``'s schedules needs (stages per rank,
where the stages sit, its microbatch rule), the split rule that balances blocks over stages, and the bubble each
schedule leaves. The strategy checks a run's options against these before workers start, and ``lightning-npu plan``
reads them too.

Sources (pipeline-facts.md): torch 2.13's ``schedules.py`` (the microbatch rules its constructors enforce), the
bubble fractions of GPipe / 1F1B ((p - 1) / m of the ideal step), interleaved 1F1B ((p - 1) / (v m), Narayanan et
al. 2021), zero bubble (ZBV ~0 at one activation set, Qi et al. 2024); MindSpeed-LLM and torchtitan balance the end
stages by counting the embedding and the head as blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence


@dataclass(frozen=True)
class Schedule:
    """One schedule: its torch class (``torch.distributed.pipelining.schedules``), how many stages each rank runs
    (``None``: any number >= 2, chosen by ``pipeline_stages_per_rank``), where a rank's stages sit (``"loop"``:
    ``r, r + pp, ...``; ``"v"``: ``r, 2 pp - 1 - r``, so rank 0 holds the first and the last stage), and whether it
    splits each backward into input and weight parts (the zero-bubble family)."""

    class_name: str
    stages_per_rank: Optional[int]
    style: str
    splits_backward: bool = False
    since: str = ""


#: The schedules npu_fsdp runs, by their option name (``pipeline_schedule``). ``since``: the torch release that has
#: the class (the strategy checks for the class itself).
SCHEDULES: dict[str, Schedule] = {
    "GPipe": Schedule("ScheduleGPipe", 1, "loop", since="2.4"),
    "1F1B": Schedule("Schedule1F1B", 1, "loop", since="2.4"),
    "Interleaved1F1B": Schedule("ScheduleInterleaved1F1B", None, "loop", since="2.4"),
    "ZBVZeroBubble": Schedule("ScheduleZBVZeroBubble", 2, "v", splits_backward=True, since="2.6"),
    "DualPipeV": Schedule("ScheduleDualPipeV", 2, "v", splits_backward=True, since="2.9"),
}
DEFAULT_SCHEDULE = "1F1B"


def check_schedule(value: object) -> str:
    """``value`` if it names one of ``SCHEDULES``; ValueError with the choices otherwise."""
    if value not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={value!r} is not one of {', '.join(map(repr, SCHEDULES))}")
    return value  # type: ignore[return-value]


def stages_per_rank(schedule: str, requested: Optional[int] = None) -> int:
    """How many stages each rank runs under ``schedule``: its fixed number, or ``requested`` (default 2 for a
    schedule that takes any number); ValueError with the fix when ``requested`` does not fit the schedule."""
    fixed = SCHEDULES[schedule].stages_per_rank
    if fixed is None:
        value = 2 if requested is None else requested
        if value < 2:
            raise ValueError(f"pipeline_schedule={schedule!r} interleaves several stages on each rank:"
                             f" pipeline_stages_per_rank={value} must be at least 2")
        return value
    if requested is not None and requested != fixed:
        raise ValueError(f"pipeline_schedule={schedule!r} runs {fixed} stage(s) per rank, not"
                         f" pipeline_stages_per_rank={requested}; leave it unset or use another schedule")
    return fixed


def check_microbatches(schedule: str, microbatches: int, pp: int, per_rank: int) -> None:
    """ValueError, with the rule and a count that works, unless ``schedule`` takes ``microbatches`` per step over
    ``pp`` ranks of ``per_rank`` stages (torch's constructors refuse the rest, or a step hangs on them)."""
    stages = pp * per_rank
    if microbatches < 1:
        raise ValueError(f"pipeline_microbatches={microbatches} must be at least 1")
    if schedule in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ValueError(f"pipeline_schedule={schedule!r} needs at least as many microbatches as stages ({stages}):"
                         f" pipeline_microbatches={microbatches}; use {stages} or more")
    if schedule == "Interleaved1F1B" and microbatches % max(1, microbatches // pp):
        raise ValueError(f"pipeline_schedule='Interleaved1F1B' runs the microbatches in rounds of pp={pp}:"
                         f" pipeline_microbatches={microbatches} must be a multiple of max(1, microbatches // pp);"
                         f" use a multiple of {pp}")


def default_microbatches(schedule: str, pp: int, per_rank: int) -> int:
    """The microbatches per step when the options leave them unset: one per stage (the fewest every schedule
    takes; more shrink the bubble, at the cost of smaller matmuls)."""
    return pp * per_rank


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank ``pp_rank`` runs (see ``Schedule.style``)."""
    if SCHEDULES[schedule].style == "v":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(per_rank))


def last_stage_rank(schedule: str, pp: int, per_rank: int) -> int:
    """The pipeline rank holding the last stage (where the loss is computed)."""
    return 0 if SCHEDULES[schedule].style == "v" else (pp * per_rank - 1) % pp


def blocks_per_stage(num_blocks: int, num_stages: int, *, schedule: str = DEFAULT_SCHEDULE, input_weight: int = 1,
                     output_weight: int = 1, layers_per_stage: Optional[Sequence[int]] = None) -> list[list[int]]:
    """The block indices each stage holds, in stage order: contiguous, every block once.

    The rule, where a rank's stages loop (``r, r + pp, ...``): the first stage's inputs (the embedding) count as
    ``input_weight`` blocks and the last stage's outputs (the final norm and head) as ``output_weight``, and the
    ``num_blocks + input_weight + output_weight`` units are spread as evenly as they go, the remainder to the middle
    stages first, then the first, then the last; so the end stages take fewer blocks (8 blocks on 4 stages: 1, 3, 3,
    1). Under a V-shaped schedule (ZBV, DualPipeV) rank 0 holds both end stages, so lighter ends would make rank 0 the
    lighter rank (measured: 8 blocks as 1, 3, 3, 1 on 2 ranks idled rank 0 60% of a ZBV step, 2, 2, 2, 2 took 28%
    less time): there every rank takes an equal share of the blocks (the remainder to the last ranks, rank 0
    carrying the embedding and head), split between its two stages. ``layers_per_stage`` overrides it: a count per
    stage (``[1, 3, 3, 1]``)."""
    if layers_per_stage is not None:
        return _explicit(num_blocks, num_stages, layers_per_stage)
    if num_stages == 1:
        return [list(range(num_blocks))]
    if SCHEDULES[schedule].style == "v":
        return _ranges(_v_counts(num_blocks, num_stages // 2))
    base, extra = divmod(num_blocks + input_weight + output_weight, num_stages)
    units = [base] * num_stages
    for stage in [*range(1, num_stages - 1), 0, num_stages - 1][:extra]:
        units[stage] += 1
    counts = list(units)
    counts[0] -= input_weight
    counts[-1] -= output_weight
    if min(counts) < 0:
        raise ValueError(
            f"{num_blocks} blocks do not spread over {num_stages} pipeline stages once the embedding and the head count"
            f" as blocks (counts {counts}): use fewer stages (pipeline_parallel_size x pipeline_stages_per_rank), or"
            " give the layers of each stage"
        )
    return _ranges(counts)


def _v_counts(num_blocks: int, pp: int) -> list[int]:
    """Block counts of the ``2 pp`` stages of a V: rank ``r`` (stages ``r`` and ``2 pp - 1 - r``) gets an equal share,
    the first of its stages the larger half."""
    if num_blocks < pp:
        raise ValueError(f"{num_blocks} blocks do not spread over the {pp} ranks of a V-shaped pipeline: a rank would"
                         " hold no block (and nothing to train); use pipeline_parallel_size <= the blocks, or give the"
                         " layers of each stage")
    base, extra = divmod(num_blocks, pp)
    counts = [0] * (2 * pp)
    for rank in range(pp):
        share = base + (rank >= pp - extra)
        counts[rank], counts[2 * pp - 1 - rank] = share - share // 2, share // 2
    return counts


def _ranges(counts: Sequence[int]) -> list[list[int]]:
    start, out = 0, []
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out


def _explicit(num_blocks: int, num_stages: int, counts: Sequence[int]) -> list[list[int]]:
    if len(counts) != num_stages:
        raise ValueError(f"pipeline_layers_per_stage={list(counts)} gives {len(counts)} stages for {num_stages}")
    if sum(counts) != num_blocks:
        raise ValueError(f"pipeline_layers_per_stage={list(counts)} holds {sum(counts)} blocks, but the model has"
                         f" {num_blocks}: the counts must add up to them")
    return _ranges(counts)


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` ``"F"`` (forward), ``"B"`` (full backward), ``"I"`` / ``"W"`` (the
    zero-bubble schedules' backward for the input, then for the weights) of ``microbatch`` on ``stage``."""

    stage: int
    kind: str
    microbatch: int


def actions(schedule: str, pp_rank: int, pp: int, microbatches: int, per_rank: int = 1) -> list[Action]:
    """The computations pipeline rank ``pp_rank`` runs in one step, in the order torch 2.13's ``schedule`` runs them
    (its waits left out): what the planner replays to find the activations each rank keeps in flight. GPipe: every
    forward, then every backward. 1F1B: ``min(m, p - s)`` forwards, then a backward and a forward in turn. Interleaved
    1F1B: ``(v - 1) x mpr + 2 (p - 1 - r)`` warmup forwards (``mpr`` microbatches per round), round by round over the
    rank's stages, then 1F1B with the backward walking the stages in reverse. ZBV: the V's warmup (its first stage
    ``2 (p - r) - 1`` forwards, then both stages), steady F-I-W on each stage, the backwards' weight parts last.
    DualPipeV: the V's warmup (``2 (p - r - 1)`` forwards of the first stage, ``r + 1`` of both), ``p - r - 1`` I-W-F
    on the second stage, then pairs of a forward on one stage and a full backward (``B``) on the other (torch runs
    each pair's two in turn), full backwards to the middle of the cooldown and split ones after it, the weight halves
    last."""
    stages = stage_ids(schedule, pp_rank, pp, per_rank)
    if schedule == "GPipe":
        return ([Action(stages[0], "F", mb) for mb in range(microbatches)]
                + [Action(stages[0], "B", mb) for mb in range(microbatches)])
    if schedule == "1F1B":
        warmup = min(microbatches, pp - pp_rank)
        order = [Action(stages[0], "F", mb) for mb in range(warmup)]
        for mb in range(microbatches):
            order.append(Action(stages[0], "B", mb))
            if warmup + mb < microbatches:
                order.append(Action(stages[0], "F", warmup + mb))
        return order
    if schedule == "Interleaved1F1B":
        return _interleaved(stages, pp_rank, pp, microbatches)
    if schedule == "ZBVZeroBubble":
        return _zbv(stages, pp_rank, pp, microbatches)
    if schedule == "DualPipeV":
        return _dualpipev(stages, pp_rank, pp, microbatches)
    raise ValueError(f"pipeline_schedule={schedule!r}: its order is not modelled")


def _interleaved(stages: Sequence[int], rank: int, pp: int, microbatches: int) -> list[Action]:
    v = len(stages)
    per_round = microbatches // max(1, microbatches // pp)
    total = v * microbatches
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    done = {"F": [0] * v, "B": [0] * v}

    def next_action(kind: str, local: int) -> Action:
        mb = done[kind][local]
        done[kind][local] += 1
        return Action(stages[local], kind, mb)

    order = []
    for op in range(total + warmup):
        if op < total:  # forwards: round by round over the stages, in order
            order.append(next_action("F", (op // per_round) % v))
        if op >= warmup:  # backwards: round by round over the stages, in reverse
            order.append(next_action("B", v - 1 - ((op - warmup) // per_round) % v))
    return order


def _zbv(stages: Sequence[int], rank: int, pp: int, microbatches: int) -> list[Action]:
    first, second = stages
    counts = {(stage, kind): 0 for stage in stages for kind in "FIW"}
    order: list[Action] = []

    def run(stage: int, *kinds: str) -> None:
        for kind in kinds:
            order.append(Action(stage, kind, counts[stage, kind]))
            counts[stage, kind] += 1

    target = max(2 * pp - 1, microbatches)  # torch plans at least a full V, then drops the extra microbatches
    for _ in range(2 * (pp - rank) - 1):
        run(first, "F")
    for _ in range(rank):
        run(second, "F")
        run(first, "F")
    for _ in range(pp - rank):
        run(second, "F", "I", "W")
    while counts[second, "F"] < counts[first, "F"] or counts[first, "F"] < target:
        if counts[first, "F"] < target:
            run(first, "F")
        run(first, "I", "W")
        run(second, "F", "I", "W")
    for _ in range(rank):
        run(first, "I")
        run(second, "I")
    for _ in range(pp - rank):
        run(first, "I", "W")
    for stage in (second, first):
        while counts[stage, "W"] < counts[stage, "I"]:
            run(stage, "W")
    return [action for action in order if action.microbatch < microbatches]


def _dualpipev(stages: Sequence[int], rank: int, pp: int, microbatches: int) -> list[Action]:
    first, second = stages
    forwards = {stage: 0 for stage in stages}
    backwards = {stage: 0 for stage in stages}  # the next backward's microbatch, full or input half
    owed: list[Action] = []  # the weight halves of the split backwards, oldest first
    order: list[Action] = []

    def forward(stage: int) -> None:
        order.append(Action(stage, "F", forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, split: bool) -> None:
        microbatch = backwards[stage]
        backwards[stage] += 1
        order.append(Action(stage, "I" if split else "B", microbatch))
        if split:
            owed.append(Action(stage, "W", microbatch))

    def weight() -> None:
        if owed:
            order.append(owed.pop(0))

    for _ in range(2 * (pp - rank - 1)):
        forward(first)
    for _ in range(rank + 1):
        forward(first)
        forward(second)
    for _ in range(pp - rank - 1):
        backward(second, split=True)
        weight()
        forward(second)
    for _ in range(microbatches - 2 * pp + rank + 1):  # torch's overlapped pairs, each forward then backward
        forward(first)
        backward(second, split=False)
        forward(second)
        backward(first, split=False)
    for _ in range(pp - rank - 1):
        backward(second, split=False)
        forward(second)
        backward(first, split=False)
    # The cooldown splits its backwards from its middle on: an odd rank from the second stage's, an even one from
    # the first's.
    cooldown, middle = rank + 1, (rank + 1) // 2
    for i in range(cooldown):
        backward(second, split=i > middle or (i == middle and rank % 2 == 1))
        backward(first, split=i >= middle)
    for _ in range(pp - rank - 1):
        weight()
        backward(first, split=True)
    for _ in range(rank + 1):
        weight()
    return order


#: The relative cost of each computation in ``replayed_bubble``: a backward is two forwards (its input and weight
#: halves one each under the zero-bubble schedules).
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class Timed(NamedTuple):
    """An ``Action`` as the replay runs it: from ``start`` for ``duration`` (in forward passes of one stage)."""

    start: float
    duration: float
    action: Action


def replay(schedule: str, pp: int, microbatches: int, per_rank: int = 1,
           costs: Optional[dict[str, float]] = None) -> list[list[Timed]]:
    """Each pipeline rank's ``actions`` with when it runs them, when every rank runs its actions in order, each as
    soon as the rank is free and its inputs exist (a forward after the previous stage's, a backward after its own
    forward and the next stage's backward, a weight pass after its input pass), at ``costs`` per equal stage
    (``COSTS`` unless given) and free communication. What ``replayed_bubble`` measures and the parallelism page
    draws (``tools/generate_docs.py``)."""
    costs = COSTS if costs is None else {**COSTS, **costs}
    orders = {rank: actions(schedule, rank, pp, microbatches, per_rank) for rank in range(pp)}
    last = pp * per_rank - 1
    done: dict[tuple[int, str, int], float] = {}
    clock, position = [0.0] * pp, [0] * pp
    timeline: list[list[Timed]] = [[] for _ in range(pp)]

    def needs(action: Action) -> list[tuple[int, str, int]]:
        stage, kind, mb = action
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "I", mb)]
        if stage == last:
            return [(stage, "F", mb)]
        after = (stage + 1, "B", mb) if (stage + 1, "B", mb) in done else (stage + 1, "I", mb)
        return [(stage, "F", mb), after]

    remaining = sum(len(order) for order in orders.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            action = orders[rank][position[rank]]
            inputs = needs(action)
            if all(key in done for key in inputs):
                start = max([clock[rank], *(done[key] for key in inputs)])
                clock[rank] = start + costs[action.kind]
                timeline[rank].append(Timed(start, costs[action.kind], action))
                done[tuple(action)] = clock[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise AssertionError(f"{schedule}: the ranks' orders wait on each other ({position})")
    return timeline


def replayed_bubble(schedule: str, pp: int, microbatches: int, per_rank: int = 1,
                    costs: Optional[dict[str, float]] = None) -> list[float]:
    """Each pipeline rank's idle share of a step as ``replay`` runs the schedule: the bubble the schedule's order
    leaves, to set beside ``bubble_fraction``'s formula."""
    timeline = replay(schedule, pp, microbatches, per_rank, costs)
    step = max(timed.start + timed.duration for rank in timeline for timed in rank)
    return [1.0 - sum(timed.duration for timed in rank) / step for rank in timeline]


def bubble_fraction(schedule: str, pp: int, microbatches: int, per_rank: int = 1) -> float:
    """The share of a step each rank idles, from the schedule's formula (equal stages, backward = 2 x forward):
    GPipe and 1F1B (p - 1) / (m + p - 1); interleaved 1F1B (p - 1) / (v m + p - 1); ZBV and DualPipeV about 0
    (their weight-gradient work fills the bubble). ``replayed_bubble`` gives the same for the first three from
    torch's order; for ZBV it finds what torch's order leaves at few microbatches (5.9% at p 4, m 8), and for
    DualPipeV the same as ZBV's at every p and m (2 to 8 ranks, up to 32 microbatches): with free communication and
    torch running each overlapped pair's forward and backward in turn, its order leaves ZBV's bubble."""
    if pp == 1:
        return 0.0
    if SCHEDULES[schedule].splits_backward:
        return 0.0
    v = per_rank if schedule == "Interleaved1F1B" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


__all__ = ["Action", "COSTS", "DEFAULT_SCHEDULE", "SCHEDULES", "Schedule", "Timed", "actions", "blocks_per_stage",
           "bubble_fraction", "check_microbatches", "check_schedule", "default_microbatches", "last_stage_rank",
           "replay", "replayed_bubble", "stage_ids", "stages_per_rank"]
