"""--model in the trainers and the checker (issue 34, item 1): models the kit did not write (tests/models_zoo.py's
conv stack and residual MLP) and the kit's own Transformer run for a few steps in both layouts on the CPU (gloo),
with the one split (kit.plan.layer_split) that the checker prints; the kit's Transformer through --model is today's
plan, and the same loss at step 1; a resume with another model, and a model that cannot run, are refused in one
line before any process group."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kit.arguments
import kit.plan
import kit.releases
from launch import ROOT, TORCH, bench, clean_env, copy_kit, run_tasks, srun_envs

pytestmark = pytest.mark.multiproc

ZOO = "tests/models_zoo.py"
MODELS = {  # name -> the trainer's --model and --sample, and whether the kit's data fits it (accuracy, learning)
    "conv": (["--model", f"{ZOO}:conv_stack", "--sample", f"{ZOO}:conv_sample"], False),
    "mlp": (["--model", f"{ZOO}:residual_mlp", "--sample", f"{ZOO}:mlp_sample", "--split", "time"], False),
    "kit": (["--model", f"{ZOO}:kit_transformer"], True),
}
SHORT = ["--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--chunks", "2", "--synthetic", "200"]
SPEED_ONLY = "measures speed, not learning"


def record_of(path: Path) -> dict:
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    return record


def split_line(out: str) -> str:
    """The trainer's line that says the split (kit.own_split.ModelPlan.text), as the checker's note says it."""
    [line] = [x.strip() for x in out.splitlines() if x.strip().startswith("--model ") and "sizes [" in x]
    return line


def test_the_even_split_of_the_kits_model_is_todays_plan():
    """layer_split over Encoder + nlayers blocks + Decoder (ends=True) is part_contents' plan, for every count."""
    for nlayers in range(1, 13):
        for nb_part in range(1, nlayers + 1):
            sizes = kit.plan.layer_split(nlayers + 2, nb_part, ends=True)
            blocks = kit.plan.part_sizes(nlayers, nb_part)
            assert sizes == [n + (p == 0) + (p == nb_part - 1) for p, n in enumerate(blocks)], (nlayers, nb_part)
    assert kit.plan.layer_split(7, 3) == kit.plan.part_sizes(7, 3)  # any other model: the page's even split
    assert kit.plan.layer_split(4, 2, costs=[1, 1, 1, 9]) == [3, 1]  # --split time|memory: balanced_sizes
    assert kit.plan.split_contents([3, 1, 2]) == ["layers 0-2", "layer 3", "layers 4-5"]


@pytest.mark.parametrize("name", list(MODELS))
def test_replica_layout_runs_the_users_model(tmp_path, name):
    """2 tasks x nb_part 2 (Pipe + DDP): a few steps, the replicas in sync, the record says the model, its split and
    whether it measured learning; rank 0 alone says a synthetic run measures speed only."""
    args, learns = MODELS[name]
    out = tmp_path / "run.jsonl"
    runs = bench([*args, *SHORT, "--nb-part", "2", "--cache-dir", str(tmp_path), "--json-out", str(out)], ntasks=2)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    record = record_of(out)
    assert record["model_spec"] == args[1] and record["learning"] is learns and record["replica_divergence"] == 0
    assert len(record["part_sizes"]) == 2 and record["layout"] == "replica"
    assert (SPEED_ONLY in runs[0].stdout) is not learns and SPEED_ONLY not in runs[1].stdout
    assert f"sizes {record['part_sizes']}" in split_line(runs[0].stdout)
    if not learns:
        assert record["loss_fn"] != "cross-entropy" and record["data"].startswith("synthetic batches")
        assert "| speed only |" in runs[0].stdout and "test acc" not in runs[0].stdout, runs[0].stdout
    # the trainer's own estimate of its GPUs (here the CPU's kernels): kit.own_split.own_memory, in the record
    assert record["estimated_mem_gb"] > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_stage_layout_runs_the_users_model(tmp_path, name):
    """bench_stage.py --pp 2 --schedule gpipe on 2 tasks: each stage a part of the same split."""
    if kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(layout="stage", schedule="gpipe"),
                                   cpu=True):
        pytest.skip("this torch has no stage layout on the CPU")
    args, learns = MODELS[name]
    out = tmp_path / "run.jsonl"
    runs = bench([*args, *SHORT, "--pp", "2", "--schedule", "gpipe", "--cache-dir", str(tmp_path), "--json-out",
                  str(out)], ntasks=2, script="bench_stage.py")
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    record = record_of(out)
    assert record["layout"] == "stage" and record["learning"] is learns and len(record["part_sizes"]) == 2
    assert f"sizes {record['part_sizes']}" in split_line(runs[0].stdout)


def test_the_kits_transformer_through_model_is_todays_run(tmp_path):
    """The same plan (Encoder with the first part, Decoder with the last), the same weights, the same step-1 loss."""
    losses, lines = [], []
    for extra in ([], MODELS["kit"][0]):
        out = tmp_path / f"run{len(losses)}.jsonl"
        [r] = bench([*extra, "--epochs", "1", "--max-steps", "1", "--synthetic", "200", "--cache-dir", str(tmp_path),
                     "--json-out", str(out)])
        assert r.returncode == 0, r.stderr[-3000:]
        losses.append(record_of(out)["epochs"][0]["loss"])
        lines.append(r.stdout)
    assert losses[0] == losses[1]
    assert "cpu: Encoder + Layer 0-1 | cpu: Layer 2-3 + Decoder" in lines[0]
    assert "cpu: layers 0-2 | cpu: layers 3-5" in lines[1] and "sizes [3, 3]" in split_line(lines[1])


JOB = ("#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=2 --gres=gpu:4 -c 10 --hint=nomultithread -t 1:00:00\n"
       f"module load pytorch-gpu/py3/{'.'.join(map(str, TORCH))}.0\n"
       "srun python bench_ddp_transformer.py {args}\n")


def check_job(folder: Path, line: list[str], job: str = JOB) -> subprocess.CompletedProcess:
    """The checker on a job script (in a user's copy of the kit) whose trainer line is `line`."""
    (folder / "job.slurm").write_text(job.format(args=" ".join(line)))
    return subprocess.run([sys.executable, "check_topology.py", "job.slurm"], cwd=folder, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_checker_prints_the_split_the_trainer_runs(tmp_path):
    """A user's copy of the kit and of their model file: the checker approves the job script's trainer line with
    --model and prints the split; the trainer, on the same line, logs the same split."""
    copy_kit(tmp_path, extra=(ZOO,))
    line = [*MODELS["mlp"][0], "--split", "memory", "--batch-size", "16", "--chunks", "4"]
    check = check_job(tmp_path, line)
    assert check.returncode == 0, check.stdout + check.stderr
    [note] = [x.strip()[len("note: "):] for x in check.stdout.splitlines() if x.strip().startswith("note: --model")]
    printed = note.split("; memory estimate")[0]
    assert "part 0: layers 0-" in printed and "cuda:1: layers" in check.stdout
    runs = run_tasks(["bench_ddp_transformer.py", *line, "--nb-part", "2", "--epochs", "1", "--max-steps", "1",
                      "--cache-dir", str(tmp_path)], srun_envs(2), cwd=tmp_path)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:]
    assert split_line(runs[0].stdout) == printed
    # the checker's own command line takes --model too, over the script's line
    again = subprocess.run([sys.executable, "check_topology.py", "job.slurm", "--split", "even"], cwd=tmp_path,
                           env=clean_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "--split even" in again.stdout, again.stdout + again.stderr


def test_activation_checkpointing_of_the_users_layers_changes_memory_not_the_run(tmp_path):
    """--activation-checkpointing with --model recomputes each user layer in the backward (kit.train.own
    .recompute_in_backward): the same losses as without it, in both layouts; the saved file (the page's state_dict)
    has the plain model's keys."""
    args = [*MODELS["mlp"][0], *SHORT, "--max-steps", "3", "--cache-dir", str(tmp_path)]
    losses = {}
    for layout, extra in (("replica", ["--nb-part", "2"]), ("stage", ["--pp", "2", "--schedule", "gpipe"])):
        for ckpt in (False, True):
            save = tmp_path / f"{layout}{ckpt}.pt"
            script = "bench_stage.py" if layout == "stage" else "bench_ddp_transformer.py"
            runs = bench([*args, *extra, "--save", str(save), *(["--activation-checkpointing"] * ckpt)],
                         ntasks=2 if layout == "stage" else 1, script=script)
            assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:]
            losses[layout, ckpt] = [x.split("| loss ")[1].split()[0] for x in runs[0].stdout.splitlines()
                                    if "| loss " in x]
        assert losses[layout, True] == losses[layout, False] and losses[layout, True], losses
    plain = torch.load(tmp_path / "replicaFalse.pt", map_location="cpu", weights_only=False)
    recomputed = torch.load(tmp_path / "replicaTrue.pt", map_location="cpu", weights_only=False)
    assert list(plain) == list(recomputed) and all(plain[k].shape == recomputed[k].shape for k in plain)  # the page's file


def test_the_checker_estimates_the_users_model_and_refuses_what_does_not_fit(tmp_path):
    """On V100 16 GB nodes (-C v100-16g), the checker estimates each GPU of the --model split with kit.memory's terms
    (kit.own_split.own_memory), says it, and refuses a batch whose activations do not fit, with fixes each
    re-estimated; the trainer's record carries the same estimate (its CPU kernels) where it runs."""
    copy_kit(tmp_path, extra=(ZOO,))
    job = JOB.replace("-t 1:00:00", "-t 1:00:00 -C v100-16g")

    def check(batch: int) -> subprocess.CompletedProcess:
        return check_job(tmp_path, [*MODELS["conv"][0], "--batch-size", str(batch), "--chunks", "4", "--precision",
                                    "fp16"], job)

    import kit.own_split
    small = check(64)
    assert small.returncode == 0, small.stdout + small.stderr
    t = kit.arguments.Training(layout="replica", model_spec=f"{ZOO}:conv_stack", sample=f"{ZOO}:conv_sample",
                               batch_size=64, chunks=4, precision="fp16")
    worst = max(kit.own_split.own_memory(t, 2, 1, "sm70"), key=lambda m: m.total)
    assert f"part {worst.part}" in small.stdout and f"{worst.total / 2**30:.2f} GiB" in small.stdout, small.stdout
    big = check(65536)
    assert big.returncode == 1 and "does-not-fit" in big.stdout, big.stdout + big.stderr
    refusal = next(x for x in big.stdout.splitlines() if "does-not-fit" in x)
    assert "GiB per GPU but the GPU has" in refusal and "--batch-size 32768: " in refusal, refusal


def test_a_resume_with_another_model_is_refused(tmp_path):
    save = tmp_path / "ckpt.pt"
    first = bench([*MODELS["conv"][0], *SHORT, "--save", str(save), "--cache-dir", str(tmp_path)])
    assert first[0].returncode == 0, first[0].stderr[-3000:]
    [r] = bench([*MODELS["mlp"][0], *SHORT, "--save", str(save), "--resume", "--epochs", "2",
                 "--cache-dir", str(tmp_path)])
    err = [x for x in r.stderr.splitlines() if not x.startswith("idr_torch:")]  # (no launcher: said once)
    assert r.returncode == 1 and len(err) == 1 and "--model tests/models_zoo.py:conv_stack" in err[0], r.stderr


REFUSED = {  # trainer arguments -> what the one line names
    "no file": (["--model", "no_such_model.py:layers"], "no_such_model.py"),
    "not a sequence": (["--model", f"{ZOO}:not_a_sequence"], "not a sequence"),
    "too few layers": ([*MODELS["conv"][0], "--nb-part", "8"], "6 layer(s), fewer than the 8 parts"),
    "sample": (["--model", f"{ZOO}:conv_stack", "--sample", "8x64"], "--sample 8x64"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_that_cannot_run_is_refused_up_front(tmp_path, case):
    """Every task reaches the verdict before init_process_group (the tasks would otherwise wait for a missing peer);
    rank 0 says it in one line, exit 2; the checker says the same line, exit 2."""
    args, needle = REFUSED[case]
    runs = bench([*args, "--cache-dir", str(tmp_path), "--timeout", "600"], ntasks=2, timeout=90)
    assert [r.returncode for r in runs] == [2, 2], runs[0].stderr
    line = runs[0].stderr.strip().splitlines()
    assert len(line) == 1 and needle in line[0] and not runs[1].stderr.strip(), runs[0].stderr + runs[1].stderr
    check = subprocess.run([sys.executable, str(ROOT / "check_topology.py"), "--nodes", "1", "--gpus-per-node", "8",
                            "--ntasks-per-node", "1", "--nb-part", "8" if case == "too few layers" else "2",
                            "--batch-size", "8", *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                           timeout=120)
    said = [x for x in check.stderr.strip().splitlines() if not x.startswith("measuring your model: importing ")]
    assert check.returncode == 2 and needle in check.stderr and len(said) == 1, check.stdout + check.stderr


def test_a_token_model_whose_embedding_is_smaller_than_the_vocabulary_is_refused_up_front(tmp_path):
    """The kit's data gives ids below --vocab-size: an embedding of 500 rows would fail at the first step (an index
    error here, a device-side assert on a GPU); refused before any process group, the fix named; with it, it runs."""
    args = ["--model", f"{ZOO}:small_vocabulary", "--sample", "8x16", *SHORT, "--nb-part", "2",
            "--cache-dir", str(tmp_path)]
    runs = bench(args, ntasks=2, timeout=90)
    assert [r.returncode for r in runs] == [2, 2], runs[0].stderr
    assert "its first embedding has 500 rows" in runs[0].stderr and "add --vocab-size 500" in runs[0].stderr
    [run] = bench([*args, "--vocab-size", "500"])
    assert run.returncode == 0 and "final test acc" in run.stdout, run.stderr[-2000:]


def test_multi_stage_schedules_get_no_estimate_rather_than_a_wrong_one(tmp_path):
    """interleaved1f1b puts two stages of the split on each task, which the --model estimate does not model: the
    checker says "memory estimate: none" and why, never the one-stage figure."""
    copy_kit(tmp_path, extra=(ZOO,))
    (tmp_path / "job.slurm").write_text(
        "#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=4 --gres=gpu:4 -c 10 --hint=nomultithread -t 1:00:00 -C h100\n"
        f"module load pytorch-gpu/py3/{'.'.join(map(str, TORCH))}.0\nsrun python bench_stage.py "
        f"{' '.join(MODELS['mlp'][0])} --pp 2 --schedule interleaved1f1b --virtual-stages 2 --batch-size 16\n")
    r = subprocess.run([sys.executable, "check_topology.py", "job.slurm"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert "memory estimate: none, --schedule interleaved1f1b puts 2 stages" in r.stdout, r.stdout + r.stderr
    assert "GiB of" not in r.stdout, r.stdout


def test_the_kits_model_options_given_with_model_are_said_to_be_ignored(tmp_path):
    """--nlayers, --d-model ... describe the kit's Transformer: on a line with --model the trainer builds the user's
    layers and ignores them; the checker says so (a warning naming them), and the split is the user's model's."""
    copy_kit(tmp_path, extra=(ZOO,))
    r = check_job(tmp_path, [*MODELS["conv"][0], "--nlayers", "12", "--d-model", "256", "--batch-size", "16"])
    assert r.returncode == 0, r.stdout + r.stderr
    [warning] = [x for x in r.stdout.splitlines() if "ignored-with-model" in x]
    assert "--d-model, --nlayers shape the kit's own Transformer" in warning, warning
    assert "6 layers, --split even, sizes [3, 3]" in r.stdout, r.stdout
    # it speaks only of the options the line sets (issue 40: --nlayers, which the checker fills in with the
    # trainer's default, was named on every --model line)
    r = check_job(tmp_path, [*MODELS["conv"][0], "--d-model", "256", "--batch-size", "16"])
    [warning] = [x for x in r.stdout.splitlines() if "ignored-with-model" in x]
    assert r.returncode == 0 and "--d-model shape" in warning and "--nlayers" not in warning, r.stdout + r.stderr
