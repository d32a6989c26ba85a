"""The stage layout's pipeline schedules (bench_stage.py, torch.distributed.pipelining), one table: for each
--schedule its torch class, whether a task holds several stages and which, the order of the actions a task runs
(what kit.memory replays and kit.speed simulates), the first torch release that has it (and runs it on gloo), its
rules on --pp and --chunks, and the schedule that keeps fewer micro-batches alive (kit.memory's fixes).
Owns: SCHEDULES, Schedule, Action and the action orders. Imports: kit.findings (no torch: the checker's path).

Adding a schedule is a row of SCHEDULES and its order function (pp, virtual, chunks, rank) -> [Action, ...]. An
action is (kind, micro-batch, stage), with torch's letters (_ComputationType in torch/distributed/pipelining/
schedules.py): F a forward, B a full backward, I the backward for the input's gradient alone and W the one for the
weights' gradients (the zero-bubble schedules split B into I then W). The stage is the pipeline's own index
(0 .. pp * stages per task - 1); which ones a task holds is the row's placement: "loop" (task r: r, r + pp, ...) or
"v" (task r: r and 2 * pp - 1 - r, the V-shaped zero-bubble schedules). A name that is not a row is an error
everywhere (UnknownSchedule), never another schedule's order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kit.findings import Findings

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


class Action(NamedTuple):
    """One computation a task runs: a forward or a backward (B full; I, W its two halves) of one micro-batch on one
    stage of the pipeline."""
    kind: str
    mb: int
    stage: int


class UnknownSchedule(ValueError):
    """A --schedule name that is not a row of SCHEDULES."""


# The rules a schedule sets on the pipeline's stages and micro-batches: each adds its refusal, with the fix, to the
# findings. The checker and the trainers refuse on them (kit.trainer_checks.check_stage).
Rule = Callable[[str, int, int, int, Findings], None]  # (schedule, pp, chunks, virtual, findings)


def chunks_at_least_stages(name: str, pp: int, chunks: int, virtual: int, findings: Findings) -> None:
    """Schedule1F1B asks for a micro-batch per stage at least (torch raises later, in the first step)."""
    if chunks < pp:
        findings.error("chunks-below-stages", f"--schedule {name} needs --chunks >= the {pp} stages of a pipeline "
                       f"(got {chunks}): try --chunks {pp * 2} or --schedule gpipe")


def chunks_in_rounds(name: str, pp: int, chunks: int, virtual: int, findings: Findings) -> None:
    """The interleaved schedules run the micro-batches in rounds of chunks // (chunks // pp)."""
    rounds = max(1, chunks // pp)
    if chunks % rounds:
        findings.error("chunks-not-rounds", f"--schedule {name} needs --chunks to be a multiple of chunks // pp = "
                       f"{rounds} (got {chunks}); try --chunks {rounds * pp}")


def two_stages_a_task(name: str, pp: int, chunks: int, virtual: int, findings: Findings) -> None:
    """The V schedules run exactly two stages a task (torch: "ZBV requires exactly 2 stages per rank")."""
    if virtual != 2:
        findings.error("v-two-stages", f"--schedule {name} runs exactly 2 stages a task (a V: task r holds stages r "
                       f"and 2 x pp - 1 - r), not --virtual-stages {virtual}: give --virtual-stages 2 (the default), "
                       "or --schedule interleavedzerobubble for more stages a task")


def chunks_at_least_all_stages(name: str, pp: int, chunks: int, virtual: int, findings: Findings) -> None:
    """ScheduleDualPipeV asks for a micro-batch per stage of the V at least: 2 x pp (torch raises at its build)."""
    if chunks < 2 * pp:
        findings.error("chunks-below-stages", f"--schedule {name} needs --chunks >= the 2 x {pp} = {2 * pp} stages "
                       f"of its V (got {chunks}): try --chunks {2 * pp} or --schedule zbvzerobubble")


def _numbered(steps: list[tuple[str, int]]) -> list[Action]:
    """(kind, stage) steps with each stage's micro-batches numbered in the order they come, per kind."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for kind, stage in steps:
        mb = seen[kind, stage] = seen.get((kind, stage), -1) + 1
        out.append(Action(kind, mb, stage))
    return out


# The orders, from torch/distributed/pipelining/schedules.py (2.13; the same in 2.4.1): ScheduleGPipe and
# Schedule1F1B's _step_microbatches, ScheduleLoopedBFS's and ScheduleInterleaved1F1B's _calculate_single_rank_
# operations (_get_warmup_ops, _get_1f1b_rank_ops), without their no-op padding.
def gpipe_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """Every forward, then every backward, micro-batches in order."""
    return ([Action(FORWARD, i, rank) for i in range(chunks)]
            + [Action(BACKWARD, i, rank) for i in range(chunks)])


def one_f_one_b_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """min(chunks, pp - rank) forwards, then a backward and a forward in turn, then the backwards left."""
    warm = min(chunks, pp - rank)
    steps = ([(FORWARD, rank)] * warm + [s for _ in range(chunks - warm) for s in ((BACKWARD, rank), (FORWARD, rank))]
             + [(BACKWARD, rank)] * warm)
    return _numbered(steps)


def looped_bfs_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """Each stage's forwards in turn, then the stages' backwards in reverse, each stage's micro-batches last first."""
    stages = loop_placement(rank, pp, virtual)
    return ([Action(FORWARD, i, s) for s in stages for i in range(chunks)]
            + [Action(BACKWARD, i, s) for s in reversed(stages) for i in reversed(range(chunks))])


def interleaved_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """(virtual - 1) x chunks-per-round + 2 x (pp - 1 - rank) forwards over the task's stages, then one backward
    and one forward in turn, then the backwards left."""
    per_round = chunks // max(1, chunks // pp)
    warm = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), chunks * virtual)
    steps: list[tuple[str, int]] = []
    for op in range(chunks * virtual + warm):
        if op < chunks * virtual:
            steps.append((FORWARD, ((op // per_round) % virtual) * pp + rank))
        if op >= warm:
            steps.append((BACKWARD, (virtual - 1 - ((op - warm) // per_round) % virtual) * pp + rank))
    return _numbered(steps)


# The zero-bubble orders, from the same file: ScheduleInterleavedZeroBubble's _calculate_single_rank_operations
# (_get_warmup_ops with multiply_factor=1 and _get_1f1b_rank_ops with enable_zero_bubble: each backward is I, and its
# W follows once rank backwards are behind it), ScheduleZBVZeroBubble's and ScheduleDualPipeV's (their V: task r holds
# stages r and 2 pp - 1 - r). Their padding (None) is left out; _add_bubbles_to_actions only adds padding. DualPipeV's
# OVERLAP_F_B runs its forward, then its full backward (_PipelineScheduleRuntime._step_microbatches).
def interleaved_zero_bubble_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """(virtual - 1) x chunks-per-round + pp - 1 - rank forwards, then a forward and an input backward (I) in turn,
    each I's weight backward (W) `rank` backwards later, then the I and W left."""
    per_round = chunks // max(1, chunks // pp)
    warm = min((virtual - 1) * per_round + (pp - 1 - rank), chunks * virtual)
    ops = chunks * virtual

    def back(op: int) -> int:
        return (virtual - 1 - ((op - warm) // per_round) % virtual) * pp + rank
    steps: list[tuple[str, int]] = []
    backs: list[int] = []  # the ops whose I ran, in order: their W follow in the same order
    weights = 0
    for op in range(ops + warm):
        if op < ops:
            steps.append((FORWARD, ((op // per_round) % virtual) * pp + rank))
        if op >= warm:
            steps.append((BACKWARD_INPUT, back(op)))
            backs.append(op)
            if op - warm >= rank:
                steps.append((BACKWARD_WEIGHT, back(backs[weights])))
                weights += 1
    steps += [(BACKWARD_WEIGHT, back(op)) for op in backs[weights:]]
    return _numbered(steps)


def zbv_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """The V of ScheduleZBVZeroBubble on stages rank (going down) and 2 pp - 1 - rank (coming back), planned for
    max(2 pp - 1, chunks) micro-batches and cut to `chunks` (as torch does)."""
    n, s0, s1 = max(2 * pp - 1, chunks), rank, 2 * pp - 1 - rank
    steps = [(FORWARD, s0)] * (2 * (pp - rank) - 1) + [(x, s) for _ in range(rank) for x, s in
                                                       ((FORWARD, s1), (FORWARD, s0))]
    steps += [(x, s1) for _ in range(pp - rank) for x in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)]
    f0, f1 = 2 * (pp - rank) - 1 + rank, pp
    while f1 < f0 or f0 < n:
        if f0 < n:
            steps.append((FORWARD, s0))
            f0 += 1
        steps += [(BACKWARD_INPUT, s0), (BACKWARD_WEIGHT, s0), (FORWARD, s1), (BACKWARD_INPUT, s1),
                  (BACKWARD_WEIGHT, s1)]
        f1 += 1
    i0 = i1 = 0  # the cool-down's input backwards not yet followed by their W, per stage
    for _ in range(rank):
        steps += [(BACKWARD_INPUT, s0), (BACKWARD_INPUT, s1)]
        i0, i1 = i0 + 1, i1 + 1
    steps += [x for _ in range(pp - rank) for x in ((BACKWARD_INPUT, s0), (BACKWARD_WEIGHT, s0))]
    steps += [(BACKWARD_WEIGHT, s1)] * i1 + [(BACKWARD_WEIGHT, s0)] * i0
    return [a for a in _numbered(steps) if a.mb < chunks]


def dualpipev_order(pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
    """DeepSeek's DualPipeV on the V (stages rank and 2 pp - 1 - rank): forwards, then forward and backward pairs
    (some backwards full, B, some split, I then W later), then the backwards and W left."""
    s0, s1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    count: dict[tuple[str, int], int] = {}
    queue: list[tuple[int, int]] = []  # the I waiting for their W, oldest first

    def add(kind: str, stage: int) -> None:
        key = (FORWARD if kind == FORWARD else BACKWARD_INPUT, stage)  # B and I share their micro-batch count
        mb = count[key] = count.get(key, -1) + 1
        out.append(Action(kind, mb, stage))
        if kind == BACKWARD_INPUT:
            queue.append((stage, mb))

    def weight() -> None:
        if queue:
            stage, mb = queue.pop(0)
            out.append(Action(BACKWARD_WEIGHT, mb, stage))
    for _ in range(2 * (pp - rank - 1)):
        add(FORWARD, s0)
    for _ in range(rank + 1):
        add(FORWARD, s0), add(FORWARD, s1)
    for _ in range(pp - rank - 1):
        add(BACKWARD_INPUT, s1), weight(), add(FORWARD, s1)
    for i in range(chunks - 2 * pp + rank + 1):
        add(FORWARD, s0), add(BACKWARD, s1), add(FORWARD, s1), add(BACKWARD, s0)
    for _ in range(pp - rank - 1):
        add(BACKWARD, s1), add(FORWARD, s1), add(BACKWARD, s0)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add(BACKWARD_INPUT if split else BACKWARD, s1)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add(BACKWARD_INPUT if split else BACKWARD, s0)
    for _ in range(pp - rank - 1):
        weight(), add(BACKWARD_INPUT if split else BACKWARD, s0)
    for _ in range(rank + 1):
        weight()
    return out


def loop_placement(rank: int, pp: int, virtual: int) -> list[int]:
    """Task `rank` of a pipeline holds stages rank, rank + pp, rank + 2 pp, ... (`virtual` of them)."""
    return [rank + k * pp for k in range(virtual)]


def v_placement(rank: int, pp: int, virtual: int) -> list[int]:
    """The V: task `rank` holds stage rank going down and stage 2 pp - 1 - rank coming back (two a task)."""
    return [rank, 2 * pp - 1 - rank]


PLACEMENTS = {"loop": loop_placement, "v": v_placement}


@dataclass(frozen=True)
class Schedule:
    """One --schedule: the torch class bench_stage.py builds, and what the checker, the memory and speed models and
    the release table know of it."""
    name: str  # --schedule
    torch_class: str  # its class in torch.distributed.pipelining
    order: Callable[[int, int, int, int], list[Action]]  # (pp, virtual, chunks, rank): what task `rank` runs
    multi_stage: bool = False  # several stages a task (a PipelineScheduleMulti: a list of stages)
    placement: str = "loop"  # which stages a task holds: PLACEMENTS
    fixed_stages: int | None = None  # stages a task whatever --virtual-stages (2 for a V), where multi-stage
    first: tuple[int, int] = (2, 4)  # the first torch release with the class
    gloo_first: tuple[int, int] | None = None  # the first that runs it on gloo (the CPU), where later than `first`
    gloo_why: str = ""  # why not before gloo_first, where not pytorch#132644's hang (kit.releases says it)
    rules: tuple[Rule, ...] = ()
    lighter: str | None = None  # a schedule with fewer micro-batches alive, for the same pipeline (kit.memory's fixes)
    doc: str = field(default="", compare=False)

    def stages_per_rank(self, virtual: int) -> int:
        """The stages a task holds: one, --virtual-stages, or the row's fixed count."""
        if not self.multi_stage:
            return 1
        return self.fixed_stages or virtual

    def stages(self, rank: int, pp: int, virtual: int) -> list[int]:
        """The pipeline's stages that task `rank` holds, in the order of its local stages."""
        return PLACEMENTS[self.placement](rank, pp, self.stages_per_rank(virtual))

    def actions(self, pp: int, virtual: int, chunks: int, rank: int) -> list[Action]:
        """What task `rank` of a pipeline of `pp` tasks runs in one step of `chunks` micro-batches, in order."""
        return self.order(pp, self.stages_per_rank(virtual), chunks, rank)

    def check(self, pp: int, chunks: int, virtual: int, findings: Findings) -> None:
        """Its rules on this pipeline: each refusal added to `findings`."""
        for rule in self.rules:
            rule(self.name, pp, chunks, virtual, findings)


# The zero-bubble schedules (interleavedzerobubble, zbvzerobubble, dualpipev) split the weights' gradients out of
# the backward (I, then W later), which DDP's gradient hooks don't follow (ZB-V crashed with DDP here): bench_stage.py
# runs their stages without DDP and all-reduces the gradients over the replicas itself after the step
# (split_backward). Before 2.8, every schedule but GPipe batches a send with a receive and waits forever on one of
# the requests gloo returns (pytorch/pytorch#132644, fixed by #152938; kit.releases, docs/releases.md); nccl is not
# affected. Their first releases: ScheduleInterleavedZeroBubble 2.5, ScheduleZBVZeroBubble 2.6 (pytorch#138444),
# ScheduleDualPipeV 2.9 (docs/releases.md). Run in the lanes on gloo: interleavedzerobubble from 2.8, ZB-V not on 2.8
# (its gloo_why), both and DualPipeV on 2.13 and 2.14.
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", gpipe_order, lighter="1f1b",
             doc="fill and drain: every forward, then every backward (all micro-batches alive)"),
    Schedule("1f1b", "Schedule1F1B", one_f_one_b_order, gloo_first=(2, 8), rules=(chunks_at_least_stages,),
             doc="one forward, one backward: at most pp - rank micro-batches alive on task rank"),
    Schedule("interleaved1f1b", "ScheduleInterleaved1F1B", interleaved_order, multi_stage=True, gloo_first=(2, 8),
             rules=(chunks_in_rounds,), doc="1F1B over --virtual-stages looped stages a task"),
    Schedule("loopedbfs", "ScheduleLoopedBFS", looped_bfs_order, multi_stage=True, gloo_first=(2, 8),
             rules=(chunks_in_rounds,), lighter="1f1b",
             doc="breadth first over --virtual-stages looped stages a task: each stage's forwards, then backwards"),
    Schedule("interleavedzerobubble", "ScheduleInterleavedZeroBubble", interleaved_zero_bubble_order,
             multi_stage=True, first=(2, 5), gloo_first=(2, 8), rules=(chunks_in_rounds,), lighter="1f1b",
             doc="zero bubble (ZB1P) over --virtual-stages looped stages a task: backwards split, W fills the bubble"),
    Schedule("zbvzerobubble", "ScheduleZBVZeroBubble", zbv_order, multi_stage=True, placement="v", fixed_stages=2,
             first=(2, 6), gloo_first=(2, 13), rules=(two_stages_a_task,), lighter="1f1b",
             gloo_why="on torch 2.8's gloo a task of the V drops out in the first step (a peer closes the "
                      "connection; tests/test_zero_bubble.py in the 2.8.0 lane); it runs here on 2.13 and 2.14, "
                      "2.9 to 2.12 not tried",
             doc="zero bubble on a V of 2 stages a task (task r: r and 2 pp - 1 - r), backwards split"),
    Schedule("dualpipev", "ScheduleDualPipeV", dualpipev_order, multi_stage=True, placement="v", fixed_stages=2,
             first=(2, 9), rules=(two_stages_a_task, chunks_at_least_all_stages), lighter="1f1b",
             doc="DeepSeek's DualPipeV on the same V: forward and backward pairs, half the backwards split"),
)}

MULTI_STAGE = tuple(name for name, s in SCHEDULES.items() if s.multi_stage)


def split_backward(name: str) -> bool:
    """Whether --schedule `name` splits a backward into I and W (the zero-bubble schedules): DDP's hooks don't
    follow it, and the memory and speed models replay W apart. Read off its order on a small pipeline."""
    row = schedule(name)
    return any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for a in row.actions(2, 2, 4, 0))


def schedule(name: str) -> Schedule:
    """The row of `name`; UnknownSchedule (one line naming the schedules) for any other name."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise UnknownSchedule(f"schedule={name!r} is not a schedule of the kit: --schedule "
                              f"{'|'.join(SCHEDULES)}") from None


def stages_per_rank(name: str, virtual: int) -> int:
    """The stages a task holds under --schedule `name` with --virtual-stages `virtual`."""
    return schedule(name).stages_per_rank(virtual)


def depends(action: Action, stages: int) -> list[tuple[str, int, int]]:
    """What `action` waits for, as (kind, stage, micro-batch): a forward the previous stage's forward of its
    micro-batch; a backward (B, or I) its own forward and the next stage's backward (B or I: the same kind); W its
    own I."""
    kind, mb, s = action
    if kind == FORWARD:
        return [(FORWARD, s - 1, mb)] if s > 0 else []
    if kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, s, mb)]
    return [(FORWARD, s, mb)] + ([(kind, s + 1, mb)] if s < stages - 1 else [])


def most_alive(actions: list[Action]) -> int:
    """The most micro-batches forwarded and not yet done with at once on a task (all its stages): a forward
    starts one, a full backward (B) or the weights' backward (W) ends it."""
    alive = most = 0
    for a in actions:
        alive += 1 if a.kind == FORWARD else -1 if a.kind in (BACKWARD, BACKWARD_WEIGHT) else 0
        most = max(most, alive)
    return most
