"""The GPU path without a GPU: each trainer's CUDA branch under tests/cuda_standin.py, every task of a 4-GPU node a
real process, then nccl's communicators rebuilt from what each task did and held to nccl's rules:

- every task calls torch.cuda.set_device(first_part) before it touches a GPU, and touches only its own GPUs;
- every collective on an nccl group names its GPU (a tensor on it, device_ids=, a bound device_id, or the device
  set for object collectives), or runs on the gloo group;
- the k-th communicator a task creates in a group pairs with the k-th of every other task (else they wait for each
  other until the timeout), and no two tasks of one node are on one GPU in one communicator (nccl:
  "Duplicate GPU detected", ncclInvalidUsage).

The rules and their sources per release are in tests/cuda_standin.py's docstring; docs/gpu.md has them in short.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from launch import ROOT, TORCH, run_tasks, srun_envs

pytestmark = pytest.mark.multiproc

SMALL = ["--nlayers", "4", "--d-model", "32", "--n-head", "2", "--d-hid", "64", "--seq-len", "16", "--vocab-size",
         "200", "--chunks", "2", "--batch-size", "8", "--dropout", "0", "--synthetic", "200", "--epochs", "1",
         "--max-steps", "3", "--workers", "0", "--log-every", "0"]
GPUS = 4


def standin_run(tmp_path: Path, script: str, args: list[str], ntasks: int, nodes: int = 1) -> list[dict]:
    envs = srun_envs(ntasks, nodes)
    for env in envs:
        env["KIT_STANDIN_GPUS"] = str(GPUS)
    argv = [str(ROOT / "tests" / "cuda_standin.py"), str(tmp_path), str(ROOT / script), *args,
            "--cache-dir", str(tmp_path)]
    results = run_tasks(argv, envs, timeout=300, cwd=tmp_path)  # the trainers' nccl_trace_<job>/ goes there
    for i, r in enumerate(results):
        assert r.returncode == 0, f"task {i} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(ntasks)]


def gpu_problems(records: list[dict], own: dict[int, list[int]]) -> list[str]:
    """Every broken rule, one line each; `own`: the GPUs of each rank (its plan), first_part first."""
    problems = []
    node_of = {r["rank"]: r["node"] for r in records}
    owner = {(node_of[rank], g): rank for rank, gpus in own.items() for g in gpus}
    sequences: dict[tuple, dict[int, list[tuple[str, int | None]]]] = defaultdict(dict)
    pairs: dict[tuple, dict[int, int | None]] = defaultdict(dict)
    for r in records:
        rank, events = r["rank"], r["events"]
        sets = [i for i, e in enumerate(events) if e["kind"] == "set_device" and e["thread"] == "MainThread"]
        touches = [i for i, e in enumerate(events) if e["kind"] == "touch"]
        if touches and (not sets or sets[0] > touches[0]):
            first = events[touches[0]]
            problems.append(f"task {rank} uses cuda:{first['device']} ({first['what']}) before any "
                            "torch.cuda.set_device: its context lands on the current device, cuda:0 unless set")
        if sets and events[sets[0]]["device"] != own[rank][0]:
            problems.append(f"task {rank} set_device({events[sets[0]]['device']}), not its first part "
                            f"cuda:{own[rank][0]}")
        for gpu in sorted({e["device"] for e in events if e["kind"] == "touch"} - set(own[rank])):
            theirs = owner.get((r["node"], gpu))
            problems.append(f"task {rank} uses cuda:{gpu}, " + (f"task {theirs}'s GPU" if theirs is not None
                                                                 else "a GPU of no task"))
        for e in events:
            if e["kind"] != "collective" or e["backend"] != "nccl":
                continue
            where = f"{e['op']} on nccl group {e['group']} (task {rank})"
            if e.get("problem"):
                problems.append(f"{where}: {e['problem']}")
            elif not e["named"]:
                problems.append(f"{where} names no GPU: nccl picks cuda:{e['device']} by its guess")
            if "peer" in e:
                pairs[(tuple(e["group"]), min(rank, e["peer"]), max(rank, e["peer"]))][rank] = e["device"]
            else:
                sequences[tuple(e["group"])].setdefault(rank, []).append((e["op"], e["device"]))
    for group, per_rank in sequences.items():
        problems += communicator_problems(group, per_rank, node_of)
    for (group, low, high), devices in pairs.items():
        if node_of[low] == node_of[high] and devices.get(low) == devices.get(high) is not None:
            problems.append(f"send/recv between tasks {low} and {high} of node {node_of[low]} both on "
                            f"cuda:{devices[low]}: Duplicate GPU detected")
    return problems


def communicator_problems(group: tuple, per_rank: dict[int, list], node_of: dict[int, int]) -> list[str]:
    """nccl's per-group communicators: one per GPU a task uses, numbered in the order each task first uses it."""
    problems, numbers = [], {}
    for rank, seq in per_rank.items():
        first_use: dict = {}
        numbers[rank] = [first_use.setdefault(device, len(first_use)) for _, device in seq]
    missing = sorted(set(group) - set(per_rank))
    lengths = {rank: len(seq) for rank, seq in per_rank.items()}
    if missing or len(set(lengths.values())) > 1:
        problems.append(f"nccl group {list(group)}: collectives per task {lengths}" +
                        (f", none on tasks {missing}" if missing else "") + ": the others wait for ever")
    ranks = sorted(per_rank)
    for i in range(min(lengths.values())):
        comm = {rank: numbers[rank][i] for rank in ranks}
        if len(set(comm.values())) > 1:
            detail = ", ".join(f"task {rank} #{comm[rank]} (cuda:{per_rank[rank][i][1]})" for rank in ranks)
            problems.append(f"nccl group {list(group)}, collective {i} ({per_rank[ranks[0]][i][0]}): the tasks are "
                            f"in different communicators ({detail}): they wait for each other until the timeout")
            break
    communicators: dict[int, dict[int, int]] = defaultdict(dict)
    for rank in ranks:
        for (_, device), k in zip(per_rank[rank], numbers[rank]):
            communicators[k].setdefault(rank, device)
    for k, devices in communicators.items():
        seen: dict[tuple, int] = {}
        for rank, device in sorted(devices.items()):
            other = seen.setdefault((node_of[rank], device), rank)
            if other != rank:
                problems.append(f"nccl group {list(group)}, communicator #{k}: tasks {other} and {rank} of node "
                                f"{node_of[rank]} both on cuda:{device}: Duplicate GPU detected (ncclInvalidUsage)")
    return problems


def replica_gpus(ntasks: int, nodes: int, nb_part: int) -> dict[int, list[int]]:
    per_node = ntasks // nodes
    return {r: [(r % per_node) * nb_part + p for p in range(nb_part)] for r in range(ntasks)}


# ---- the trainers' CUDA branch ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tasks_per_node", [1, pytest.param(2, marks=pytest.mark.core), 4])
def test_replica_layout_keeps_each_task_on_its_gpus(tmp_path, tasks_per_node):
    """The page's layout on one 4-GPU node: nb_part 4, 2 and 1 (the page's 3 x 4 job runs 2 such tasks a node; every
    release of the matrix runs that one, and the stage layout's bound tasks below)."""
    nb_part = GPUS // tasks_per_node
    records = standin_run(tmp_path, "bench_ddp_transformer.py", [*SMALL, "--engine", "fairscale", "--nb-part",
                                                                  str(nb_part)], tasks_per_node)
    problems = gpu_problems(records, replica_gpus(tasks_per_node, 1, nb_part))
    assert not problems, "\n".join(problems)
    ddp = [e for r in records for e in r["events"] if e["kind"] == "ddp"]
    assert len(ddp) == tasks_per_node and all(e["device_ids"] is None for e in ddp)  # the page's DDP
    assert sorted(tuple(e["parameter_gpus"]) for e in ddp) == sorted(
        tuple(g) for g in replica_gpus(tasks_per_node, 1, nb_part).values())


def test_replica_layout_over_two_nodes(tmp_path):
    """2 nodes x 2 tasks: the same GPU indices on both nodes are different GPUs."""
    records = standin_run(tmp_path, "bench_ddp_transformer.py", [*SMALL, "--engine", "fairscale", "--nb-part", "2"],
                          4, nodes=2)
    problems = gpu_problems(records, replica_gpus(4, 2, 2))
    assert not problems, "\n".join(problems)


@pytest.mark.core
@pytest.mark.skipif(TORCH < (2, 4), reason="the stage layout needs torch.distributed.pipelining (torch >= 2.4)")
def test_stage_layout_keeps_each_task_on_its_gpu(tmp_path):
    """A task per GPU, pp 2 x dp 2 on one node. Below 2.8 gpipe: the stand-in's collectives really run on gloo, where
    the batched schedules of 2.4-2.6 wait forever (pytorch/pytorch#132644)."""
    schedule = "1f1b" if TORCH >= (2, 8) else "gpipe"
    records = standin_run(tmp_path, "bench_stage.py", [*SMALL, "--pp", "2", "--schedule", schedule], 4)
    problems = gpu_problems(records, {r: [r] for r in range(4)})
    assert not problems, "\n".join(problems)
    p2p = [e for r in records for e in r["events"] if e["kind"] == "collective" and "peer" in e]
    assert p2p, "the pipeline's sends and receives were not seen"


# ---- the checks themselves can fail ----------------------------------------------------------------------------
def record(rank: int, node: int, *events: dict) -> dict:
    return {"rank": rank, "node": node, "events": [dict(e, thread=e.get("thread", "MainThread")) for e in events]}


def nccl(op: str, device: int | None, named: bool = True, group: tuple = (0, 1)) -> dict:
    return {"kind": "collective", "op": op, "group": list(group), "backend": "nccl", "device": device, "named": named}


def test_checks_catch_a_barrier_on_a_guessed_gpu():
    """What a bare barrier did before any other collective (global rank % 4): task 1 on task 0's second GPU, then
    DDP on each task's first part: mismatched communicators."""
    records = [record(0, 0, {"kind": "set_device", "device": 0}, nccl("barrier", 0, named=False),
                      nccl("ddp.verify_params", 0), nccl("ddp.broadcast", 1)),
               record(1, 0, {"kind": "set_device", "device": 2}, nccl("barrier", 1, named=False),
                      {"kind": "touch", "device": 1, "what": "nccl barrier"},
                      nccl("ddp.verify_params", 2), nccl("ddp.broadcast", 3))]
    problems = "\n".join(gpu_problems(records, {0: [0, 1], 1: [2, 3]}))
    assert "barrier on nccl group [0, 1] (task 0) names no GPU" in problems
    assert "task 1 uses cuda:1, task 0's GPU" in problems
    assert "in different communicators" in problems


def test_checks_catch_two_tasks_on_one_gpu_and_a_late_set_device():
    records = [record(0, 0, {"kind": "touch", "device": 0, "what": "Tensor.to"}, {"kind": "set_device", "device": 0},
                      nccl("all_reduce", 0)),
               record(1, 0, {"kind": "set_device", "device": 1}, nccl("all_reduce", 0))]
    problems = "\n".join(gpu_problems(records, {0: [0], 1: [1]}))
    assert "task 0 uses cuda:0 (Tensor.to) before any torch.cuda.set_device" in problems
    assert "tasks 0 and 1 of node 0 both on cuda:0: Duplicate GPU detected" in problems
    # the same on two nodes is two GPUs
    records[1]["node"] = 1
    assert not [p for p in gpu_problems(records, {0: [0], 1: [0]}) if "Duplicate" in p]
