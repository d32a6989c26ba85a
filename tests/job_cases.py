"""Modern job scripts as a real Slurm 22.05.8 runs them (issue 40): per-GPU options, several steps, arrays,
heterogeneous jobs, distributions, signals, requeue, exports, and sbatch's own value checks. Each case is a batch
script and what the local cluster (tests/local_slurm.py, default variant) did with it, measured by
tests/test_jobs_slurm.py; tests/test_jobs.py holds the checker's verdict on the same script to that fate.

A case's fate (Fate):
  kind    'refused' (sbatch exits 1, no job), 'pending' (a job that waits with a reason no time changes) or 'ran'
  text    the refusal's words (sbatch's error lines less their prefixes, ' | ' between them) or the pending reason
  state   the job's last state once it ran (every array element's, when they agree: COMPLETED, FAILED ...)
  steps   each step the script marks (`; echo "@step $LINENO $?"` after it): (array index or -1, line, exit code)
  tasks   each probed step's tasks (`echo "@task LINE $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID"` in it):
          (line, ((procid, nodeid, localid), ...)), sorted; a step's placement as Slurm made it
  words   what failed steps printed that says how (srun's or the trainer's error line), for the record

The trainer's lines run the kit's own trainer with --check-args (no torch: a tenth of a second): it judges its
arguments in the step's real environment (SLURM_*, CUDA_VISIBLE_DEVICES: fake GPUs) exactly as a training run's
start does, and exits non-zero with the trainer's refusal where a run would refuse to start.

What a case expects of the checker besides agreeing with the fate: `warn`, warning codes it must give (a job that
runs but loses what the user wanted: a signal that kills the batch shell, a requeue Slurm refuses, pipelines across
nodes, cores below the node's share).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from launch import clean_env, copy_kit

NAME = "job.slurm"  # every case's script is checked and submitted under this name


class Fate(NamedTuple):
    kind: str
    text: str = ""
    state: str = ""
    steps: tuple = ()
    tasks: tuple = ()
    words: tuple = ()


class Case(NamedTuple):
    name: str
    script: str
    fate: Fate
    warn: tuple[str, ...] = ()


def script(header: str, *body: str) -> str:
    """A batch script: '#!/bin/bash', one '#SBATCH' line per header line, then the body's lines, where {line} is
    the line's own number (for the markers)."""
    lines = ["#!/bin/bash"] + [f"#SBATCH {h.strip()}" for h in header.strip().splitlines()]
    for text in body:
        lines.append(text.replace("{line}", str(len(lines) + 1)))
    return "\n".join(lines) + "\n"


def step(srun: str, command: str) -> str:
    """A step marked with its exit status: `srun OPTIONS COMMAND; echo "@step $LINENO $?"`."""
    return f'srun {srun} {command}; echo "@step $LINENO $?"'.replace("srun  ", "srun ")


def probed(srun: str, trainer: str, args: str) -> str:
    """A trainer's step whose tasks say where they run before the trainer judges its arguments (--check-args)."""
    inner = f'echo "@task {{line}} $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID"; exec python {trainer} --check-args {args}'
    return step(srun, f"bash -c '{inner}'")


V100 = "-C v100-32g --hint=nomultithread -t 10"
H100 = "-p gpu_p6 -C h100 --hint=nomultithread -t 10"
DDP, STAGE = "bench_ddp_transformer.py", "bench_stage.py"

RAN = "COMPLETED"
NOT_AVAILABLE = "Requested node configuration is not available"

CASES = [
    # -- per-GPU options: the cores and GPUs each task gets, as Slurm computes them --
    Case("cpus-per-gpu, srun -c without -n", script(  # 4 x 16 = 64 cores: srun -c 32 counts 2 tasks itself
        f"{H100} --gres=gpu:4 --cpus-per-gpu=16",
        probed("-c 32", DDP, "--nlayers 6 --chunks 8 --batch-size 32")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0), (1, 0, 1))),)), warn=("cpus-per-task-small",)),
    Case("cpus-per-gpu, -N and the hint set the tasks", script(  # sbatch's own SLURM_NTASKS=1: srun inherits it
        f"{H100} -N 1 --gres=gpu:4 --cpus-per-gpu=20",
        probed("-c 40", DDP, "--nlayers 6 --chunks 16 --batch-size 32")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0),)),)), warn=("cpus-per-task-small",)),
    Case("cpus-per-gpu, a step past the cores", script(
        f"{V100} -N 1 --ntasks-per-node=2 --gres=gpu:4 --cpus-per-gpu=10",
        step("-c 30", f"python {DDP} --check-args --nlayers 8"),
        probed("-c 20", DDP, "--nlayers 8 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 1), (-1, 4, 0)), ((4, ((0, 0, 0), (1, 0, 1))),),
             ("More processors requested than permitted",))),
    Case("gpus-per-task on two nodes", script(
        f"{V100} -N 2 --ntasks-per-node=2 --gpus-per-task=2 -c 8",
        probed("-c 8", DDP, "--nlayers 4 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1))),)),
        warn=("gpus-per-task-cgroup",)),
    Case("gres and gpus-per-task disagree", script(
        f"{V100} -N 1 --gres=gpu:4 --gpus-per-task=1 --ntasks-per-node=3 -c 10",
        step("-c 10", f"python {DDP} --check-args")),
        Fate("refused", "Failed to validate job spec. Based on --gres=gpu/--gpus-per-node and --gpus-per-task requested "
             "number of tasks per node differ from --ntasks-per-node. | Invalid generic resource (gres) specification")),
    Case("cpus-per-gpu past the node's cores", script(
        f"{H100} -N 1 --gres=gpu:4 --cpus-per-gpu=30",
        step("-c 30", f"python {DDP} --check-args")),
        Fate("refused", NOT_AVAILABLE)),
    Case("mem-per-gpu", script(  # the test cluster's nodes track no memory: accepted, as sizing only
        f"{V100} -N 1 --ntasks-per-node=2 --gres=gpu:2 --mem-per-gpu=6G -c 10",
        probed("-c 10", DDP, "--nlayers 4 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0), (1, 0, 1))),))),
    Case("eight GPUs on a four-GPU node", script(
        f"{V100} -N 1 --ntasks-per-node=2 --gres=gpu:8 -c 10",
        step("-c 10", f"python {DDP} --check-args --nlayers 8")),
        Fate("refused", NOT_AVAILABLE)),
    # -- every step, in order: each judged as Slurm places it --
    Case("two steps, the second refused", script(
        f"{V100} -N 1 --ntasks-per-node=4 --gres=gpu:4 -c 10",
        probed("-n 2 -c 10", DDP, "--nlayers 8 --chunks 8"),
        probed("-n 1 -c 10", DDP, "--nlayers 2 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 0), (-1, 4, 1)), ((3, ((0, 0, 0), (1, 0, 1))), (4, ((0, 0, 0),))),
             ("nlayers-below-nb-part",))),
    Case("stage then replica layout", script(
        f"{V100} -N 1 --ntasks-per-node=4 --gres=gpu:4 -c 10",
        probed("-c 10", STAGE, "--pp 2 --chunks 8"),
        probed("-c 10", DDP, "--chunks 5 --batch-size 64")),
        Fate("ran", "", RAN, ((-1, 3, 0), (-1, 4, 1)), ((3, ((0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3))),
                                                        (4, ((0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)))),
             ("chunks-not-dividing-batch",))),
    # -- arrays: each element's index is known before the job starts --
    Case("array, --nlayers from the index", script(
        f"{V100} -N 1 --ntasks-per-node=1 --gres=gpu:4 -c 40 --array=2-5",
        step("-c 40", f"python {DDP} --check-args --nlayers $SLURM_ARRAY_TASK_ID --chunks 16")),
        Fate("ran", "", "", ((2, 3, 1), (3, 3, 1), (4, 3, 0), (5, 3, 0)), (), ("nlayers-below-nb-part",))),
    Case("array, --chunks from a bash array", script(
        f"{V100} -N 1 --ntasks-per-node=2 --gres=gpu:4 -c 20 --array=0-3",
        "CHUNKS=(3 6 12 24)",
        step("-c 20", f"python {DDP} --check-args --nlayers 8 --batch-size 36 "
                      "--chunks ${CHUNKS[$SLURM_ARRAY_TASK_ID]}")),
        Fate("ran", "", "", ((0, 4, 0), (1, 4, 0), (2, 4, 0), (3, 4, 1)), (), ("chunks-not-dividing-batch",))),
    Case("array, values from case and if", script(  # the index decides the branches, as bash takes them
        f"{V100} -N 1 --ntasks-per-node=1 --gres=gpu:4 -c 40 --array=0-2",
        'case "$SLURM_ARRAY_TASK_ID" in',
        "  1) LAYERS=3 ;;",
        "  *) LAYERS=8 ;;",
        "esac",
        'if [ "$SLURM_ARRAY_TASK_ID" -ge 2 ]; then CHUNKS=24; else CHUNKS=16; fi',
        step("-c 40", f"python {DDP} --check-args --nlayers $LAYERS --chunks $CHUNKS --batch-size 64")),
        Fate("ran", "", "", ((0, 8, 0), (1, 8, 1), (2, 8, 1)), (), ("nlayers-below-nb-part", "chunks-not-dividing-batch"))),
    # -- heterogeneous jobs: srun runs on component 0 unless --het-group says otherwise --
    Case("hetjob, plain srun and --het-group=1", script(
        f"{V100} -N 1 --ntasks=1 --gres=gpu:1 -c 4\nhetjob\n{V100} -N 2 --ntasks-per-node=2 --gres=gpu:4 -c 10",
        probed("-c 4", DDP, "--nlayers 4 --chunks 8"),
        probed("--het-group=1 -c 10", DDP, "--nlayers 4 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 5, 0), (-1, 6, 0)), ((5, ((0, 0, 0),)), (6, ((0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                                               (3, 1, 1))))),
        warn=("cpus-per-task-small",)),
    Case("hetjob, a group past the last", script(
        f"{V100} -N 1 --ntasks=1 --gres=gpu:1 -c 10\nhetjob\n{V100} -N 1 --ntasks=2 --gres=gpu:2 -c 10",
        step("--het-group=3", "hostname")),
        Fate("ran", "", RAN, ((-1, 5, 1),), (), ("Requested het-group offset exceeds highest hetjob index",))),
    # -- distributions: which node each rank is on --
    Case("plane=3 over two nodes, stage layout", script(
        f"{V100} -N 2 --ntasks-per-node=4 --gres=gpu:4 -c 5 --distribution=plane=3",
        probed("-c 5", STAGE, "--pp 2 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2),
                                                   (6, 0, 3), (7, 1, 3))),)),
        warn=("pipeline-spans-nodes",)),
    Case("srun -m cyclic, stage layout", script(
        f"{V100} -N 2 --ntasks-per-node=2 --gres=gpu:4 -c 10",
        probed("-m cyclic -c 10", STAGE, "--pp 2 --chunks 8")),
        Fate("ran", "", RAN, ((-1, 3, 0),), ((3, ((0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1))),)),
        warn=("pipeline-spans-nodes",)),
    # -- signals, requeue, exports --
    Case("--signal=B: with no trap", script(  # the batch shell dies: no step marker, the job FAILED
        "-N 1 -t 1 --signal=B:USR2@50",
        step("-n 1", "sleep 100")),
        Fate("ran", "", "FAILED"), warn=("signal-no-trap",)),
    Case("--signal=B: trapped", script(
        "-N 1 -t 1 --signal=B:USR2@50",
        "trap 'echo @trapped; exit 0' USR2",
        "srun -n 1 sleep 100 &",
        "wait"),
        Fate("ran", "", RAN, words=("@trapped",))),
    Case("--no-requeue, then scontrol requeue", script(
        "-N 1 -t 5 --no-requeue",
        'scontrol requeue "$SLURM_JOB_ID"; echo "@step $LINENO $?"'),
        Fate("ran", "", RAN, ((-1, 3, 1),), (), ("Requested operation is presently disabled for job",)),
        warn=("requeue-disabled",)),
    Case("srun --export=NONE", script("-N 1 -t 5", step("--export=NONE -n 1", "hostname")),
         Fate("ran", "", RAN, ((-1, 3, 2),), (), ("execve(): hostname: No such file or directory",))),
    Case("--export=NONE, restored for one step", script(
        "-N 1 -t 5 --export=NONE",
        step("-n 1", "hostname"),
        "export SLURM_EXPORT_ENV=ALL",
        step("-n 1", "hostname")),
        Fate("ran", "", RAN, ((-1, 3, 2), (-1, 5, 0)), (), ("execve(): hostname: No such file or directory",))),
    # -- sbatch's own value checks --
    Case("--dependency with a typo", script("-N 1 -t 5 --dependency=afterk:12", "true"),
         Fate("refused", "Job dependency problem")),
    # job ids below the test cluster's FirstJobId (10 at least): jobs that never were, as good as gone
    Case("--dependency on jobs that are gone", script("-N 1 -t 5 --dependency=afterany:7:8?afterok:9", "true"),
         Fate("ran", "", RAN)),
    Case("--array backwards", script("-N 1 -t 5 --array=7-3", "true"), Fate("refused", "Invalid job array specification")),
    Case("--array with a step", script("-N 1 -t 5 --array=0-6:3%2", 'true; echo "@step $LINENO $?"'),
         Fate("ran", "", "", ((0, 3, 0), (3, 3, 0), (6, 3, 0)))),
    Case("--ntasks past any node's cores", script("-N 1 --ntasks-per-node=200 -t 5", "true"),
         Fate("pending", "PartitionConfig")),
    Case("--gpus-per-node past any node's", script("-N 1 --gpus-per-node=17 -t 5", "true"), Fate("refused", NOT_AVAILABLE)),
    Case("more nodes than any partition", script("--nodes=5000 -t 5", "true"), Fate("pending", "PartitionConfig")),
]


# -- measuring: every case submitted at once, each job watched to its end --

def refusal(stderr: str) -> str:
    """sbatch's error lines, less their prefixes, joined by ' | '."""
    lines = []
    for line in stderr.splitlines():
        for prefix in ("sbatch: error: ", "sbatch: fatal: ", "Batch job submission failed: ", "allocation failure: "):
            line = line[len(prefix):] if line.startswith(prefix) else line
        if line.strip() and line.strip() not in lines and not line.startswith("sbatch: Warning"):
            lines.append(line.strip())
    return " | ".join(lines)


def measure(cluster, cases: list[Case] = CASES, deadline_s: float = 150) -> dict[str, tuple[Fate, str]]:
    """Each case's fate on the cluster, and what its job printed (sbatch's words where it refused): all submitted
    at once, each from its own folder beside a copy of the kit, then watched every 0.3 s (`scontrol show job`:
    MinJobAge keeps a finished job 4 s) until each has ended or pends for good."""
    root = Path(tempfile.mkdtemp(prefix="jobs-", dir=cluster.root))
    os.chmod(root, 0o755)
    copy_kit(root)
    env = clean_env(**cluster.env)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    fates, jobs = {}, {}
    for n, case in enumerate(cases):
        folder = root / f"case{n}"
        folder.mkdir()
        os.chmod(folder, 0o755)
        for name in ("kit", "bench_ddp_transformer.py", "bench_stage.py", "idr_torch.py"):
            (folder / name).symlink_to(root / name)
        (folder / NAME).write_text(case.script)
        out = subprocess.run(["sbatch", "--parsable", "-o", "out_%a.txt", NAME], cwd=folder, env=env,
                             capture_output=True, text=True, timeout=60)
        if out.returncode:
            fates[case.name] = (Fate("refused", refusal(out.stderr)), out.stderr)
        else:
            jobs[case.name] = (out.stdout.strip().split(";")[0], folder)
    states = watch(env, jobs, time.monotonic() + deadline_s)
    for name, (job, folder) in jobs.items():
        fates[name] = read_fate(states.get(name, {}), folder)
    return fates


def watch(env: dict, jobs: dict, deadline: float) -> dict[str, dict]:
    """Every job's last state per array element ({element: (state, reason)}), until each has ended or pends for a
    reason no time changes (then it is cancelled)."""
    seen: dict[str, dict] = {}
    active = dict(jobs)
    while active and time.monotonic() < deadline:
        for name, (job, _) in list(active.items()):
            out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True)
            rows = [dict(kv.split("=", 1) for kv in row.split() if "=" in kv) for row in out.stdout.splitlines()]
            if out.returncode or not rows:
                del active[name]
                continue
            for row in rows:
                seen.setdefault(name, {})[row.get("ArrayTaskId", "-1")] = (row.get("JobState"), row.get("Reason"))
            if all(r.get("JobState") == "PENDING" and r.get("Reason") not in TRANSIENT for r in rows):
                subprocess.run(["scancel", job], env=env)
                del active[name]
        time.sleep(0.3)
    for job, _ in active.values():
        subprocess.run(["scancel", job], env=env)
    return seen


TRANSIENT = ("None", "Priority", "Resources", "BeginTime", "Dependency", "JobArrayTaskLimit")


def read_fate(states: dict, folder: Path) -> tuple[Fate, str]:
    """A job's fate from its states and its output files (one per array element), and the output itself."""
    pending = [r for s, r in states.values() if s == "PENDING"]
    if pending and len(pending) == len(states):
        return Fate("pending", pending[0]), ""
    for _ in range(50):  # slurmd writes the output file; it may land a moment after the job leaves
        if list(folder.glob("out_*.txt")):
            break
        time.sleep(0.1)
    steps, tasks, text = [], {}, ""
    outputs = sorted(folder.glob("out_*.txt"), key=lambda p: int(p.stem[4:]))
    array = any(p.stem[4:] != "4294967294" for p in outputs)  # %a of a job that is no array
    for n, path in enumerate(outputs):
        element = int(path.stem[4:]) if array else -1
        text += path.read_text()
        for line in path.read_text().splitlines():
            if line.startswith("@step "):
                where, rc = line.split()[1:3]
                steps.append((element, int(where), int(rc)))
            elif line.startswith("@task ") and n == 0:  # the first element's placement (the others' is the same)
                where, *ids = line.split()[1:5]
                tasks.setdefault(int(where), set()).add(tuple(map(int, ids)))
    # an array's elements come and go between two looks: their states are not compared, their steps are
    state = "" if array else ",".join(sorted({s for s, _ in states.values()}))
    return Fate("ran", "", state, tuple(sorted(steps)),
                tuple((k, tuple(sorted(v))) for k, v in sorted(tasks.items()))), text


# -- the checker's verdict against a fate: what test_jobs.py holds, case by case --

def _elements(message: str) -> set[int] | None:
    """The array elements a finding holds for ('array element(s) 2-3 of --array=...: ...'), None: every element."""
    m = re.match(r"array element\(s\) ([\d,-]+) of ", message)
    if not m:
        return None
    out = set()
    for part in m.group(1).split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def _names(message: str, line: int) -> bool:
    return re.search(rf"(^|: ){re.escape(NAME)}:{line}:", message) is not None


def plan_of(report: dict, line: int) -> list | None:
    """The checker's plan of the trainer line at `line`: [(rank, node, local rank)] sorted, or None."""
    for plan in [report] + report.get("steps", []):
        if plan.get("where") == f"{NAME}:{line}":
            return sorted((t["rank"], t["node"], t["local_rank"]) for t in plan["tasks"])
    return None


def verdict_problems(case: Case, fate: Fate, report: dict) -> list[str]:
    """Where the checker's report disagrees with what Slurm did: a refusal or a pending reason it does not quote in
    an error, a step that failed without an error naming its line (and element), an error on a step that ran or in
    a job that completed, a placement other than Slurm's, a warning the case needs missing."""
    errors = [f["message"] for f in report["findings"] if f["level"] == "error"]
    codes = {f["code"] for f in report["findings"]}
    problems = [f"no {code} warning" for code in case.warn if code not in codes]
    if fate.kind in ("refused", "pending"):
        if not any(part in e for e in errors for part in fate.text.split(" | ")):
            problems.append(f"Slurm: {fate.kind} ({fate.text}); no error of the checker says so: {errors}")
        return problems
    explained = [f["message"] for f in report["findings"] if f["code"] in case.warn]  # a warned failure (requeue)
    for element, line, rc in fate.steps:
        said = [e for e in errors if _names(e, line) and (_elements(e) is None or element in _elements(e))]
        if rc and not said and not any(_names(e, line) for e in explained):
            problems.append(f"line {line} (element {element}) failed with exit code {rc}; no error names it")
        elif not rc and said:
            problems.append(f"line {line} (element {element}) ran; yet: {said}")
    failing = {line for _, line, rc in fate.steps if rc}
    stray = [e for e in errors if not any(_names(e, line) for line in failing)]
    said = " ".join(f"{f['code']} {f['message']}" for f in report["findings"])
    problems += [f"Slurm says {w!r}; no finding does" for w in fate.words if not w.startswith("@") and w not in said]
    if stray:
        problems.append(f"errors where Slurm's steps ran: {stray}")
    for line, tasks in fate.tasks:
        if plan_of(report, line) != list(tasks):
            problems.append(f"line {line}: Slurm placed {list(tasks)}, the checker plans {plan_of(report, line)}")
    return problems
