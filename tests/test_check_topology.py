"""check_topology: the topology model, the split, and the pre-flight checker (no torch, no cluster)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import check_topology as ct
import kit.allocation
import kit.arguments
import kit.checks
import kit.findings
import kit.jobscript
import kit.placement
import kit.plan
import kit.report
import kit.slurm
from checker import run_checker
from launch import checker_source

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "sbatch"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The checker as a real process: for the tests of its command line (exit codes, the environment it starts in);
    the tests of a verdict call it in this process (tests/checker.py's run_checker, the same result)."""
    return subprocess.run([sys.executable, str(ROOT / "check_topology.py"), *args], capture_output=True, text=True,
                          timeout=60, env=env)


# ---- the page's two configurations ----------------------------------------------------------------------------
def pairs(report: kit.report.Report) -> list[tuple[int, int, tuple[str, ...]]]:
    return [(p.node, p.local_rank, tuple(p.node_gpus)) for p in report.tasks]


def test_page_three_nodes_four_gpus_two_tasks():
    report = kit.checks.check_job(kit.slurm.Job(nodes=3, gpus_per_node=4, ntasks_per_node=2, cpus_per_task=20,
                                 hint="nomultithread", constraint="v100-32g", time="1:00:00"), kit.arguments.Training(nlayers=8, chunks=8))
    assert report.ok and not report.findings, [str(f) for f in report.findings]
    assert len(report.tasks) == 6
    assert pairs(report) == [(n, l, g) for n in range(3) for l, g in ((0, ("0", "1")), (1, ("2", "3")))]
    assert [(p.first_part, p.last_part) for p in report.tasks] == [(0, 1), (2, 3)] * 3
    assert {p.nb_part for p in report.tasks} == {2}


def test_page_two_nodes_eight_gpus_four_tasks():
    report = kit.checks.check_job(kit.slurm.Job(nodes=2, gpus_per_node=8, ntasks_per_node=4, cpus_per_task=6,
                                                hint="nomultithread",
                                 partition="gpu_p2", time="20:00:00"), kit.arguments.Training(nlayers=8, chunks=8))
    assert report.ok and not report.findings, [str(f) for f in report.findings]
    assert len(report.tasks) == 8
    expect = [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert [p.node_gpus for p in report.tasks] == [list(e) for e in expect] * 2
    assert [p.devices for p in report.tasks] == [[0, 1], [2, 3], [4, 5], [6, 7]] * 2


def test_cli_prints_the_pairs():
    out = run_checker("--nodes", "3", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--nlayers", "8", "--chunks",
                      "8")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s", line)]
    assert [(r[0], r[3]) for r in rows] == [("0", "0,1"), ("1", "2,3"), ("2", "0,1"), ("3", "2,3"), ("4", "0,1"),
                                            ("5", "2,3")]
    assert "cuda:0: Encoder + Layer 0-3 | cuda:1: Layer 4-7 + Decoder" in out.stdout
    assert "=> OK: 0 error(s), 0 warning(s)" in out.stdout


def test_cli_json():
    out = run_checker("--nodes", "2", "--gpus-per-node", "8", "--ntasks-per-node", "4", "--nlayers", "8", "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 0 and data["ok"] is True
    assert [t["first_part"] for t in data["tasks"]] == [0, 2, 4, 6] * 2
    assert [t["last_part"] for t in data["tasks"]] == [1, 3, 5, 7] * 2
    assert data["tasks"][0]["contents"] == ["Encoder + Layer 0-3", "Layer 4-7 + Decoder"]


# ---- the layer split ---------------------------------------------------------------------------------------------
def page_loop(nlayers: int, nb_part: int) -> list[int]:
    """The page's own loop (float partition_len), returning the part of each layer."""
    partition_len = max(nlayers / nb_part, 1)
    return [int(i // partition_len) for i in range(nlayers)]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(1, 12))
def test_split_equals_page_when_divisible(nb_part, per_part):
    nlayers = nb_part * per_part
    assert kit.plan.split_layers(nlayers, nb_part) == page_loop(nlayers, nb_part)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16))
def test_split_properties(nlayers, nb_part):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = kit.plan.split_layers(nlayers, nb_part)
    assert len(parts) == nlayers  # every layer exactly once
    assert parts == sorted(parts)  # contiguous, in order
    assert all(0 <= p < nb_part for p in parts)
    sizes = [parts.count(p) for p in range(nb_part)]
    assert max(sizes) - min(sizes) <= 1  # balanced
    assert sizes == kit.plan.part_sizes(nlayers, nb_part)
    if nlayers >= nb_part:
        assert set(parts) == set(range(nb_part))  # no idle part


def page_grouping(nlayers: int, nb_part: int) -> list[list[int]]:
    """The page's module_list loop, verbatim but for the modules: each partition (an nn.Sequential, one Pipe
    stage) as the list of GPU offsets (first_part + device) its modules were sent to, Encoder and Decoder included."""
    module_list = []
    partition_len = max((nlayers / nb_part), 1)
    tmp_list = [0]  # Encoder(...).to(first_part)
    for i in range(nlayers):
        if i != 0 and i % (partition_len) == 0:
            module_list.append(tmp_list)
            tmp_list = []
        device = int(i // (partition_len))
        tmp_list.append(device)  # transformer_block.to(first_part + device)
    tmp_list.append(nb_part - 1)  # Decoder(...).to(last_part)
    module_list.append(tmp_list)
    return module_list


def ours_grouping(nlayers: int, nb_part: int, build=None) -> list[list[int]]:
    """The same, for the kit: its module_list (kit.train.transformer's; `build`: another builder of it, the page's
    loop in tests/test_page.py) on nb_part GPUs, each .to(cuda:i) recorded instead of done (no GPU here): a module's
    own, or its part's where the part was moved whole."""
    torch = pytest.importorskip("torch")
    import kit.arguments
    import kit.train.setup
    import kit.train.transformer
    cfg = kit.arguments.parse_trainer_args("replica", ["--nlayers", str(nlayers), "--d-model", "2", "--n-head", "1",
                                                       "--d-hid", "2", "--vocab-size", "8", "--seq-len", "2"])
    kit.train.setup.resolve(cfg, cuda=False)
    plan = kit.plan.plan_task(0, 0, 0, 1, [str(i) for i in range(nb_part)], nb_part, nlayers, nb_part)
    placed: dict[int, int] = {}

    def to(module, device, *args, **kwargs):
        placed[id(module)] = int(str(device).split(":")[1])
        return module

    with mock.patch.object(torch.nn.Module, "to", to):
        parts = (build or kit.train.transformer.module_list)(cfg, plan)
    return [[placed.get(id(m), placed.get(id(part))) for m in part] for part in parts]


def test_page_loop_mixes_two_gpus_in_one_partition_where_ours_does_not():
    # 16 layers on 2 GPUs, the page's example: both loops give the same two one-GPU partitions
    assert page_grouping(16, 2) == ours_grouping(16, 2) == [[0] * 9, [1] * 9]
    # 7 layers on 2 GPUs: partition_len 3.5, `i % 3.5 == 0` only at i = 0, so the page makes ONE partition whose
    # modules sit on both GPUs: a Pipe stage spanning two devices (Pipe expects each stage on one device)
    assert page_grouping(7, 2) == [[0, 0, 0, 0, 0, 1, 1, 1, 1]]
    # 10 layers on 4 GPUs: partition_len 2.5 cuts at i = 5 only: 2 partitions for 4 GPUs, each mixing two GPUs
    assert page_grouping(10, 4) == [[0, 0, 0, 0, 1, 1], [2, 2, 2, 3, 3, 3]]
    # ours: one partition per GPU, every module of a partition on that partition's GPU
    assert ours_grouping(7, 2) == [[0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ours_grouping(10, 4) == [[0, 0, 0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
    mixed = [(n, k) for n in range(1, 33) for k in range(1, 9) if n >= k
             and any(len(set(g)) > 1 for g in page_grouping(n, k))]
    assert mixed and all(n % k for n, k in mixed)  # the page mixes GPUs only when nlayers % nb_part != 0 ...
    for n, k in [(n, k) for n, k in mixed if n <= 16]:  # ... and ours never does (the real build: 0.1 s each)
        groups = ours_grouping(n, k)
        assert len(groups) == k and all(len(set(g)) == 1 for g in groups) and [g[0] for g in groups] == list(range(k))
    assert kit.plan.part_sizes(7, 2) == [3, 4]  # the extra layer goes to the last part, not the Encoder's


def test_split_below_nb_part_is_defined_with_a_warning():
    with pytest.warns(UserWarning, match=r"nlayers \(1\) < nb_part \(4\): 3 part\(s\) get no Layer"):
        assert kit.plan.split_layers(1, 4) == [3]
    assert kit.plan.part_contents(1, 4) == ["Encoder", "(nothing)", "(nothing)", "Layer 0 + Decoder"]


def test_part_contents():
    assert kit.plan.part_contents(8, 2) == ["Encoder + Layer 0-3", "Layer 4-7 + Decoder"]
    assert kit.plan.part_contents(3, 3) == ["Encoder + Layer 0", "Layer 1", "Layer 2 + Decoder"]
    assert kit.plan.part_contents(4, 1) == ["Encoder + Layer 0-3 + Decoder"]


# ---- one task's plan --------------------------------------------------------------------------------------------
def test_plan_page_indexing_when_all_gpus_visible():
    plan = kit.plan.plan_task(3, 1, 1, 2, ["0", "1", "2", "3"], 4, nlayers=8)
    assert (plan.nb_part, plan.first_part, plan.last_part, plan.devices, plan.bound) == (2, 2, 3, [2, 3], False)
    assert plan.device(0) == "cuda:2" and plan.device(1) == "cuda:3"


def test_plan_starts_at_zero_when_bound_per_task():
    # --gpus-per-task=2: task 1 sees CUDA_VISIBLE_DEVICES=2,3, i.e. cuda:0 and cuda:1 (seen on the test cluster)
    plan = kit.plan.plan_task(1, 0, 1, 2, ["2", "3"], 4, nlayers=8)
    assert (plan.nb_part, plan.devices, plan.node_gpus, plan.bound) == (2, [0, 1], ["2", "3"], True)
    assert kit.plan.page_indexing(1, 2, 2) == (1, 1, 1)  # the page would use 1 GPU of 2


def test_plan_index_past_visible_is_an_error():
    findings = kit.findings.Findings()
    plan = kit.plan.plan_task(1, 0, 1, 2, ["0", "1", "2", "3"], 4, nlayers=8, nb_part=4, findings=findings)
    assert [f.code for f in findings] == ["gpu-index-past-visible"]
    assert "GPU index 4 (and 3 more) but sees only 4 GPU(s)" in findings[0].message
    assert plan.devices == []


def test_plan_cpu():
    plan = kit.plan.plan_task(0, 0, 0, 1, [], None, nlayers=4)
    assert plan.cpu and plan.nb_part == kit.arguments.CPU_NB_PART and plan.device(1) == "cpu"


def test_plan_torchrun_without_slurm_counts():
    # torchrun on a 4-GPU workstation, 2 processes: every process sees all 4 GPUs
    plan = kit.plan.plan_task(1, 0, 1, 2, ["0", "1", "2", "3"], None, nlayers=8)
    assert plan.devices == [2, 3]


# ---- the sbatch corpus: every good file checks clean, every bad file gives its finding ---------------------------
TEMPLATES = sorted((ROOT / "slurm").glob("*.slurm"))  # the shipped templates themselves, not copies
GOOD = sorted((CORPUS / "good").glob("*.slurm")) + TEMPLATES
BAD = sorted((CORPUS / "bad").glob("*.slurm"))
SCRIPTS = sorted((CORPUS / "scripts").glob("*.slurm"))  # tests/test_jobscript.py: exact findings


def expectations(path: Path) -> tuple[set[str], int]:
    text = path.read_text()
    codes = set(re.search(r"^# expect: (.*)$", text, re.M).group(1).split())
    code = int(re.search(r"^# exit: (\d)$", text, re.M).group(1))
    return codes, code


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.parent.name + "/" + p.stem)
def test_good_sbatch_files_check_clean(path):
    """No finding, or (the templates) only warnings the file explains in a '# check_topology: <code> ...' comment."""
    job, training, findings = kit.jobscript.read_sbatch(path)
    report = kit.checks.check_job(job, training)
    report.findings[:0] = findings
    explained = set(re.findall(r"^#+ check_topology: ([a-z0-9-]+)", path.read_text(), re.M))
    unexplained = [str(f) for f in report.findings if f.level == "error" or f.code not in explained]
    assert report.ok and not unexplained, unexplained
    assert explained <= {f.code for f in report.findings}, "a template explains a warning it no longer gets"


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_sbatch_files_are_caught(path):
    codes, exit_code = expectations(path)
    out = run_checker(str(path), "--json")
    data = json.loads(out.stdout)
    found = {f["code"] for f in data["findings"]}
    assert codes <= found, f"{path.name}: expected {codes}, got {found}"
    assert out.returncode == exit_code
    for f in data["findings"]:
        if f["code"] in codes and f["code"] != "hint-missing":
            assert re.search(r"\d", f["message"]), f"{f['code']} names no number: {f['message']}"
    if exit_code:
        assert any(f["level"] == "error" and f["code"] in codes for f in data["findings"])


# codes the corpus can't show: they need a running step, or are covered by the unit tests named here
NOT_IN_CORPUS = {
    "task-missing": "srun python check_topology.py only", "affinity-small": "srun python check_topology.py only",
    "no-gpu-visible": "srun python check_topology.py only",
    "bad-engine": "test_parse_errors", "bad-layout": "test_parse_errors", "bad-schedule": "test_parse_errors",
    "bad-command": "test_parse_errors", "bad-directive": "test_parse_errors",
    "internal-error": "tests/test_jobs.py test_a_check_that_raises_is_one_finding_and_the_others_run",
    "array-partly-checked": "tests/test_jobs.py test_an_array_too_long_to_read_says_which_elements_it_checked",
    "node-range": "test_parse_errors", "nodes-missing": "test_placement_measured",
    "srun-gpu-option": "test_parse_errors",
    "count-too-large": "tests/test_jobscript.py test_huge_counts_in_a_script",
    "script-too-large": "tests/test_jobscript.py test_odd_files", "not-a-script": "tests/test_jobscript.py test_odd_files",
    "shell-unread": "a script nested past Python's recursion limit (not written by hand)",
    "too-complex": "tests/test_faults_checker.py", "cr-line-breaks": "tests/test_faults_checker.py",
    "gpu-bind-mask": "test_parse_errors", "gpu-bind-closest": "test_parse_errors",
    "ntasks-below-nodes": "test_placement_measured", "step-nodes": "test_placement_measured",
    "srun-ntasks-per-node-conflict": "test_placement_measured",
    "does-not-fit": "tests/test_memory.py", "memory-tight": "tests/test_memory.py",
    "ignored-with-model": "tests/test_own_model_train.py",
    "bf16-on-v100": "tests/test_memory.py", "tf32-on-v100": "tests/test_gpu_truth.py",
    "fp16-stage": "tests/test_options.py",
    "partition-unknown": "tests/test_site_live.py (--site live on the local cluster: the table knows no other site)",
    "accounting-unread": "tests/test_faults_round3.py (a fake Slurm whose sacctmgr is slower than the deadline)",
    "torch-release": "the trainers and their --check-args (tests/test_arguments.py); a job script's module line gives "
                     "engine-unavailable / torch-too-old",
    **{c: "test_stage_layout_findings" for c in ("pp-too-small", "pp-not-dividing-world", "pipeline-spans-nodes",
                                                 "chunks-below-stages", "chunks-not-rounds")},
    "v-two-stages": "tests/test_zero_bubble.py test_check_args_refuses_what_the_schedule_refuses",
}


def emitted_codes() -> dict[str, set[str]]:
    """Every (code, level) check_topology.py can emit, read off its source."""
    src = checker_source()
    found: dict[str, set[str]] = {}
    for method, code in re.findall(r'\.(error|warn)\(\s*"([a-z0-9-]+)"', src):
        found.setdefault(code, set()).add("error" if method == "error" else "warning")
    return found


def test_catches_table_is_what_the_code_emits():
    table = {code: set(level.split("/")) for code, (level, _) in kit.findings.CATCHES.items()}
    assert table == emitted_codes()


def test_docs_list_exactly_the_catches():
    """docs/checker.md's catalogue (section 9) is CATCHES, code by code and level by level."""
    text = (ROOT / "docs" / "checker.md").read_text()
    listed = dict(re.findall(r"^- `([a-z0-9-]+)` \(([a-z/]+)\):", text, re.M))
    assert listed == {code: level for code, (level, _) in kit.findings.CATCHES.items()}


def script_expectations(path: Path) -> set[str]:
    return set(re.search(r"^# expect: (.*)$", path.read_text(), re.M).group(1).split()) - {"none"}


def test_corpus_covers_every_catch():
    covered = set().union(*(expectations(p)[0] for p in BAD), *(script_expectations(p) for p in SCRIPTS))
    assert covered <= set(kit.findings.CATCHES), covered - set(kit.findings.CATCHES)
    missing = set(kit.findings.CATCHES) - covered - set(NOT_IN_CORPUS)
    assert not missing, f"no corpus file for {sorted(missing)}"


def test_messages_give_numbers_and_fix():
    job, training, findings = kit.jobscript.read_sbatch(CORPUS / "bad" / "chunks_not_dividing.slurm")
    report = kit.checks.check_job(job, training)
    [f] = [f for f in report.findings if f.code == "chunks-not-dividing-batch"]
    assert f.message == ("--chunks=6 must divide the batch size per replica (64): the micro-batches would differ "
                         "in size; try --chunks 4 or 8")
    job, training, findings = kit.jobscript.read_sbatch(CORPUS / "bad" / "ntasks_mismatch.slurm")
    report = kit.checks.check_job(job, training)
    [f] = [f for f in report.findings if f.code == "ntasks-mismatch"]
    assert "--ntasks=5" in f.message and "2,2,1" in f.message and "set --ntasks=6" in f.message


def test_directive_parsing_forms():
    f = kit.findings.Findings()
    opts, rest = kit.slurm.parse_options(["-N", "3", "-N3", "--nodes=3", "--nodes", "3", "--exclusive", "-c20",
                                   "--gres=gpu:4", "-vv", "--tasks-per-node", "2"], "x", f)
    assert opts == [("nodes", "3")] * 4 + [("exclusive", None), ("cpus-per-task", "20"), ("gres", "gpu:4"),
                                           ("verbose", None), ("verbose", None), ("ntasks-per-node", "2")]
    assert not f and rest == []
    opts, rest = kit.slurm.parse_options(["-N", "2", "--exact", "python", "-u", "x.py"], "x", f, prog="srun")
    assert opts == [("nodes", "2"), ("exact", None)] and rest == ["python", "-u", "x.py"] and not f
    for gres, n in (("gpu:4", 4), ("gpu:v100:4", 4), ("gpu:4(S:0-1)", 4), ("gpu", 1), ("nvme:1,gpu:2", 2),
                    ("gpu:a100", 1)):
        assert kit.slurm.gres_gpus(gres, "x", f) == n, gres


def test_sbatch_reads_last_value_and_srun_overrides(tmp_path):
    script = tmp_path / "job.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -N 2\n#SBATCH --nodes=3 --ntasks-per-node=4 --gres=gpu:4\n"
                      "srun --ntasks-per-node=2 python ./bench_ddp_transformer.py --chunks=8 --batch-size 64\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    assert (job.nodes, job.ntasks_per_node, job.gres_gpus, job.step_ntasks_per_node) == (3, 4, 4, 2)
    assert (training.chunks, training.batch_size) == (8, 64)
    # srun inherits SLURM_NTASKS=12 from the job, so it ignores --ntasks-per-node=2 (measured: 4(x3))
    report = kit.checks.check_job(job, training)
    assert [p.tasks_on_node for p in report.tasks] == [4] * 12
    assert "srun-ntasks-per-node-ignored" in {f.code for f in report.findings}


# ---- exit codes and usage -----------------------------------------------------------------------------------------
def test_exit_codes(tmp_path):
    assert run_cli(str(ROOT / "slurm" / "page_3nodes_4gpus.slurm")).returncode == 0
    assert run_cli(str(CORPUS / "bad" / "gpus_not_divisible.slurm")).returncode == 1
    missing = run_cli(str(tmp_path / "nope.slurm"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "nope.slurm" in missing.stderr
    assert run_cli("--bogus").returncode == 2
    both = run_cli(str(ROOT / "slurm" / "page_3nodes_4gpus.slurm"), "--nodes", "2")
    assert both.returncode == 2 and "not both" in both.stderr
    half = run_cli("--ntasks-per-node", "2")
    assert half.returncode == 2 and "--nodes" in half.stderr


@pytest.mark.parametrize("args", [
    ["slurm/page_3nodes_4gpus.slurm"], ["tests/sbatch/bad/gpus_not_divisible.slurm", "--json"], ["--bogus"],
    ["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "1", "--nlayers", "2"], ["--help"],
    ["--nodes", "2", "--gpus-per-node", "99999999999999999999999"], ["nope.slurm"]], ids=lambda a: " ".join(a)[:40])
def test_the_checker_in_this_process_is_the_command_line(args):
    """tests/checker.py's run_checker (the verdict tests' checker) gives what the real process gives: exit status,
    stdout, stderr (argparse's usage and --help included)."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    real = subprocess.run([sys.executable, "check_topology.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)
    here = run_checker(*args, env=env, cwd=ROOT)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)
    assert here.stdout or here.stderr


def test_nothing_to_check_outside_slurm():
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    out = run_cli(env=env)
    assert out.returncode == 2 and "nothing to check" in out.stderr


def test_no_torch_on_the_checker_path():
    code = ("import sys, check_topology as ct; ct.main(['slurm/page_3nodes_4gpus.slurm']); "
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("NOTORCH"), out.stdout + out.stderr


# ---- inside an allocation: the batch script's view --------------------------------------------------------------
def test_allocation_from_batch_environment():
    # what the test cluster's batch step shows for -N 3 --ntasks-per-node=2 --gres=gpu:4 -c 10 --hint=nomultithread
    env = {"SLURM_JOB_ID": "6", "SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NTASKS": "6",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_CPUS_PER_TASK": "10", "SLURM_HINT": "nomultithread", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_JOB_PARTITION": "gpu_p13"}
    report = kit.checks.check_job(kit.allocation.job_from_allocation(env), kit.arguments.Training(nlayers=8, chunks=8))
    assert pairs(report)[:2] == [(0, 0, ("0", "1")), (0, 1, ("2", "3"))]
    assert [f.code for f in report.findings] == ["cpus-per-task-small"]  # 10 < 2 GPUs x 10 cores
    uneven = dict(env, SLURM_TASKS_PER_NODE="2(x2),1", SLURM_NTASKS="5")
    del uneven["SLURM_NTASKS_PER_NODE"]
    report = kit.checks.check_job(kit.allocation.job_from_allocation(uneven), kit.arguments.Training(nlayers=8))
    assert "uneven-tasks-per-node" in {f.code for f in report.findings} and not report.ok


# ---- the stage layout (torch.distributed.pipelining): a task per GPU, pipelines of --pp tasks ----------------------
def stage_report(**kw) -> kit.report.Report:
    training = kit.arguments.Training(nlayers=kw.pop("nlayers", 16), chunks=kw.pop("chunks", 8), batch_size=64,
                           layout="stage", pp=kw.pop("pp", 4), schedule=kw.pop("schedule", "1f1b"))
    job = kit.slurm.Job(nodes=kw.pop("nodes", 2), gpus_per_node=4, ntasks_per_node=kw.pop("tpn", 4), cpus_per_task=10,
                 hint="nomultithread", constraint="v100-32g", time="1:00:00")
    return kit.checks.check_job(job, training)


def test_stage_layout_clean_plan():
    report = stage_report()
    assert report.ok and not report.findings, [str(f) for f in report.findings]
    assert [p.devices for p in report.tasks] == [[0], [1], [2], [3]] * 2  # one GPU each
    assert "2 pipeline(s) x pp 4" in report.text() and "stage 3: Layer 12-15 + Decoder" in report.text()


@pytest.mark.parametrize("kw,code,level", [
    (dict(pp=3), "pp-not-dividing-world", "error"),
    (dict(pp=8), "pipeline-spans-nodes", "warning"),
    (dict(pp=4, chunks=2), "chunks-below-stages", "error"),
    (dict(pp=1), "pp-too-small", "error"),
    (dict(tpn=2, pp=2), "gpus-idle", "warning"),
    (dict(pp=4, nlayers=3), "nlayers-below-nb-part", "error"),
])
def test_stage_layout_findings(kw, code, level):
    report = stage_report(**kw)
    found = {(f.code, f.level) for f in report.findings}
    assert (code, level) in found, found


def test_stage_layout_fewer_tasks_than_stages():
    """One task for --pp 2 (e.g. a plain `python bench_stage.py --pp 2`): one error with the count, no advice."""
    report = stage_report(nodes=1, tpn=1, pp=2)
    errors = [f for f in report.findings if f.level == "error"]
    assert [f.code for f in errors] == ["pp-not-dividing-world"], [str(f) for f in report.findings]
    assert "needs at least 2 tasks" in errors[0].message and "(got 1)" in errors[0].message
    assert "none" not in " ".join(f.message for f in report.findings)


def test_stage_layout_from_sbatch_line(tmp_path):
    script = tmp_path / "stage.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -C v100-32g -N 2 --gres=gpu:4 --ntasks-per-node=4 -c 10 "
                      "--hint=nomultithread -t 1:00:00\n"
                      "srun python bench_stage.py --pp 3 --schedule gpipe --nlayers 12\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    assert (training.layout, training.pp, training.schedule) == ("stage", 3, "gpipe")
    report = kit.checks.check_job(job, training)
    assert "pp-not-dividing-world" in {f.code for f in report.findings}


# ---- task placement: what slurm-wlm 22.05 did on the test cluster (sbatch, then srun in the batch script) --------
# (sbatch options, srun options, SLURM_STEP_TASKS_PER_NODE seen, or None where the checker must say Slurm decides)
MEASURED = [
    ("-N3 -n6", "", None),  # 4,1,1 on idle nodes: free cores decide
    ("-N3 -n4 --ntasks-per-node=2", "", [2, 1, 1]),
    ("-N3 -n5 --ntasks-per-node=2", "", [2, 2, 1]),
    ("-N3 -n6 --ntasks-per-node=3", "", [2, 2, 2]),
    ("-N3 --ntasks-per-node=4", "-n 5", [2, 2, 1]),
    ("-N3 --ntasks-per-node=4", "--ntasks-per-node=1", [4, 4, 4]),
    ("-N3 --ntasks-per-node=4", "-n 6 --ntasks-per-node=1", [2, 2, 2]),
    ("-N3 -n6", "-n 3", [1, 1, 1]),
    ("-N3 --ntasks-per-node=2", "-N 2 -n 4", [2, 2]),
    ("-N3 --ntasks-per-node=4", "-n 2", [1, 1]),
    ("-N2 -n4 --ntasks-per-node=3", "", [2, 2]),
    ("-N2 -n2", "", [1, 1]),
    ("-N2 -n6 -c10", "", None),  # 3,3 (job 4,2)
    ("-N3 -n9", "", None),  # 7,1,1
]


def script_for(sbatch: str, srun: str, tmp_path: Path, trainer: str = "srun") -> Path:
    path = tmp_path / "job.slurm"
    path.write_text(f"#!/bin/bash\n#SBATCH {sbatch} --gres=gpu:4 -C v100-32g --hint=nomultithread -t 1:00:00\n"
                    f"{trainer} {srun} python bench_ddp_transformer.py --nlayers 8 --chunks 8 --nb-part 1\n")
    return path


@pytest.mark.parametrize("sbatch,srun,seen", MEASURED, ids=lambda v: str(v))
def test_placement_measured(sbatch, srun, seen, tmp_path):
    job, training, findings = kit.jobscript.read_sbatch(script_for(sbatch, srun, tmp_path))
    report = kit.checks.check_job(job, training)
    per_node = [sum(1 for p in report.tasks if p.node == n) for n in sorted({p.node for p in report.tasks})]
    assert sum(per_node) == len(report.tasks)
    if seen is None:
        assert job.placement == "possible" and any("Slurm decides by free cores" in n for n in report.notes)
        assert {f.code for f in report.findings if f.level == "error"} & {"ntasks-per-node-missing"}
    else:
        assert job.placement == "exact" and per_node == seen, report.text()
        assert [(p.node, p.local_rank) for p in report.tasks] == [(n, i) for n, c in enumerate(seen)
                                                                  for i in range(c)]
        assert ("uneven-tasks-per-node" in {f.code for f in report.findings}
                or "ntasks-mismatch" in {f.code for f in report.findings}) == (len(set(seen)) > 1)


@pytest.mark.parametrize("sbatch,srun,code", [
    ("-N3 --ntasks-per-node=2", "-N 2", "step-too-many-tasks"),  # measured: More processors requested than permitted
    ("-N3 -n7 --ntasks-per-node=2", "", "ntasks-mismatch"),  # measured: Requested node configuration is not available
    ("-N2 --ntasks-per-node=2", "-N 3", "step-nodes"),
    ("-N3 -n2", "", "ntasks-below-nodes"),
    ("-n 8 --ntasks-per-node=4", "", None),  # 2 nodes
    ("-n 8", "", "nodes-missing"),
    ("-N3 -n6", "--ntasks-per-node=2", "srun-ntasks-per-node-conflict"),  # measured 3,2,1
])
def test_placement_refusals(sbatch, srun, code, tmp_path):
    job, training, findings = kit.jobscript.read_sbatch(script_for(sbatch, srun, tmp_path))
    report = kit.checks.check_job(job, training)
    codes = {f.code for f in report.findings}
    assert (code in codes) if code else not codes & {"ntasks-mismatch", "uneven-tasks-per-node"}, report.text()
    for p in report.tasks:  # every task's tasks_on_node is the number of tasks the plan put on its node
        assert p.tasks_on_node == sum(1 for q in report.tasks if q.node == p.node), report.text()


def test_trainer_without_srun_runs_one_process(tmp_path):
    job, training, findings = kit.jobscript.read_sbatch(script_for("-N1 --ntasks-per-node=1", "", tmp_path, trainer=""))
    assert kit.checks.check_job(job, training).ok  # one task: python alone is fine
    job, training, findings = kit.jobscript.read_sbatch(script_for("-N2 --ntasks-per-node=1", "", tmp_path, trainer=""))
    report = kit.checks.check_job(job, training)
    [f] = [f for f in report.findings if f.code == "trainer-without-srun"]
    assert "2 task(s) on 2 node(s)" in f.message and "1 process" in f.message and len(report.tasks) == 1


def test_spread_adds_up():
    for n in range(1, 13):
        for caps in ([4, 4, 4], [2, 2, 2], [4, 1, 1], [1, 3]):
            counts = kit.placement.spread(n, caps)
            assert sum(counts) == min(n, sum(caps)) and all(c <= m for c, m in zip(counts, caps))
    assert kit.placement.packing(6, 3, None) == [4, 1, 1] and kit.placement.packing(9, 3, 4) == [4, 4, 1]


# ---- options, checked against Slurm's own tables -----------------------------------------------------------------
def man_options(prog: str) -> dict[str, str]:
    out = subprocess.run(["man", "-P", "cat", prog], capture_output=True, text=True, env={"MANWIDTH": "200",
                         "PATH": "/usr/bin:/bin"})
    if out.returncode or "--nodes" not in out.stdout:
        pytest.skip(f"`man {prog}` is not installed here (apt-get install slurm-wlm); the tables come from 22.05's")
    version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "slurm-client"], capture_output=True,
                             text=True).stdout if shutil.which("dpkg-query") else ""
    if not version.startswith("22.05"):
        pytest.skip(f"the installed {prog} is not Slurm 22.05, whose tables kit/slurm.py holds")
    found = {}
    for line in out.stdout.splitlines():
        for name, arg in re.findall(r"^ {7}(?:-[A-Za-z], )?--([a-z0-9][a-z0-9_-]*)(\[=|=|\s|$)", line):
            found[name] = {"[=": "o", "=": "r"}.get(arg, "n")
    return found


@pytest.mark.parametrize("prog,table", [("sbatch", kit.slurm.SBATCH_LONG), ("srun", kit.slurm.SRUN_LONG)])
def test_option_tables_match_the_man_pages(prog, table):
    documented = man_options(prog)
    hidden = {"tasks-per-node"} | ({"pack-group", "cpu_bind"} if prog == "srun" else set())  # accepted, measured
    assert set(table) == set(documented) | hidden
    differ = {n for n in documented if table[n] != documented[n] and not (n == "pty" or documented[n] == "n")}
    assert not differ, {n: (table[n], documented[n]) for n in differ}


def test_getopt_rules():
    f = kit.findings.Findings()
    assert kit.slurm.long_option("ntasks-per-nod", kit.slurm.SBATCH_LONG, "sbatch", "x", f) == "ntasks-per-node"
    assert kit.slurm.long_option("node", kit.slurm.SBATCH_LONG, "sbatch", "x",
                                 f) is None  # measured: ambiguous (nodes, nodelist..)
    assert kit.slurm.long_option("ntasks-per-noed", kit.slurm.SBATCH_LONG, "sbatch", "x", f) is None
    assert [x.code for x in f] == ["option-prefix", "ambiguous-option", "unknown-option"]
    assert "did you mean --ntasks-per-node?" in f[2].message and "--nodelist" in f[1].message
    f = kit.findings.Findings()
    kit.slurm.parse_options(["-y"], "x", f)
    kit.slurm.parse_options(["--hold=1"], "x", f)
    assert [x.code for x in f] == ["unknown-option", "bad-value"]


def test_parse_errors(tmp_path):
    script = tmp_path / "e.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -J 'unbalanced\n#SBATCH -N 1-3 --gres=gpu:4 --gpu-bind=mask_gpu:0x3\n"
                      "#SBATCH hetjob\n#SBATCH --gpu-bind=closest\n"
                      "srun --gres=gpu:2 python bench_ddp_transformer.py --engine x --layout y --schedule z 'q\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    codes = {f.code for f in findings}
    assert {"bad-directive", "node-range", "gpu-bind-mask", "gpu-bind-closest", "bad-command"} <= codes, codes
    # the hetjob line starts component 1, which the line after it describes (component 0 keeps its own)
    assert [c.gpu_bind for c in job.components] == ["mask_gpu:0x3", "closest"] and job.components[0] is job
    script.write_text("#!/bin/bash\n#SBATCH -N 1 --gres=gpu:4\n"
                      "srun --gres=gpu:2 python bench_ddp_transformer.py --engine x --layout y --schedule z\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    report = kit.checks.check_job(job, training)
    codes = {f.code for f in findings} | {f.code for f in report.findings}
    assert {"srun-gpu-option", "bad-engine", "bad-layout"} <= codes, codes
    stage = kit.arguments.Training(layout="stage", schedule="z")
    assert "bad-schedule" in {f.code for f in kit.checks.check_job(job, stage).findings}


@pytest.mark.parametrize("line,refused", [
    ("srun python bench_ddp_transformer.py --layout stage --pp 4 --schedule 1f1b", "--layout, --pp, --schedule"),
    ("srun python bench_stage.py --pp 2 --nb-part=2", "--nb-part"),
])
def test_the_other_layouts_arguments_are_refused(tmp_path, line, refused):
    """What the checker approves must start: each trainer's argparse refuses the other layout's arguments."""
    script = tmp_path / "mixed.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -C v100-32g -N 1 --ntasks-per-node=4 --gres=gpu:4 -c 10 "
                      f"--hint=nomultithread -t 1:00:00\n{line}\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    bad = [f for f in findings if f.code == "bad-layout"]
    assert len(bad) == 1 and bad[0].level == "error" and f"has no {refused}" in bad[0].message, [str(f) for f in findings]


def test_cpu_defaults_are_the_trainers():
    report = kit.checks.check_job(kit.slurm.Job(nodes=1, ntasks_per_node=1), kit.arguments.Training())
    assert report.training.nlayers == kit.arguments.CPU_DEFAULTS["nlayers"]  # no GPU: the trainer runs its CPU model
    report = kit.checks.check_job(kit.slurm.Job(nodes=1, ntasks_per_node=1, gpus_per_node=4), kit.arguments.Training())
    assert report.training.nlayers == kit.arguments.GPU_DEFAULTS["nlayers"]


# ---- --devices: an explicit GPU per part (the one-GPU check puts both parts on GPU 0) --------------------------
def test_devices_put_two_parts_on_one_gpu():
    findings = kit.findings.Findings()
    plan = kit.plan.plan_task(0, 0, 0, 1, ["0"], 1, 4, 2, findings, devices=[0, 0])
    assert (plan.nb_part, plan.devices, plan.node_gpus) == (2, [0, 0], ["0", "0"])
    assert [f.code for f in findings] == ["parts-share-gpu"] and "GPU 0" in findings[0].message


@pytest.mark.parametrize("devices,nb_part,code,needle", [
    ([0], 2, "devices-count", "lists 1 GPU(s) for nb_part 2"),
    ([0, 1], None, "gpu-index-past-visible", "GPU index 1"),
])
def test_devices_errors(devices, nb_part, code, needle):
    findings = kit.findings.Findings()
    kit.plan.plan_task(0, 0, 0, 1, ["0"], 1, 4, nb_part, findings, devices=devices)
    assert code in [f.code for f in findings.errors] and needle in " ".join(f.message for f in findings)


def test_devices_on_the_trainer_line_and_the_command_line(tmp_path, capsys):
    script = tmp_path / "one_gpu.slurm"
    script.write_text("#!/bin/bash\n#SBATCH -N 1 --ntasks-per-node=1 --gres=gpu:1 -c 10 --hint=nomultithread "
                      "-t 0:20:00 -C v100-32g\n"
                      "srun python bench_ddp_transformer.py --nb-part 2 --devices 0,0 --chunks 8 --nlayers 4\n")
    job, training, findings = kit.jobscript.read_sbatch(script)
    assert training.devices == [0, 0]
    report = kit.checks.check_job(job, training)
    codes = {f.code for f in report.findings}
    assert "parts-share-gpu" in codes and "gpu-shared" not in codes and report.ok, [str(f) for f in report.findings]
    assert report.tasks[0].devices == [0, 0]
    assert ct.main(["--nodes", "1", "--gpus-per-node", "1", "--ntasks-per-node", "1", "--nb-part", "2",
                    "--devices", "0,x"]) == 2
    assert "--devices '0,x' must be GPU indices" in capsys.readouterr().err


def test_the_same_devices_in_every_task_of_a_node_is_refused_with_its_fix(capsys):
    """--devices is one list for every task: two tasks of a 4-GPU node both on GPUs 0,1. The fix names --devices
    (fewer tasks or a smaller --nb-part would not help)."""
    assert ct.main(["--nodes", "1", "--gpus-per-node", "4", "--ntasks-per-node", "2", "--devices", "0,1"]) == 1
    out = capsys.readouterr().out
    assert ("gpu-shared: node 0: GPU 0 is used by tasks 0, 1 (2 GPU(s) shared in all); --devices 0,1 names the same "
            "visible GPUs in every task: drop --devices" in out), out


def test_parts_that_share_a_gpu_add_up_in_the_estimate():
    job = kit.slurm.Job(nodes=1, gpus_per_node=1, ntasks_per_node=1, cpus_per_task=10, hint="nomultithread",
                 constraint="v100-16g", time="0:20:00")
    alone = kit.checks.check_job(job, kit.arguments.Training(nlayers=16, chunks=8, batch_size=64, nb_part=2))
    assert "does-not-fit" not in {f.code for f in alone.findings}, [str(f) for f in alone.findings]  # 2 GPUs' worth
    report = kit.checks.check_job(job, kit.arguments.Training(nlayers=16, chunks=8, batch_size=64, nb_part=2,
                                                              devices=[0, 0]))
    bad = [f for f in report.findings if f.code == "does-not-fit"]
    assert len(bad) == 1 and "puts parts 0,1 on GPU 0" in bad[0].message, [str(f) for f in report.findings]
    assert any("GPU 0 holds parts 0,1" in n for n in report.notes)
