"""Findings and the catalogue of what the checker catches (CATCHES: code -> level, meaning).
Owns: the finding codes and their levels; UsageError; an error's one line (first_line). Imports: nothing of the kit
(every other module may import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable



@dataclass
class Finding:
    level: str  # "error" or "warning"
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():7s} {self.code}: {self.message}"


class Findings(list):
    def error(self, code: str, message: str) -> None:
        self.append(Finding("error", code, message))

    def warn(self, code: str, message: str) -> None:
        self.append(Finding("warning", code, message))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self if f.level == "error"]


def refusal_text(findings: Iterable[Finding]) -> str:
    """The trainer's one line for its errors: 'code: message; code: message'."""
    return "; ".join(f"{f.code}: {f.message}" for f in findings)


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line error (some, like EOFError, have none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class UsageError(Exception):
    """Bad command line or unreadable file: exit 2."""


def internal_error(findings: Findings, where: str, exc: BaseException, check: str = "") -> None:
    """One finding for a check that failed unexpectedly on this script (a bug of the checker, not of the script):
    where it was, which check, what was raised and where, and a request to report it. The checker exits 2."""
    import traceback  # only on this path
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename.rpartition('/')[2]}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    text = str(exc)
    findings.error("internal-error", f"{where}: the checker failed while judging this ({check + ': ' if check else ''}"
                   f"{type(exc).__name__}{at}: "
                   f"{text[:200] + '...' if len(text) > 200 else text}); the other checks ran, but this verdict is "
                   "incomplete: please report it with the script (it is the checker's bug, not the script's)")


def guarded(findings: Findings, where: str, check, *args, passing: tuple = (), **kwargs):
    """check(*args, **kwargs), or None where it raised: an unexpected exception becomes internal_error's finding,
    so that one failing check never stops the others (issue 40). A UsageError (exit 2 with its own line) passes, and
    so do the `passing` exceptions (a reading's own control flow: kit.shell's TooComplex, StopScript)."""
    try:
        return check(*args, **kwargs)
    except (UsageError, *passing):
        raise
    except Exception as exc:  # any bug of a check: said, never raised at the user
        internal_error(findings, where, exc, getattr(check, "__name__", ""))
        return None

# Every finding the checker can give, with its level: `--json` carries these codes, and docs/checker.md (section 9)
# lists exactly this table (tests/test_check_topology.py compares the three: this table, the code, the docs).
CATCHES = {
    # reading the script as sbatch 22.05 does
    "no-shebang": ("error", "the first line is not #! and an interpreter (sbatch refuses the file)"),
    "dos-line-breaks": ("error", "\\r\\n line ends (sbatch refuses the file)"),
    "cr-line-breaks": ("error", "\\r line ends alone (sbatch and bash read the file as one line)"),
    "script-too-large": ("error", "a script over 4 MiB (slurmctld refuses it)"),
    "not-a-script": ("error", "a file with NUL bytes, e.g. a binary (sbatch refuses it)"),
    "unknown-option": ("error", "an option sbatch or srun does not know, with a did-you-mean"),
    "ambiguous-option": ("error", "an abbreviation that matches several options (getopt refuses it)"),
    "option-prefix": ("warning", "an unambiguous abbreviation, which getopt accepts: write it in full"),
    "stray-token": ("error", "a word in a #SBATCH line that is not an option (sbatch refuses the file)"),
    "bad-directive": ("error", "a #SBATCH line that cannot be parsed (unbalanced quotes)"),
    "bad-value": ("error", "a value sbatch or srun refuses: a count (-N=2), --hint, --mem, --gpu-bind, --cpu-bind, "
                  "--distribution, --exclusive, --signal, --mail-type, --open-mode, --gres-flags, --dependency, --array "
                  "(sbatch's submission fails: 'Job dependency problem', 'Invalid job array specification') ..."),
    "value-misread": ("warning", "a value sbatch accepts but reads otherwise than written (--gpu-bind=closes is "
                      "closest, unknown --mail-type words are dropped)"),
    "option-conflict": ("error", "options sbatch refuses together (--mem with --mem-per-cpu, --cpus-per-gpu with "
                        "--cpus-per-task, --ntasks-per-gpu with --ntasks-per-node)"),
    "hint-ignored": ("warning", "--hint with --ntasks-per-core or --threads-per-core: Slurm drops the hint"),
    "count-too-large": ("error", "a count above what any Jean Zay node or partition has (nothing is planned from it)"),
    "bad-command": ("error", "a command line bash cannot parse (a quote never closed)"),
    "shell-unread": ("warning", "a script nested too deeply to follow"),
    "too-complex": ("warning", "a script too costly to follow to its end (10^8 function calls, values doubled "
                    "to gigabytes, more than 50000 words): checked up to the line named"),
    "variable-in-directive": ("error", "$VARIABLES in #SBATCH lines, which sbatch does not expand"),
    "ignored-directive": ("warning", "a directive sbatch ignores: indented, lower case, '# SBATCH', after the first "
                          "command, inside a here-document"),
    "slurm-directive": ("warning", "#SLURM lines, which sbatch applies as directives"),
    "pbs-directive": ("error", "#PBS / #BSUB lines, which sbatch also reads, without --ignore-pbs"),
    "node-range": ("warning", "--nodes=MIN-MAX: the plan assumes MIN"),
    "unchecked-argument": ("warning", "a trainer argument given as a shell variable: it, and what depends on it, is "
                           "not checked (a variable alone may hold any argument: then nothing that depends on them)"),
    # tasks and their placement
    "trainer-without-srun": ("error", "a launch line without srun in a job of several nodes (or tasks, for the kit's "
                             "trainer): it runs once, on the first node"),
    "nodes-missing": ("warning", "--ntasks without --nodes: Slurm picks the node count"),
    "ntasks-per-node-missing": ("error/warning",
                                "--ntasks-per-node missing: an error when several nodes may pack unevenly"),
    "ntasks-mismatch": ("error", "--ntasks above nodes x --ntasks-per-node (refused), or below it and placed unevenly"),
    "ntasks-per-node-max": ("warning",
                            "--ntasks below nodes x --ntasks-per-node but even: SLURM_NTASKS_PER_NODE misleads"),
    "ntasks-below-nodes": ("error", "fewer tasks than nodes"),
    "uneven-tasks-per-node": ("error", "tasks per node differ, so nb_part differs between nodes"),
    "step-nodes": ("error", "srun -N above the job's nodes"),
    "step-too-many-tasks": ("error", "srun -n above what the allocation holds (srun refuses the step)"),
    "srun-ntasks-per-node-ignored": ("warning", "srun --ntasks-per-node that srun ignores (it doesn't match -n)"),
    "srun-ntasks-per-node-conflict": ("error", "srun --ntasks-per-node above what the nodes hold (placed unevenly)"),
    "srun-gpu-option": ("warning", "srun --gres/--gpus* on the trainer's line, not modelled"),
    "srun-cpus-per-task": ("warning", "srun without -c in a job with --cpus-per-task (22.05 and 23.02 give each task "
                           "1 CPU)"),
    "launcher-agents-per-node": ("error", "several torchrun/deepspeed/accelerate agents per node (srun's tasks): "
                                 "they race for the rendezvous"),
    "launcher-nodes-mismatch": ("error", "a launcher's node count (--nnodes, --num_machines, --num_nodes) that "
                                "disagrees with the nodes that start it, or a node rank (--node_rank, --machine_rank) "
                                "that is not each agent's own"),
    "launcher-not-modelled": ("warning", "the kit's trainer under deepspeed or accelerate"),
    "processes-exceed-gpus": ("error/warning", "more processes per node than GPUs (a launcher's workers; srun tasks of "
                              "another program: a warning)"),
    # GPUs
    "no-gpus": ("error/warning", "no GPU requested for the kit's trainer (a warning on CPU nodes), or GPU nodes "
                "asked for without a GPU"),
    "gpu-request-conflict": ("error", "--gres=gpu:N with a --gpus-per-node, --gpus or --gpus-per-task that disagrees"),
    "gpus-total-multinode": ("error", "--gpus=N (a total) over several nodes: no even split is promised"),
    "gpus-exceed-node": ("error", "more GPUs per node than the node type has (sbatch refuses it; the plan shows the "
                         "node's own GPUs)"),
    "gpus-not-divisible": ("error", "GPUs per node not divisible by tasks per node"),
    "more-tasks-than-gpus": ("error", "more tasks per node than GPUs: nb_part = 0"),
    "gpu-index-past-visible": ("error", "a task would use a GPU index past what it sees (the first such index)"),
    "devices-count": ("error", "--devices does not give one GPU index per part"),
    "parts-share-gpu": ("warning", "--devices puts several parts on one GPU (a one-GPU check, not a speed figure)"),
    "gpu-shared": ("error", "two tasks of a node on one GPU"),
    "gpus-idle": ("warning", "GPUs nobody uses (how many, which)"),
    "gpus-per-task-cgroup": ("warning", "--gpus-per-task: per-task GPU cgroups hide NVLink from NCCL"),
    "gpu-bind-mask": ("warning", "--gpu-bind=mask_gpu, not modelled"),
    "gpu-bind-closest": ("warning", "--gpu-bind=closest, which depends on the node"),
    "distribution-not-modelled": ("warning", "--distribution=arbitrary: which task runs where is not modelled"),
    # the script's steps, array elements, heterogeneous components, and the batch shell (kit.steps)
    "het-group": ("error/warning", "srun --het-group past the job's components, or in a job that is not heterogeneous "
                  "(srun refuses the step); over several components (a warning: planned on the first)"),
    "array-partly-checked": ("warning", "a job array of more elements than the checker reads one by one (128): the "
                             "others are not checked"),
    "signal-no-trap": ("warning", "--signal=B:SIG with no trap for SIG in the script: the batch shell dies of it, "
                       "the job ends FAILED and the steps never get the signal"),
    "requeue-disabled": ("warning", "scontrol requeue in a job with --no-requeue: Slurm refuses it and the job ends"),
    "export-no-path": ("error/warning", "--export=NONE (or a list without PATH) reaches the srun steps: a program "
                       "named without a path is not found (execve fails; an error), one with a path runs without "
                       "the modules' environment (a warning)"),
    # cores, time, account, modules (Jean Zay)
    "cpus-per-task-missing": ("warning", "--cpus-per-task missing (Jean Zay grants memory per core)"),
    "cpus-per-task-small": ("warning", "--cpus-per-task (or --cpus-per-gpu) below the node's cores per GPU x GPUs "
                            "per task"),
    "cpus-exceed-node": ("error", "tasks x --cpus-per-task, or --cpus-per-gpu x GPUs, above the node's cores"),
    "hint-missing": ("warning", "--hint=nomultithread missing"),
    "time-missing": ("warning", "--time missing: 10 minutes on Jean Zay's GPU partitions"),
    "bad-time": ("error", "a --time Slurm does not read"),
    "time-over-qos": ("error/warning", "--time above the QoS or partition limit (dev 2 h, t3 20 h, t4 100 h; A100 "
                      "20 h; prepost 20 h); a warning where only the default QoS's limit is passed (an association "
                      "may default to a longer one)"),
    "account-mismatch": ("error", "an account suffix (@v100, @a100, @h100, @cpu) that does not match the nodes asked "
                         "for; live: an account none of your associations has"),
    "arch-module-missing": ("error/warning", "H100 nodes without module load arch/h100 first (an error); A100 80 GB "
                            "nodes without module load cpuarch/amd (a warning)"),
    "constraint-unavailable": ("error", "a -C feature no node of the partition has, or a retired partition"),
    "qos-mismatch": ("error/warning", "a --qos of another node type (qos_gpu-t4 on A100, which has none: an error); a "
                     "QoS the table does not know (qos_gpu-gc, a project's grant: a warning naming sacctmgr)"),
    "qos-limit": ("error", "more GPUs (or cores) than the QoS allows a job (or, live, a user)"),
    "partition-unknown": ("error", "-p names no partition of Slurm's configuration here (--site live)"),
    "accounting-unread": ("warning", "Slurm answered but its accounting (slurmdbd) did not in time: the QoS, account "
                          "and time were judged by the table, not by your associations"),
    "engine-unavailable": ("error", "--engine torch-pipe with a pytorch-gpu/py3/2.4+ module"),
    "torch-too-old": ("error", "bench_stage.py with a pytorch-gpu/py3 module older than 2.4"),
    # memory (the section *Will it fit?*)
    "does-not-fit": ("error", "a GPU's estimated peak memory (a part of a replica, a task of a pipeline) "
                              "above its own"),
    "memory-tight": ("warning", "a GPU's estimated peak memory above 90 % of its own"),
    "ignored-with-model": ("warning", "the kit's Transformer's options (--nlayers, --d-model ...) on a line with "
                           "--model, which builds its own layers"),
    "bf16-on-v100": ("error", "--precision bf16 on V100 GPUs, which have no bf16"),
    "tf32-on-v100": ("warning", "--tf32 on V100 GPUs, which have no TF32 units: fp32 matmuls as without it"),
    "fp16-stage": ("error", "--precision fp16 in the stage layout, whose schedules leave no place for a GradScaler"),
    # the model and the pipeline
    "nlayers-below-nb-part": ("error", "fewer layers than GPUs per task"),
    "nlayers-not-multiple": ("warning", "layers not a multiple of GPUs per task"),
    "chunks-above-batch": ("error", "more chunks than the batch per replica"),
    "chunks-not-dividing-batch": ("error", "chunks not dividing the batch per replica"),
    "pipeline-bubble": ("warning", "chunks < 4 x nb_part: the bubble fraction and the chunks that bring it under 20 %"),
    "bad-engine": ("error", "an --engine the trainer does not have"),
    "bad-layout": ("error", "an argument the trainer's script does not have: --layout, or the other layout's "
                   "(--pp on bench_ddp_transformer.py, --nb-part on bench_stage.py)"),
    # the trainer's own refusals of its line (the one definition of its arguments, read by its own parser)
    "unknown-argument": ("error", "an option the trainer does not have: an abbreviation (refused), '_' for '-', a "
                         "typo, with the full option it may stand for"),
    "bad-argument": ("error", "a trainer argument's value the trainer refuses: not a number, outside its range "
                     "(every count is bounded), no value, or a model it cannot build (--d-model not a multiple of "
                     "--n-head)"),
    "torch-release": ("error", "what the installed torch lacks (the trainer and its --check-args; in a job script "
                      "the module line gives engine-unavailable / torch-too-old)"),
    "no-training": ("warning", "a trainer line with --help or --check-args, which exits without training"),
    "bad-schedule": ("error", "a --schedule the stage layout does not have"),
    "pp-too-small": ("error", "stage layout: --pp below 2"),
    "pp-not-dividing-world": ("error", "stage layout: --pp not dividing the tasks"),
    "pipeline-spans-nodes": ("warning", "stage layout: pipelines that cross nodes (tasks per node, or srun's "
                             "--distribution numbering the ranks across nodes)"),
    "chunks-below-stages": ("error", "stage layout: 1F1B (or DualPipeV: 2 x pp) with fewer chunks than stages"),
    "chunks-not-rounds": ("error", "stage layout: interleaved chunks not a multiple of the rounds"),
    "v-two-stages": ("error", "stage layout: a V schedule (zbvzerobubble, dualpipev) with other than 2 stages a task"),
    # inside a running step (srun python check_topology.py)
    "task-missing": ("error", "a task that never reported to task 0"),
    "affinity-small": ("warning", "a task may run on fewer CPUs than --cpus-per-task"),
    "no-gpu-visible": ("warning", "a task that sees no GPU"),
    # the checker itself
    "internal-error": ("error", "a check that failed unexpectedly on this script (a bug of the checker): the finding "
                       "names the line and asks for a report; the other checks ran; exit status 2"),
}
