"""The pipeline schedules' table (kit/schedules.py): each schedule's order of actions against torch's own, the
micro-batches it keeps alive, its placement and rules, and an unknown name refused everywhere (the table, the memory
and speed models, the releases, the checks), never another schedule's order."""
from __future__ import annotations

import pytest

import kit.arguments
import kit.findings
import kit.memory
import kit.releases
import kit.schedules
import kit.speed
import kit.trainer_checks


@pytest.mark.parametrize("schedule,virtual,chunks,rank,alive", [
    ("gpipe", 1, 8, 0, 8), ("1f1b", 1, 8, 0, 4), ("1f1b", 1, 8, 3, 1), ("1f1b", 1, 2, 0, 2),
    ("loopedbfs", 2, 4, 1, 8), ("interleaved1f1b", 2, 8, 0, 11), ("interleaved1f1b", 2, 8, 3, 5)])
def test_stage_schedules_keep_what_torch_keeps(schedule, virtual, chunks, rank, alive):
    """Micro-batches alive at most on a task (pp 4): 1F1B at most pp - rank, GPipe and LoopedBFS all; every
    micro-batch's forward is followed by its backward, on each of the task's stages."""
    row = kit.schedules.schedule(schedule)
    actions = row.actions(4, virtual, chunks, rank)
    assert kit.schedules.most_alive(actions) == alive
    assert row.stages(rank, 4, virtual) == [rank + k * 4 for k in range(row.stages_per_rank(virtual))]
    for s in row.stages(rank, 4, virtual):
        for i in range(chunks):
            assert actions.count(("F", i, s)) == actions.count(("B", i, s)) == 1
            assert actions.index(("F", i, s)) < actions.index(("B", i, s))
    assert {a.stage for a in actions} == set(row.stages(rank, 4, virtual))


def test_an_unknown_schedule_is_an_error_everywhere():
    """Never another schedule's order: the table, the memory model, the speed model's queues and the releases."""
    t = kit.arguments.Training(layout="stage", schedule="zb")
    with pytest.raises(kit.schedules.UnknownSchedule, match="schedule='zb' is not a schedule of the kit"):
        kit.schedules.schedule("zb")
    with pytest.raises(kit.schedules.UnknownSchedule):
        kit.memory.estimate_stage_memory(dict(kit.arguments.GPU_DEFAULTS), t, 2, 1)
    with pytest.raises(kit.schedules.UnknownSchedule):
        kit.speed._queues("stage", "zb", 2, 2, 4, False)
    with pytest.raises(kit.schedules.UnknownSchedule):
        kit.releases.torch_refusals("2.13.0", t, cpu=True)


@pytest.mark.parametrize("virtual,chunks", [(2, 4), (2, 8), (3, 12), (2, 2)])
def test_interleaved_order_is_torchs(virtual, chunks):
    """The interleaved schedule's order per task, micro-batch and stage, against torch's own _get_1f1b_rank_ops
    (private; this release's)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_get_1f1b_rank_ops") or not hasattr(schedules, "_get_warmup_ops"):
        pytest.skip("this torch has no _get_1f1b_rank_ops/_get_warmup_ops to compare with")
    pp = 4
    per_round = chunks // max(1, chunks // pp)
    for rank in range(pp):
        warm = schedules._get_warmup_ops(rank, virtual, per_round, pp, chunks)
        ops = schedules._get_1f1b_rank_ops(
            virtual, pp, warm, chunks * virtual - warm, warm, rank,
            lambda step: ((step // per_round) % virtual) * pp + rank,
            lambda step: (virtual - 1 - ((step - warm) // per_round) % virtual) * pp + rank)
        theirs = [("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index, a.stage_index)
                  for a in ops if a]
        assert kit.schedules.SCHEDULES["interleaved1f1b"].actions(pp, virtual, chunks, rank) == theirs


def test_each_schedule_has_its_torch_class_and_the_releases_read_the_table():
    """bench_stage.py builds the row's class; the stage layout is refused before 2.4 and, on gloo, a schedule with a
    later `gloo_first` before that release (the line of kit.releases, as the trainers and the checker print it)."""
    assert {n: s.torch_class for n, s in kit.schedules.SCHEDULES.items()} == {
        "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
        "loopedbfs": "ScheduleLoopedBFS", "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
        "zbvzerobubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
    assert kit.schedules.MULTI_STAGE == ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                                         "dualpipev")
    for name, row in kit.schedules.SCHEDULES.items():
        t = kit.arguments.Training(layout="stage", schedule=name)
        before = kit.releases.torch_refusals("2.3.1", t)
        assert before[0].startswith("the stage layout (bench_stage.py) needs torch >= 2.4"), before
        if row.first > (2, 6):  # DualPipeV (2.9): its class is the refusal, on any device
            assert kit.releases.torch_refusals("2.8.0", t)[0].startswith(f"--schedule {name} needs torch >= 2.9")
            assert not kit.releases.torch_refusals("2.14.1", t, cpu=True)
            continue
        on_gloo = kit.releases.torch_refusals("2.6.0", t, cpu=True)
        assert bool(on_gloo) == bool(row.gloo_first), name
        gloo = ".".join(map(str, row.gloo_first or (2, 8))) + ".0"  # from its gloo_first on, nothing refused
        assert not kit.releases.torch_refusals("2.6.0", t) and not kit.releases.torch_refusals(gloo, t, cpu=True)
    # ZB-V is refused on the CPU before 2.13, with its own reason (run in the 2.8.0 lane: a task dropped out)
    assert "a task of the V drops out" in kit.releases.torch_refusals(
        "2.8.0", kit.arguments.Training(layout="stage", schedule="zbvzerobubble"), cpu=True)[0]
    assert kit.releases.torch_refusals("2.5.1", kit.arguments.Training(layout="stage", schedule="zbvzerobubble")) == [
        "--schedule zbvzerobubble needs torch >= 2.6 (torch.distributed.pipelining.ScheduleZBVZeroBubble first ships "
        "in 2.6) but this is torch 2.5.1; use --schedule 1f1b, or module load pytorch-gpu/py3/2.6.0 or later"]
    assert kit.releases.torch_refusals("2.6.0", kit.arguments.Training(layout="stage", schedule="1f1b"), cpu=True) == [
        "--schedule 1f1b without a GPU (gloo) needs torch >= 2.8 (before 2.8 it waits forever on gloo, "
        "pytorch/pytorch#132644) but this is torch 2.6.0; use --schedule gpipe on the CPU (GPUs with nccl are not "
        "affected)"]


@pytest.mark.parametrize("schedule,chunks,code", [("1f1b", 1, "chunks-below-stages"), ("gpipe", 1, None),
                                                  ("interleaved1f1b", 5, "chunks-not-rounds"),
                                                  ("loopedbfs", 5, "chunks-not-rounds"), ("interleaved1f1b", 4, None),
                                                  ("interleavedzerobubble", 5, "chunks-not-rounds"),
                                                  ("zbvzerobubble", 1, None), ("dualpipev", 3, "chunks-below-stages"),
                                                  ("dualpipev", 4, None)])
def test_a_schedules_rules_are_the_checks(schedule, chunks, code):
    """The rules of a row are what check_stage refuses (the trainers' and the checker's one function)."""
    t = kit.arguments.Training(layout="stage", pp=2, schedule=schedule, chunks=chunks, batch_size=20)
    findings = kit.findings.Findings()
    kit.trainer_checks.check_stage(4, [4], 4, t, findings)
    assert [f.code for f in findings.errors] == ([code] if code else [])
    alone = kit.findings.Findings()
    kit.schedules.schedule(schedule).check(2, chunks, 2, alone)
    assert alone == findings.errors


def test_the_v_placement_and_the_split_backward():
    """What the zero-bubble rows use: the V placement (task r: r and 2 pp - 1 - r), the dependencies of a split
    backward (I after the next stage's I, W after its own I). The memory model replays I and W: on the first stage
    I runs nothing and W the whole backward (stage.py), so there GPipe's order split in two is GPipe's estimate less
    DDP's buckets (none: bench_stage.py all-reduces a split schedule's gradients itself)."""
    assert kit.schedules.v_placement(0, 4, 2) == [0, 7] and kit.schedules.v_placement(3, 4, 2) == [3, 4]
    A = kit.schedules.Action
    assert kit.schedules.depends(A("I", 2, 3), 8) == [("F", 3, 2), ("I", 4, 2)]
    assert kit.schedules.depends(A("W", 2, 3), 8) == [("I", 3, 2)] and kit.schedules.depends(A("F", 0, 0), 8) == []

    def split_order(pp, virtual, chunks, rank):
        return [A("F", i, rank) for i in range(chunks)] + [a for i in range(chunks) for a in (A("I", i, rank),
                                                                                              A("W", i, rank))]
    row = kit.schedules.Schedule("split", "ScheduleSplit", split_order)
    assert kit.schedules.most_alive(row.actions(2, 1, 4, 0)) == 4
    kit.schedules.SCHEDULES["split"] = row
    try:
        t = kit.arguments.Training(layout="stage", schedule="split")
        split = kit.memory.estimate_stage_memory(dict(kit.arguments.GPU_DEFAULTS), t, 2, 1)[0]
        gpipe = kit.memory.estimate_stage_memory(dict(kit.arguments.GPU_DEFAULTS),
                                                 kit.arguments.Training(layout="stage", schedule="gpipe"), 2, 1)[0]
        assert split.buckets == 0 < gpipe.buckets and split.peak == gpipe.peak - gpipe.buckets
        # the speed model: on the first stage I is free and W the whole backward, elsewhere each half of B. GPipe's
        # order split: stage 0 waits for stage 1's I of a micro-batch only, not its W (by hand: 14, GPipe's 15)
        part = {"f": 1.0, "b": 2.0}
        assert [kit.speed.op_time(part, k, s) for k in "FBIW" for s in (0, 1)] == [1, 1, 2, 2, 0, 1, 2, 1]
        queues = kit.speed._queues("stage", "split", 2, 2, 4, False)
        gpipe = kit.speed._queues("stage", "gpipe", 2, 2, 4, False)
        cost = lambda k, s: kit.speed.op_time(part, k, s)  # noqa: E731
        assert (kit.speed._simulate(queues, cost, 0.0, 2)[0], kit.speed._simulate(gpipe, cost, 0.0, 2)[0]) == (14, 15)
    finally:
        del kit.schedules.SCHEDULES["split"]
