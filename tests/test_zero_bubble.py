"""The zero-bubble schedules of the stage layout (issue 44): interleavedzerobubble, zbvzerobubble, dualpipev.
Their orders against torch's own, what torch accepts and runs against what the checker approves, their gradients
against the plain model's (2 pipelines: the kit's own all-reduce in place of DDP), learning, and the memory model's
replay of their split backward."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import kit.arguments
import kit.findings
import kit.releases
import kit.schedules
import kit.trainer_checks
from launch import ROOT, bench, run_tasks, srun_envs
from launch import stage_schedule_runs as runs

ZB = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")
STAGE = "bench_stage.py"




def torchs_order(name: str, pp: int, virtual: int, chunks: int) -> dict[int, list[tuple]]:
    """The class's own _calculate_single_rank_operations (private; this release's), padding dropped and
    DualPipeV's OVERLAP_F_B as its forward then its backward, as _PipelineScheduleRuntime runs them."""
    cls = getattr(pytest.importorskip("torch.distributed.pipelining.schedules"),
                  kit.schedules.SCHEDULES[name].torch_class, None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {kit.schedules.SCHEDULES[name].torch_class} to compare with")
    rounds = max(1, chunks // pp)
    self = types.SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=chunks,
                                 num_stages=pp * virtual, microbatches_per_round=chunks // rounds)
    out = {}
    for rank in range(pp):
        ops = [a for op in cls._calculate_single_rank_operations(self, rank) if op is not None
               for a in (getattr(op, "sub_actions", None) or (op,))]
        kinds = [a.computation_type for a in ops]  # the letter: the value from 2.9, str() of a number before
        out[rank] = [(k.value if isinstance(k.value, str) else str(k), a.microbatch_index, a.stage_index)
                     for k, a in zip(kinds, ops)]
    return out


@pytest.mark.parametrize("name", ZB)
def test_zero_bubble_orders_are_torchs(name):
    """Every task's order, action by action (F, B, I, W; micro-batch; stage), for pp 2 to 4 and 1 to 12 chunks."""
    row = kit.schedules.SCHEDULES[name]
    for pp in (2, 3, 4):
        for virtual in ((1, 2, 3) if row.placement == "loop" else (2,)):
            for chunks in range(1, 13):
                findings = kit.findings.Findings()
                row.check(pp, chunks, virtual, findings)
                if findings.errors:
                    continue
                theirs = torchs_order(name, pp, virtual, chunks)
                for rank in range(pp):
                    assert [tuple(a) for a in row.actions(pp, virtual, chunks, rank)] == theirs[rank], (
                        pp, virtual, chunks, rank)


@pytest.mark.parametrize("name,pp,chunks,alive", [
    ("interleavedzerobubble", 4, 8, [8, 8, 8, 8]), ("zbvzerobubble", 4, 8, [8, 8, 8, 8]),
    ("zbvzerobubble", 4, 4, [5, 6, 7, 8]), ("dualpipev", 4, 8, [9, 9, 9, 9])])
def test_the_split_backward_keeps_a_micro_batch_until_its_w(name, pp, chunks, alive):
    """Each micro-batch on each of a task's stages: one F, then its backward, either a full B or an I and later a
    W; it stays alive (most_alive) until its B or W. The V rows hold stages r and 2 pp - 1 - r."""
    row = kit.schedules.schedule(name)
    assert kit.schedules.split_backward(name) and row.lighter == "1f1b"
    assert [kit.schedules.most_alive(row.actions(pp, 2, chunks, r)) for r in range(pp)] == alive
    for rank in range(pp):
        actions, stages = row.actions(pp, 2, chunks, rank), row.stages(rank, pp, 2)
        if row.placement == "v":
            assert stages == [rank, 2 * pp - 1 - rank]
        for s in stages:
            for i in range(chunks):
                f = actions.index(("F", i, s))
                if ("B", i, s) in actions:
                    assert f < actions.index(("B", i, s)) and ("I", i, s) not in actions
                else:
                    assert f < actions.index(("I", i, s)) < actions.index(("W", i, s))
        assert {a.stage for a in actions} == set(stages)


CASES = ([[n, c, 2] for n in ZB for c in range(1, 7)] + [[n, 4, 3] for n in ZB])


@pytest.mark.multiproc
def test_torch_runs_exactly_what_the_checker_approves(tmp_path):
    """2 tasks: each (schedule, chunks, stages a task) built by torch itself and, where its constructor accepts it,
    one step run. The kit's rules (check_stage's) approve exactly those that ran, and refuse the others."""
    for name in ZB:
        runs(name)
    results = run_tasks([str(ROOT / "tests" / "zero_bubble_worker.py"), str(tmp_path), json.dumps(CASES)],
                        srun_envs(2), timeout=240)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:] + results[1].stderr[-3000:]
    seen = json.loads((tmp_path / "rank0.json").read_text())
    for name, chunks, virtual in CASES:
        t = kit.arguments.Training(layout="stage", pp=2, schedule=name, chunks=chunks, virtual_stages=virtual,
                                   batch_size=chunks * 4)
        findings = kit.findings.Findings()
        kit.trainer_checks.check_stage(2, [2], 2, t, findings)
        got = seen[f"{name} {chunks} {virtual}"]
        assert not got.startswith("failed"), (name, chunks, virtual, got)
        assert (got == "ran") == (not findings.errors), (name, chunks, virtual, got, findings.errors)


@pytest.mark.parametrize("argv,needle", [
    (["--schedule", "dualpipev", "--chunks", "2"],
     "--schedule dualpipev needs --chunks >= the 2 x 2 = 4 stages of its V (got 2): try --chunks 4"),
    (["--schedule", "zbvzerobubble", "--virtual-stages", "3"],
     "--schedule zbvzerobubble runs exactly 2 stages a task (a V: task r holds stages r and 2 x pp - 1 - r), not "
     "--virtual-stages 3: give --virtual-stages 2"),
    (["--schedule", "interleavedzerobubble", "--chunks", "5", "--batch-size", "20"],
     "--schedule interleavedzerobubble needs --chunks to be a multiple of chunks // pp = 2 (got 5)"),
    (["--schedule", "zbvzerobubble", "--chunks", "2"], None), (["--schedule", "dualpipev", "--chunks", "4"], None)])
def test_check_args_refuses_what_the_schedule_refuses(tmp_path, argv, needle):
    """bench_stage.py --check-args (no torch), as task 0 of 2: the refusal with its fix, or the run approved."""
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / STAGE), "--check-args", "--pp", "2", *argv, "--cache-dir",
                        str(tmp_path)], env=srun_envs(2)[0], capture_output=True, text=True, timeout=120)
    if needle:
        assert r.returncode == 1 and needle in r.stderr, r.stderr
    else:
        assert r.returncode == 0 and "would start" in r.stdout, r.stderr


@pytest.mark.core
@pytest.mark.multiproc
@pytest.mark.parametrize("name", [pytest.param(s, marks=pytest.mark.compat(f"stage {s}")) for s in ZB])
def test_zero_bubble_gradients_equal_the_plain_model(tmp_path, name):
    """2 pipelines x pp 2 (4 tasks), one step: every stage's gradients equal the plain model's (so GPipe's, which
    tests/test_stage.py holds to the same), the loss too: the kit's all-reduce over the replicas stands for DDP."""
    import test_stage
    test_stage.test_stage_gradients_equal_the_plain_model(tmp_path, runs(name), 2, 4)


@pytest.mark.multiproc
def test_zbv_learns_with_two_pipelines_in_sync(tmp_path):
    """bench_stage.py --schedule zbvzerobubble, 2 pipelines x pp 2: the loss falls, the replicas stay equal."""
    out = tmp_path / "runs.jsonl"
    results = bench(["--pp", "2", "--schedule", runs("zbvzerobubble"), "--chunks", "4", "--batch-size", "16",
                     "--nlayers", "4", "--synthetic", "400", "--epochs", "2", "--cache-dir", str(tmp_path),
                     "--json-out", str(out)], ntasks=4, script=STAGE)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:]
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["schedule"] == "zbvzerobubble" and record["replica_divergence"] == 0.0
    assert [p["stages"] for p in record["plans"]] == [[0, 3], [1, 2], [0, 3], [1, 2]]  # the V
    assert record["epochs"][1]["loss"] < record["epochs"][0]["loss"] and record["test_acc"] > 0.7


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["zbvzerobubble", "dualpipev"])
def test_split_backward_memory_within_targets_of_measured_peak(name):
    """kit.memory's replay of I and W (the tape alive until W, the gradients I leaves for it, no DDP buckets)
    against MemTracker's peak in bench_stage.py's own step, within the targets of the other schedules
    (benchmarks/memory_grid.py; its GraphOnly tracker, as ModTracker's hooks raise under the split backward)."""
    import importlib.util
    if importlib.util.find_spec("torch.distributed._tools.mem_tracker") is None:
        pytest.skip("torch < 2.5 has no MemTracker to measure with")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_grid
    [conf] = [c for c in memory_grid.STAGE if c["schedule"] == runs(name) and c["replicas"] == 1
              and not c["ckpt"]]
    rows = memory_grid.compare_stage(conf)
    assert len(rows) == 2 and all(r["buckets_estimated"] == 0 for r in rows)
    for r in rows:
        assert 1 - memory_grid.LOW <= r["ratio"] <= 1 + memory_grid.HIGH, (r["part"], r["ratio"], r["kinds"])


@pytest.mark.multiproc
def test_the_schedules_benchmark_times_what_torch_runs():
    """benchmarks/pipeline_schedules.py on one zero-bubble schedule and GPipe, one step each: every action of the
    kit's order was timed where torch ran it (so the order the prediction simulates is the one that ran), and the
    idle fractions are fractions."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import pipeline_schedules
    for name in ("gpipe", runs("zbvzerobubble")):
        r = pipeline_schedules.run(name, 4, 1)
        row = kit.schedules.schedule(name)
        expected: dict[str, int] = {}
        for rank in range(2):
            for a in row.actions(2, 2, 4, rank):
                expected[f"{a.kind} {a.stage}"] = expected.get(f"{a.kind} {a.stage}", 0) + 1
        assert r["timed"] == expected, (name, r["timed"])
        assert all(0 <= x < 1 for x in r["measured"] + r["predicted"]) and r["samples_per_s"] > 0, r


def weights_after_one_step(tmp_path, schedule: str) -> list[torch.Tensor]:
    """One whole training step (the update too) of 2 pipelines x pp 2: the first pipeline's weights in the model's
    order (stage by stage), whatever the cut into stages."""
    out = tmp_path / schedule
    out.mkdir()
    args = ["--pp", "2", "--schedule", schedule, "--chunks", "4", "--nlayers", "4", "--batch-size", "8",
            "--dropout", "0", "--seed", "11"]
    envs = [dict(env, STAGE_STEP_WEIGHTS="1") for env in srun_envs(4)]
    results = run_tasks([str(ROOT / "tests" / "stage_step_worker.py"), str(out), *args], envs)
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:]
    stages = {}
    for r in range(2):  # ranks 0 and 1: the first pipeline
        stages.update(torch.load(out / f"rank{r}.pt", weights_only=True)["weights"])
    return [w for s in sorted(stages) for w in stages[s]]


@pytest.fixture(scope="module")
def gpipe_weights(tmp_path_factory) -> list[torch.Tensor]:
    return weights_after_one_step(tmp_path_factory.mktemp("gpipe"), runs("gpipe"))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ZB)
def test_weights_after_one_step_equal_gpipes(tmp_path, name, gpipe_weights):
    """The same seed and batch: after one step (AdamW's update included) every weight equals GPipe's, the model cut
    in 4 stages (2 a task) against GPipe's 2."""
    mine, gpipe = weights_after_one_step(tmp_path, runs(name)), gpipe_weights
    assert len(mine) == len(gpipe) > 0
    # AdamW's first update is about lr x g / (|g| + eps): a gradient near eps turns the rounding of another
    # summation order (seen: 3e-6 on 1 weight of 8192) into more than the gradients' own 1e-6
    for a, b in zip(mine, gpipe):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_schedules_own_bubble():
    """--advise's bubble of a stage row: its schedule's order simulated with equal stages (kit.speed): GPipe's and
    1F1B's closed form (pp - 1) / (chunks + pp - 1), less for the interleaved and zero-bubble orders."""
    import kit.speed
    for pp, chunks in ((2, 4), (2, 8), (4, 8), (4, 16)):
        closed = (pp - 1) / (chunks + pp - 1)
        assert kit.speed.schedule_bubble("gpipe", pp, chunks) == pytest.approx(closed)
        assert kit.speed.schedule_bubble("1f1b", pp, chunks) == pytest.approx(closed)
        ours = [kit.speed.schedule_bubble(n, pp, chunks) for n in ZB if n != "dualpipev" or chunks >= 2 * pp]
        assert all(b < kit.speed.schedule_bubble("interleaved1f1b", pp, chunks) < closed for b in ours), ours
