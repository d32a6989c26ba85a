"""bench_stage.py: a task per GPU, torch.distributed.pipelining stages, DDP over each stage's dp group.
The same correctness tests as the page's layout: learning, replicas in sync, gradients of the plain model,
checkpoints (which move between the two layouts)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

import kit.arguments
import kit.plan
import kit.releases
from launch import ROOT, bench, run_tasks, srun_envs
from launch import stage_schedule_runs as runs

pytestmark = pytest.mark.multiproc
STAGE = "bench_stage.py"




# the learning test's schedule: 1f1b where this release runs it on the CPU, else gpipe
LEARN = "gpipe" if kit.releases.torch_refusals(
    torch.__version__, kit.arguments.Training(layout="stage", schedule="1f1b"), cpu=True) else "1f1b"


def ok(results) -> str:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"rank {i} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return results[0].stdout


@pytest.mark.core
@pytest.mark.compat("checkpoint moves")
def test_stage_layout_learns_in_sync_and_checkpoints(tmp_path):
    runs("gpipe")
    out, ckpt = tmp_path / "runs.jsonl", tmp_path / "stage.pt"
    stdout = ok(bench(["--pp", "2", "--schedule", LEARN, "--chunks", "2", "--batch-size", "32",
                       "--synthetic", "2000", "--epochs", "2", "--cache-dir", str(tmp_path), "--json-out", str(out),
                       "--save", str(ckpt)], ntasks=4, nodes=2, script=STAGE))
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (record["layout"], record["pp"], record["replicas"], record["nb_part"]) == ("stage", 2, 2, 2)
    assert record["replica_divergence"] == 0.0  # DDP over each stage's dp group kept the pipelines equal
    assert [p["stages"] for p in record["plans"]] == [[0], [1], [0], [1]]  # consecutive ranks form a pipeline
    assert [p["dp_rank"] for p in record["plans"]] == [0, 0, 1, 1]
    assert record["epochs"][1]["loss"] < record["epochs"][0]["loss"] and record["test_acc"] > 0.9
    assert "2 pipeline(s) x pp 2" in stdout
    # consolidated: the replica layout's keys, so the page's layout loads it (and the other way round)
    state = torch.load(ckpt)
    assert "0.0.embedding.weight" in state and "1.2.head.2.weight" in state
    assert torch.load(ckpt.with_name("stage.pt.resume.pt"), weights_only=False)["layout"]["nb_part"] == 2
    # each way back a few steps of the next epoch (--max-steps counts steps in all, the loaded ones too): loading,
    # a step and the epoch's end are what is tested, and whole epochs made this test 70-100 s in every lane
    [steps] = re.findall(r"checkpoint saved: \S+ \(epoch 2, step (\d+)\)", stdout)
    resumed = ok(bench(["--nb-part", "2", "--batch-size", "32", "--synthetic", "2000",
                        "--epochs", "3", "--max-steps", str(int(steps) + 3), "--cache-dir", str(tmp_path),
                        "--load", str(ckpt), "--save", str(tmp_path / "replica.pt")], ntasks=2))
    assert f"loaded {ckpt}: epoch 2" in resumed and "epoch   3 |" in resumed
    assert re.search(rf"checkpoint saved: \S+replica.pt \(epoch 3 up to batch 3/\d+, step {int(steps) + 3}\)", resumed)
    # 2 replicas x 32 saved it, one pipeline of 32 goes on: the same 192 samples of epoch 3 are 6 batches now
    back = ok(bench(["--pp", "2", "--schedule", "gpipe", "--chunks", "2", "--batch-size", "32",
                     "--synthetic", "2000", "--epochs", "4", "--max-steps", str(int(steps) + 6),
                     "--cache-dir", str(tmp_path), "--load", str(tmp_path / "replica.pt")], ntasks=2, script=STAGE))
    assert "+ 3 batches" in back and "this run skips 6 batches" in back and "epoch   3 |" in back


@pytest.mark.core
@pytest.mark.parametrize("schedule,virtual,chunks", [
    pytest.param(s, v, c, marks=pytest.mark.compat(f"stage {s}"))
    for s, v, c in [("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved1f1b", 2, 4), ("loopedbfs", 2, 4)]])
def test_stage_gradients_equal_the_plain_model(tmp_path, schedule, virtual, chunks):
    runs(schedule)
    args = ["--pp", "2", "--schedule", schedule, "--virtual-stages", str(virtual),
            "--chunks", str(chunks), "--nlayers", "4", "--batch-size", "8", "--dropout", "0", "--seed", "11"]
    ok(run_tasks([str(ROOT / "tests" / "stage_step_worker.py"), str(tmp_path), *args], srun_envs(4)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]

    sys.path.insert(0, str(ROOT / "tests"))
    import kit.train.parts
    import kit.train.setup
    import bench_stage
    import kit.plan
    from hybrid_step_worker import global_batch
    cfg = bench_stage.parse_args(args)
    kit.train.setup.resolve(cfg, cuda=False)
    parts = 2 * virtual
    reference = torch.nn.Sequential(*kit.train.parts.model_parts(cfg, kit.plan.plan_task(0, 0, 0, 1, [], None,
                                                                                          cfg.nlayers, parts)))
    x, y = global_batch(cfg, 2)  # 2 pipelines
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    expected = dict(reference.named_parameters())

    seen = {}
    for r in ranks:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
            seen[name] = True
    assert seen.keys() == expected.keys()  # every parameter lives on some stage
    lasts = [r["stats"] for r in ranks if r["last"]]
    assert len(lasts) == 2  # one last stage per pipeline
    mean_loss = sum(s[0] / s[2] for s in lasts) / 2
    torch.testing.assert_close(mean_loss.float(), loss.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args,code,needle", [  # 2: a value the argument definition refuses (argparse's status)
    (["--pp", "3"], 1, "--pp 3 must divide the world size (4 tasks)"),
    (["--pp", "2", "--schedule", "1f1b", "--chunks", "1"], 1, "--schedule 1f1b needs --chunks >= the 2 stages"),
    (["--pp", "1"], 2, "--pp 1 must be an integer from 2 to 1024 (a pipeline needs at least 2 stages"),
])
def test_stage_layout_bad_requests(tmp_path, args, code, needle):
    runs("gpipe")
    results = bench([*args, "--cache-dir", str(tmp_path)], ntasks=4, timeout=90, script=STAGE)
    assert all(r.returncode == code for r in results)
    assert needle in results[0].stderr and "Traceback" not in results[0].stderr


def test_watchdog_ends_a_blocked_task():
    # a rank blocked in a receive waits in C++ with the GIL released, out of reach of signal handlers; a blocked
    # Event.wait is the same from Python's side: the watchdog thread must end the process with one line, then the
    # stacks of its threads (where it was blocked)
    code = (f"import sys, threading; sys.path.insert(0, {str(ROOT)!r}); import bench_stage; "
            "bench_stage.Watchdog(2, 3, 'bench_stage', grace=1); threading.Event().wait(120)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 1 and time.monotonic() - t0 < 60, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("bench_stage: error: task 3 made no progress for"), r.stderr
    assert "(--timeout 2)" in lines[0] and "Traceback" not in r.stderr
    stacks = "\n".join(lines[1:])
    assert "most recent call first" in stacks and 'File "<string>", line 1 in <module>' in stacks, r.stderr


def test_both_layouts_have_every_member_of_the_trainer_protocol():
    """train() and the functions it calls take a kit.train.trainer.Trainer: the page's Replica or the stage layout's
    Stages. Each sets every attribute the base only names, and writes every method the base leaves to it; the step
    and the learning rate are the base's, one for both."""
    import inspect
    import bench_stage
    import kit.train.replica
    from kit.train.trainer import Trainer
    attributes = sorted(a for a in Trainer.__annotations__ if not hasattr(Trainer, a))
    methods = sorted(m for m, f in vars(Trainer).items() if inspect.isfunction(f)
                     and "NotImplementedError" in inspect.getsource(f))
    assert len(attributes) >= 8 and len(methods) >= 12, (attributes, methods)
    assert "train_step" not in methods and "set_lr" not in methods
    for cls in (kit.train.replica.Replica, bench_stage.Stages):
        source = inspect.getsource(cls)
        missing = [m for m in attributes if not re.search(rf"(self\.{m}\b[^=]*=|^    {m} = )", source, re.M)]
        missing += [m for m in methods if getattr(cls, m) is getattr(Trainer, m)]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert cls.train_step is Trainer.train_step and cls.set_lr is Trainer.set_lr  # the one step of both
