"""The speed model (kit/speed.py) and its profile (benchmarks/speed_profile.py).

Pure: the pipeline simulation against the closed forms it must reduce to, the terms adding up, the profile's
refusals, --advise --profile on the command line. Real: a profile of a tiny model taken by two processes (gloo), and
the ranking of three clearly different splits against the trainer's own measured runs. How good the model is on a
grid of 32 splits is benchmarks/speed_grid.py's job (docs/speed.md), not a test's: timings on a shared machine are
noisy.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checker import run_checker
from launch import ROOT, TORCH, bench, clean_env

import kit.advise
import kit.arguments
import kit.releases
import kit.speed

TINY = ["--nlayers", "2", "--d-model", "32", "--n-head", "2", "--d-hid", "64", "--seq-len", "32",
        "--vocab-size", "500", "--dropout", "0"]


def linear_profile(device: str = "cuda", tasks: int = 2, f_ms: float = 1.0, b_ms: float = 2.0) -> dict:
    """A made-up profile whose Layer costs f_ms + b_ms per sample and whose other costs are nil, so that the model
    must give the closed forms."""
    points = lambda f, b: [[m, f * m / 1e3, b * m / 1e3] for m in (1, 2, 4, 8, 16, 32, 64)]  # noqa: E731
    blocks = {f"{k}|{p}|{c}": points(*((f_ms, b_ms) if k == "Layer" else (0.0, 0.0)))
              for k in ("Encoder", "Layer", "Decoder") for p in ("fp32", "bf16") for c in (0, 1)}
    return {"format": kit.speed.PROFILE_FORMAT, "device": device, "key": {"gpu": "test", "torch": "0", "model": {}},
            "compute": [{"tasks": tasks, "threads": None if device == "cuda" else 1, "nlayers": 4, "blocks": blocks}],
            "optimizer": {"Encoder": 0.0, "Layer": 0.0, "Decoder": 0.0},
            "engine": {"per_step_s": 0.0, "per_micro_batch_part_s": 0.0},
            "stage_engine": {"per_step_s": 0.0, "per_micro_batch_stage_s": 0.0},
            "allreduce": {"node": {"tasks": tasks, "points": [[1, 0.0], [2 ** 30, 0.0]]}}, "p2p": None}


MODEL = dict(kit.arguments.CPU_DEFAULTS, nlayers=4)


def step(profile: dict, layout: str, parts: int, chunks: int, batch: int = 64, schedule: str = "1f1b",
         replicas: int = 1, **options) -> dict:
    t = kit.arguments.Training(layout=layout, pp=parts, schedule=schedule, virtual_stages=2, **options)
    return kit.speed.predict_speed(profile, dict(MODEL, batch_size=batch, chunks=chunks), t, parts, replicas,
                            parts * replicas if layout == "stage" else replicas)


@pytest.mark.parametrize("parts,chunks", [(2, 1), (2, 4), (4, 8), (4, 32)])
def test_equal_parts_on_their_own_devices_give_gpipes_closed_form(parts, chunks):
    """(m + p - 1) x (t_f + t_b) of one micro-batch per part (Megatron-LM's step time, no communication), for the
    replica layout's Pipe and the stage layout's 1F1B and GPipe alike."""
    profile = linear_profile()
    micro, layers = 64 / chunks, 4 / parts
    expected = (chunks + parts - 1) * layers * 3.0 * micro / 1e3
    for layout, schedule in (("replica", "gpipe"), ("stage", "1f1b"), ("stage", "gpipe")):
        got = step(profile, layout, parts, chunks, schedule=schedule)
        assert got["step_s"] == pytest.approx(expected), (layout, schedule)
        assert got["terms"]["bubble"] == pytest.approx(expected * (parts - 1) / (chunks + parts - 1))


def test_parts_that_share_a_device_run_in_turn():
    """On the CPU (and --devices 0,0) there is no overlap: the whole model's work, every micro-batch, no bubble."""
    cpu = linear_profile("cpu")
    for parts, chunks in ((2, 1), (2, 8), (4, 16)):
        got = step(cpu, "replica", parts, chunks)
        assert got["step_s"] == pytest.approx(4 * 3.0 * 64 / 1e3)
        assert got["terms"]["bubble"] == pytest.approx(0.0)
    gpu = linear_profile()
    same = step(gpu, "replica", 2, 4, devices=[0, 0])
    assert same["step_s"] == pytest.approx(4 * 3.0 * 64 / 1e3)


def test_interleaving_shrinks_the_bubble():
    profile = linear_profile()
    one = step(profile, "stage", 2, 8, schedule="1f1b")
    inter = step(profile, "stage", 2, 8, schedule="interleaved1f1b")
    assert inter["terms"]["bubble"] < one["terms"]["bubble"]
    assert inter["terms"]["compute"] == pytest.approx(one["terms"]["compute"])


def test_terms_add_up_and_name_what_grows():
    """The terms sum to the step; the per-micro-batch term grows with chunks, the all-reduce with replicas."""
    profile = linear_profile("cpu")
    profile["engine"] = {"per_step_s": 0.001, "per_micro_batch_part_s": 0.0005}
    profile["allreduce"]["node"]["points"] = [[1, 0.001], [2 ** 30, 1.0]]
    profile["optimizer"] = {"Encoder": 0.001, "Layer": 0.002, "Decoder": 0.0005}
    few, many = step(profile, "replica", 2, 2), step(profile, "replica", 2, 16)
    two = step(profile, "replica", 2, 2, replicas=2)
    for got in (few, many, two):
        assert set(got["terms"]) == set(kit.speed.SPEED_TERMS)
        assert sum(got["terms"].values()) == pytest.approx(got["step_s"])
        assert all(v >= 0 for v in got["terms"].values()), got["terms"]
    assert many["terms"]["per_micro_batch"] > few["terms"]["per_micro_batch"]
    assert few["terms"]["communication"] == 0 < two["terms"]["communication"]
    assert few["terms"]["optimizer"] == pytest.approx(0.001 + 4 * 0.002 + 0.0005)
    zero = step(profile, "replica", 2, 2, replicas=2, zero=True)
    assert zero["terms"]["optimizer"] < two["terms"]["optimizer"] + two["terms"]["communication"]


@pytest.mark.parametrize("slow,per_op,per_step", [((0.8, 0.8), 0.0, 0.004), ((1.0, 1.3), 0.002, 0.0),
                                                  ((1.6, 1.2), 0.0005, 0.01)])
def test_the_stage_layouts_real_steps_give_its_costs(slow, per_op, per_step):
    """The profile's real stage steps (pp 2, 2 and 8 micro-batches of 1, 4, 16 samples) made from the model itself
    with known costs: a factor on the blocks at each count of micro-batches, a cost per forward or backward, a cost
    per step. _stage_fit must find all three, the factor must move with the overlap between the counts, a split
    predicted with the fit must take their time; the replica layout is left alone."""
    profile = linear_profile()
    profile["stage_engine"] = {"per_step_s": 0.003, "per_micro_batch_stage_s": 0.001}  # the tiny model's: replaced
    t = kit.arguments.Training(layout="stage", pp=2, schedule="1f1b")
    made = dict(zip((2, 8), slow))
    costs = lambda c: (made[c], per_op, per_step)  # noqa: E731
    points = [[m, c, kit.speed.predict_speed(profile, dict(MODEL, batch_size=m * c, chunks=c), t, 2, 1, 2,
                                      stage_costs=costs(c))["step_s"]] for m in (1, 4, 16) for c in (2, 8)]
    profile["stage_step"] = {"tasks": 2, "threads": None, "pp": 2, "replicas": 1, "schedule": "1f1b", "nlayers": 4,
                             "points": points}
    fit = kit.speed._stage_fit(profile, dict(MODEL, batch_size=8, chunks=1), t)
    assert [k for _, k in fit["scales"]] == pytest.approx(list(slow))
    assert (fit["per_op"], fit["per_step"]) == pytest.approx((per_op, per_step), abs=1e-9)
    for c in (2, 8):
        assert kit.speed._stage_scale(fit, kit.speed._overlap(c, 2)) == pytest.approx(made[c])
    between = kit.speed._stage_scale(fit, kit.speed._overlap(4, 2))
    assert min(slow) < between < max(slow) or slow[0] == slow[1]
    got = step(profile, "stage", 2, 8)  # batch 64, chunks 8: micro-batches of 8 samples, between those measured
    want = kit.speed.predict_speed(profile, dict(MODEL, batch_size=64, chunks=8), t, 2, 1, 2, stage_costs=costs(8))
    assert got["step_s"] == pytest.approx(want["step_s"])
    assert step(profile, "replica", 2, 8)["step_s"] == pytest.approx(step(linear_profile(), "replica", 2, 8)["step_s"])


def test_a_gpu_hides_the_all_reduce_behind_the_backward_a_cpu_does_not():
    profile = linear_profile()
    profile["allreduce"]["node"]["points"] = [[1, 0.0005], [2 ** 30, 1.0]]
    gpu = step(profile, "replica", 4, 8, replicas=2)
    cpu = step(dict(copy.deepcopy(profile), device="cpu"), "replica", 4, 8, replicas=2)
    assert 0 <= gpu["terms"]["communication"] < cpu["terms"]["communication"]


@pytest.mark.parametrize("damage,says", [
    ("not json", "is not JSON"), ('{"format": "other/1"}', "format 'other/1'"),
    (json.dumps({"format": kit.speed.PROFILE_FORMAT}), "cut short")])
def test_a_bad_profile_is_one_line_with_the_fix(tmp_path, damage, says):
    path = tmp_path / "p.json"
    path.write_text(damage)
    with pytest.raises(kit.speed.ProfileError, match=says):
        kit.speed.read_profile(path)
    with pytest.raises(kit.speed.ProfileError, match="cannot read"):
        kit.speed.read_profile(tmp_path / "missing.json")


def test_a_precision_the_profile_lacks_is_named():
    profile = linear_profile()
    for ctx in profile["compute"]:
        ctx["blocks"] = {k: v for k, v in ctx["blocks"].items() if "|fp32|" in k}
    with pytest.raises(kit.speed.ProfileError, match="no bf16 timings .* --precisions bf16"):
        step(profile, "replica", 2, 4, precision="bf16")


def checker(*args: str) -> subprocess.CompletedProcess:
    return run_checker(*args, env=clean_env())  # in this process: tests/checker.py


def test_advise_ranks_by_the_profile_and_its_commands_are_what_the_trainers_read(tmp_path):
    profile = linear_profile("cpu")
    profile["key"].update(torch="2.13.0", model={k: MODEL[k] for k in kit.speed.PROFILE_MODEL}, nlayers=4)
    profile["engine"]["per_micro_batch_part_s"] = 0.002  # chunks cost: the fewest win on a shared device
    profile["stage_engine"]["per_micro_batch_stage_s"] = 0.002  # in both layouts (else a zero-bubble row wins)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    plan = ["--advise", "--nodes", "1", "--gpus-per-node", "2", "--gpu-mem", "16", "--global-batch", "32"]
    plain = checker(*plan)
    assert plain.returncode == 0 and "no speed is predicted without --profile" in plain.stdout
    ranked = checker(*plan, "--profile", str(path), "--json")
    assert ranked.returncode == 0, ranked.stderr
    rows = json.loads(ranked.stdout)
    speeds = [r["samples_per_s"] for r in rows if r["samples_per_s"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) >= 3
    assert rows[0]["chunks"] == 1 and set(rows[0]["terms_ms"]) == set(kit.speed.SPEED_TERMS)
    lines = checker(*plan, "--profile", str(path), "--top", "3", "--commands").stdout.splitlines()
    assert len(lines) == 3
    for line in lines:
        tasks, script, *argv = line.split()
        layout = kit.arguments.TRAINERS[script]
        read = kit.arguments.read_trainer_argv(layout, argv)
        assert not read.findings.errors, (line, read.findings)
        assert read.values.d_model == MODEL["d_model"] and read.values.nlayers == 4  # the profile's model
    wrong = checker(*plan, "--profile", str(path), "--d-model", "128")
    assert wrong.returncode == 2 and "taken with --d-model 64, the plan has 128" in wrong.stderr
    alone = checker("--profile", str(path), "--nodes", "1", "--gpus-per-node", "2")
    assert alone.returncode == 2 and "go with --advise" in alone.stderr


@pytest.mark.parametrize("torch_version,device,schedule", [("2.13.0", "cpu", "1f1b"), ("2.6.0", "cpu", "gpipe"),
                                                          ("2.6.0", "cuda", "1f1b"), ("2.3.1", "cuda", None)])
def test_advise_gives_the_stage_layout_the_schedule_the_profiles_torch_runs(tmp_path, torch_version, device,
                                                                             schedule):
    """The profile names the release and the device: on gloo before torch 2.8 the stage trainer refuses 1f1b
    (TORCH_FEATURES), before 2.4 it has no stage layout; every command --advise prints must be one that release
    runs, and the header says why where the schedule is not 1f1b."""
    profile = linear_profile(device)
    profile["key"].update(torch=torch_version, model={k: MODEL[k] for k in kit.speed.PROFILE_MODEL}, nlayers=4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    plan = ["--advise", "--nodes", "1", "--gpus-per-node", "2", "--gpu-mem", "16", "--global-batch", "32",
            "--profile", str(path)]
    lines = checker(*plan, "--commands").stdout.splitlines()
    stage = [line for line in lines if " bench_stage.py " in line]
    assert len(lines) > len(stage) > 0 if schedule else not stage and lines
    for line in lines:
        tasks, script, *argv = line.split()
        layout = kit.arguments.TRAINERS[script]
        t = kit.arguments.training_from_args(kit.arguments.read_trainer_argv(layout, argv).values, layout)
        assert not kit.releases.torch_refusals(torch_version, t, cpu=device == "cpu"), line
        assert layout == "replica" or t.schedule in kit.advise.stage_schedules(torch_version, device == "cpu")
    # with a profile every schedule that release runs is ranked beside the splits (issue 44): the zero-bubble ones
    # from 2.8 on gloo, from their first releases on GPUs (DualPipeV: 2.9)
    ranked = {line.split("--schedule ")[1].split()[0] for line in stage}
    assert ranked == ({schedule} if schedule == "gpipe" else set(kit.advise.stage_schedules(torch_version,
                                                                                          device == "cpu")))
    assert ("zbvzerobubble" in ranked) == (schedule == "1f1b")
    text = checker(*plan).stdout
    assert ("note: stage layout rows run --schedule gpipe" in text) == (schedule == "gpipe")
    assert ("note: no stage layout rows: the stage layout (bench_stage.py) needs torch >= 2.4" in text) == (schedule is None)


# ---- a real profile, and the ranking it predicts against the trainer's own runs -----------------------------------
@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> dict:
    """benchmarks/speed_profile.py on the tiny model, two tasks as srun starts them (gloo)."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    procs = bench(["--out", str(out), "--max-micro", "16", "--repeats", "3", *TINY], ntasks=2,
                  script="benchmarks/speed_profile.py", timeout=300)
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    return kit.speed.read_profile(out)


@pytest.mark.core
@pytest.mark.multiproc
def test_the_profile_holds_what_the_model_reads(tiny_profile):
    p = tiny_profile
    assert p["key"]["model"]["d_model"] == 32 and p["key"]["nlayers"] == 2 and p["device"] == "cpu"
    # every task at once (1 thread each on 2 cores), then task 0 alone with 1 thread and with all its cores
    contexts = {(c["tasks"], c["threads"]) for c in p["compute"]}
    assert (2, 1) in contexts and (1, 1) in contexts and {t for t, _ in contexts} == {1, 2}, contexts
    for ctx in p["compute"]:
        assert {"Layer|fp32|0", "Layer|fp32|1", "Encoder|bf16|0", "Decoder|fp32|0"} <= set(ctx["blocks"])
        assert [m for m, *_ in ctx["blocks"]["Layer|fp32|0"]] == [1, 2, 4, 8, 16]
        assert all(f > 0 and b > 0 for _, f, b in ctx["blocks"]["Layer|fp32|0"])
        assert set(ctx["whole"]) == {"fp32|0", "fp32|1", "bf16|0", "bf16|1"}
    assert [b for b, _ in p["allreduce"]["node"]["points"]] == sorted(b for b, _ in p["allreduce"]["node"]["points"])
    assert p["allreduce"]["node"]["tasks"] == 2 and p["p2p"] and p["engine"]["per_micro_batch_part_s"] >= 0
    assert {r["tasks"] for r in p["replica_step"]} == {1, 2}
    assert (p["stage_engine"] is not None) == (TORCH >= (2, 4))  # pipelining exists from torch 2.4
    if TORCH >= (2, 4):  # the real stage layout's steps: the model, pp 2, 2 micro-batches of 1, 4, 16 (--max-micro)
        real = p["stage_step"]
        assert (real["pp"], real["replicas"], real["nlayers"]) == (2, 1, 2)
        assert [(m, c) for m, c, _ in real["points"]] == [(m, c) for m in (1, 4, 16) for c in (2, 8)]
        assert all(s > 0 for *_, s in real["points"])
    else:
        assert p["stage_step"] is None
    model = dict(kit.arguments.model_args(kit.arguments.Training(), cpu=True),
                 **{k: p["key"]["model"][k] for k in kit.speed.PROFILE_MODEL},
                 nlayers=2, batch_size=16, chunks=4)
    for layout, replicas in (("replica", 1), ("replica", 2), ("stage", 1)):
        if layout == "stage" and TORCH < (2, 4):
            continue
        got = kit.speed.predict_speed(p, model, kit.arguments.Training(layout=layout, pp=2), 2, replicas, 2 * replicas
                               if layout == "stage" else replicas)
        assert sum(got["terms"].values()) == pytest.approx(got["step_s"]) and got["samples_per_s"] > 0


@pytest.mark.multiproc
def test_three_clearly_different_splits_rank_as_predicted(tiny_profile, tmp_path):
    """Three splits the model puts far apart (micro-batches of 1 through two parts in turn; one task; two
    replicas), measured by the trainer itself: the measured order is the predicted one. A busy machine can slow one
    run five-fold (measured: 93 samples/s against 600 alone, while another suite ran), so a wrong order is measured
    again, round after round (at most 3), each split keeping its best run: the least disturbed one."""
    splits = [(1, ["--nb-part", "2", "--chunks", "16", "--batch-size", "16"]),
              (1, ["--nb-part", "1", "--chunks", "1", "--batch-size", "16"]),
              (2, ["--nb-part", "1", "--chunks", "1", "--batch-size", "32"])]
    model = dict(kit.arguments.model_args(kit.arguments.Training(), cpu=True), **tiny_profile["key"]["model"],
                 nlayers=2)
    predicted, best, rounds = [], [0.0] * len(splits), []
    for n, argv in splits:
        values = kit.arguments.read_trainer_argv("replica", argv).values
        m = dict(model, batch_size=values.batch_size, chunks=values.chunks)
        predicted.append(kit.speed.predict_speed(tiny_profile, m, kit.arguments.Training(), values.nb_part, n,
                                                 n)["samples_per_s"])
    assert predicted[1] > 1.5 * predicted[0] and predicted[2] > 1.3 * predicted[1], predicted  # clearly apart
    while len(rounds) < 3 and (not rounds or sorted(range(3), key=lambda i: best[i]) != [0, 1, 2]):
        rounds.append([measure_split(tmp_path / f"r{len(rounds)}s{i}.jsonl", n, argv)
                       for i, (n, argv) in enumerate(splits)])
        best = [max(r[i] for r in rounds) for i in range(len(splits))]
    assert sorted(range(3), key=lambda i: best[i]) == [0, 1, 2], (predicted, rounds)


def measure_split(out: Path, n: int, argv: list[str]) -> float:
    """The trainer's own samples/s for one split: 40 timed steps after 3 untimed ones."""
    values = kit.arguments.read_trainer_argv("replica", argv).values
    procs = bench([*argv, *TINY, "--epochs", "1", "--max-steps", "43", "--untimed-steps", "3",
                   "--synthetic", str(values.batch_size * n * 44), "--json-out", str(out)], ntasks=n)
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    return json.loads(out.read_text())["samples_per_s"]


# ---- --out: checked before any timing, written whole or not at all (issue 35) --------------------------------------
def profile_run(out: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """benchmarks/speed_profile.py, one task, with --repeats so large that any timing would outlast the test: a run
    that ends within `timeout` checked --out before it timed anything."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speed_profile.py"), "--out", out,
                           "--repeats", "1000000", *TINY, *extra], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(), cwd=ROOT)


@pytest.mark.parametrize("case", ["a folder", "a missing folder", "a read-only folder", "a device", "empty"])
def test_profile_out_is_checked_before_any_timing(tmp_path, case):
    """It was checked only for a missing folder and a folder: a read-only folder failed after the minute of timing,
    and --out /dev/null would have been replaced by a regular file (the rename), as root."""
    from test_faults_reports import read_only_folder
    says = {"a folder": f"--out {tmp_path} is a folder; give a file name, e.g. --out {tmp_path / 'profile.json'}",
            "a missing folder": f"--out {tmp_path}/no/p.json: folder {tmp_path}/no does not exist; create it "
                                f"(mkdir -p {tmp_path}/no)",
            "a device": "--out /dev/null is not a regular file (a device, pipe or socket): the profile is renamed "
                        "over it, which would replace it; give a file, e.g. --out profile.json",
            "empty": "--out '' names no file; give one, e.g. --out profile.json"}
    if case == "a read-only folder":
        with read_only_folder(tmp_path / "ro") as ro:
            r = profile_run(str(ro / "p.json"))
            assert list(ro.iterdir()) == []
        says[case] = f"--out {ro}/p.json: cannot write in {ro} ("
    else:
        out = {"a folder": str(tmp_path), "a missing folder": f"{tmp_path}/no/p.json", "a device": "/dev/null",
               "empty": ""}[case]
        r = profile_run(out)
    errors = [x for x in r.stderr.splitlines() if not x.startswith("idr_torch: no srun")]  # the launcher's notice
    assert r.returncode == 1 and len(errors) == 1 and errors[0].startswith(f"speed_profile: error: {says[case]}"), \
        r.stderr
    assert Path("/dev/null").is_char_device() and not (tmp_path / "no").exists()


def test_profile_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """write_json: a temporary file beside the target, fsync'ed, renamed; Ctrl-C mid-write leaves the old file and
    no temporary file (a half-written .tmp was left); through a link, the file it points to is replaced."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import speed_profile
    out = tmp_path / "profile.json"
    out.write_text("old\n")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(speed_profile.os, "fsync", interrupted)
        with pytest.raises(KeyboardInterrupt):
            speed_profile.write_json({"new": 1}, out)
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    speed_profile.write_json({"new": 1}, out)
    assert json.loads(out.read_text()) == {"new": 1} and [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def stubbed_profile(out: Path, pad: int) -> subprocess.CompletedProcess:
    """speed_profile.py's main() with measure() stubbed (the real one takes a minute): a profile of `pad` bytes."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import speed_profile as sp, kit.train.errors as e; "
            f"sp.measure = lambda *a: {{'seconds': 1.0, 'key': {{'gpu': 'cpu', 'torch': '0'}}, 'pad': 'x' * {pad}}}; "
            f"e.cli(lambda: sp.main(['--out', {str(out)!r}, *{TINY!r}]), 'speed_profile')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env(), cwd=ROOT)


def test_profile_through_a_link_replaces_the_file_it_points_to(tmp_path):
    (tmp_path / "data").mkdir()
    target, link = tmp_path / "data" / "profile.json", tmp_path / "profile.json"
    target.write_text("old\n")
    link.symlink_to(target)
    r = stubbed_profile(link, 10)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and json.loads(target.read_text())["pad"] == "x" * 10


def test_a_disk_full_after_the_timing_is_one_line_and_leaves_the_old_profile(tmp_path):
    """The disk fills during the timing: one line, exit 1, the previous profile whole, no temporary file (it was a
    traceback and a half-written .tmp)."""
    from launch import mounted_tmpfs
    with mounted_tmpfs(tmp_path / "disk", "size=256k") as disk:
        out = disk / "profile.json"
        out.write_text("old\n")
        r = stubbed_profile(out, 400_000)
        assert r.returncode == 1 and r.stderr.endswith(
            f"\nspeed_profile: error: --out {out}: the profile could not be written (No space left on device); "
            "nothing half-written is left: free some space (or give another --out) and run it again\n"), r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 2  # the launcher's notice, the error
        assert out.read_text() == "old\n" and [p.name for p in disk.iterdir()] == ["profile.json"]
