"""The plan the trainers run: the layer split over nb_part (the page's even split when nlayers % nb_part == 0),
and this task's GPUs (first_part ... last_part, or visible GPU 0 when Slurm binds GPUs per task).
Owns: part_sizes/split_layers (and balanced_sizes, layer_split for a user's model: --model, --split) and
plan_task. Imports: kit.arguments, kit.findings.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

from kit.arguments import CPU_NB_PART
from kit.findings import Findings


def part_sizes(nlayers: int, nb_part: int) -> list[int]:
    """Layers per part: balanced, the extra ones on the *last* parts (part 0 already holds the Encoder's
    embedding table, the largest single tensor of the model)."""
    if nb_part < 1 or nlayers < 0:
        raise ValueError(f"need nb_part >= 1 and nlayers >= 0, got nb_part={nb_part}, nlayers={nlayers}")
    base, extra = divmod(nlayers, nb_part)
    return [base + (1 if p >= nb_part - extra else 0) for p in range(nb_part)]


def balanced_sizes(costs: Sequence[float], nb_part: int) -> list[int]:
    """Layers per part for contiguous layers of the given costs (time, or bytes): the split whose costliest part is
    the cheapest of all (the linear partition problem, solved exactly by dynamic programming in O(n^2 nb_part)).
    Every part gets one layer at least; among equal optima the one whose parts are most even in count is kept, so
    equal costs give part_sizes' split. A user's model through `--model` (kit.own_model)."""
    n = len(costs)
    if nb_part < 1 or n < nb_part or any(c < 0 for c in costs):
        raise ValueError(f"need 1 <= nb_part <= {n} layers and costs >= 0, got nb_part={nb_part}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    even = part_sizes(n, nb_part)
    # best[k][i]: (the costliest part, the distance to the even split) for layers [0, i) in k parts
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(nb_part + 1)]
    cut = [[0] * (n + 1) for _ in range(nb_part + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, nb_part + 1):
        for i in range(k, n - (nb_part - k) + 1):
            for j in range(k - 1, i):
                worst, spread = best[k - 1][j]
                cand = (max(worst, prefix[i] - prefix[j]), spread + abs(i - j - even[k - 1]))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    sizes, i = [], n
    for k in range(nb_part, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def layer_split(nlayers: int, nb_part: int, costs: Sequence[float] | None = None, ends: bool = False) -> list[int]:
    """Layers per part of a sequence of `nlayers` layers (a user's --model): the one split the trainers run and the
    checker prints. No `costs`: the page's even split (part_sizes); with `ends` (the kit's own Transformer given
    through --model: its Encoder first, its Decoder last) the even split is today's plan exactly, the Encoder with
    the first part, the Decoder with the last and the blocks between by part_sizes. `costs` (a cost per layer: FLOPs
    for --split time, bytes for --split memory): balanced_sizes."""
    if costs is not None:
        return balanced_sizes(list(costs), nb_part)
    if not ends:
        return part_sizes(nlayers, nb_part)
    sizes = part_sizes(nlayers - 2, nb_part)
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def split_contents(sizes: Sequence[int]) -> list[str]:
    """What each part of a --model split holds, for the checker's table and the trainer's line: 'layers 0-3'."""
    out, start = [], 0
    for n in sizes:
        out.append(f"layer {start}" if n == 1 else f"layers {start}-{start + n - 1}" if n else "(nothing)")
        start += n
    return out


def split_layers(nlayers: int, nb_part: int) -> list[int]:
    """The part (0 .. nb_part-1) of each of the `nlayers` Layer blocks: contiguous, every layer once.

    Identical to the page's loop whenever nlayers % nb_part == 0. With nlayers < nb_part some parts get no
    Layer (only the Encoder or Decoder, or nothing): defined, but warned about, and the checker makes it an error.
    """
    sizes = part_sizes(nlayers, nb_part)
    if nlayers < nb_part:
        warnings.warn(f"nlayers ({nlayers}) < nb_part ({nb_part}): {nb_part - nlayers} part(s) get no Layer block",
                      stacklevel=2)
    return [p for p, n in enumerate(sizes) for _ in range(n)]


def part_contents(nlayers: int, nb_part: int) -> list[str]:
    """What each part holds, for tables: 'Encoder + Layer 0-3', 'Layer 4-7 + Decoder'."""
    sizes, start, out = part_sizes(nlayers, nb_part), 0, []
    for p, n in enumerate(sizes):
        items = ["Encoder"] if p == 0 else []
        if n:
            items.append(f"Layer {start}" if n == 1 else f"Layer {start}-{start + n - 1}")
        if p == nb_part - 1:
            items.append("Decoder")
        out.append(" + ".join(items) or "(nothing)")
        start += n
    return out


@dataclass
class TaskPlan:
    """Where one task (one model replica) puts its parts."""
    rank: int
    node: int
    local_rank: int
    tasks_on_node: int
    nb_part: int
    devices: list[int]  # index passed to .to(cuda:i) for each part: first_part .. last_part (empty on CPU)
    node_gpus: list[str]  # the node's GPUs behind those indices, as Slurm and nvidia-smi number them
    bound: bool  # Slurm showed this task only its own GPUs
    nlayers: int
    cpu: bool = False
    visible: int = 0  # GPUs this task sees (CUDA_VISIBLE_DEVICES)
    own: list[str] | None = None  # a --model's parts (split_contents), instead of the kit's Encoder/Layer/Decoder

    @property
    def first_part(self) -> int:
        return self.devices[0] if self.devices else 0

    @property
    def last_part(self) -> int:
        return self.devices[-1] if self.devices else 0

    def device(self, part: int) -> str:
        return "cpu" if self.cpu else f"cuda:{self.devices[part]}"

    @property
    def contents(self) -> list[str]:
        if self.own is not None:
            return self.own
        return part_contents(self.nlayers, self.nb_part) if self.nb_part else []


def page_indexing(local_rank: int, tasks_on_node: int, visible: int) -> tuple[int, int, int]:
    """What the page's own code computes: (nb_part, first_part, last_part) from device_count() // tasks."""
    nb_part = visible // tasks_on_node
    first = local_rank * nb_part
    return nb_part, first, first + nb_part - 1


def plan_task(rank: int, node: int, local_rank: int, tasks_on_node: int, visible: Sequence[str],
              gpus_on_node: int | None, nlayers: int, nb_part: int | None = None,
              findings: Findings | None = None, devices: Sequence[int] | None = None) -> TaskPlan:
    """Plan one task from what it sees.

    visible      the GPU ids this process can use, in CUDA order (CUDA_VISIBLE_DEVICES); [] means CPU only
    gpus_on_node GPUs Slurm gave the step on this node (SLURM_GPUS_ON_NODE); None when unknown (torchrun):
                 when it exceeds what the task sees, Slurm bound GPUs per task and the plan starts at index 0.
    nb_part      an explicit --nb-part, else derived as on the page.
    devices      an explicit --devices: the visible GPU index of each part (0,0 puts two parts on one GPU, for a
                 one-GPU check of nb_part 2); None: the page's indexing.
    """
    findings = Findings() if findings is None else findings
    where = f"task {rank} (node {node}, local rank {local_rank})"
    if not visible:
        n = nb_part or CPU_NB_PART
        return TaskPlan(rank, node, local_rank, tasks_on_node, n, [], [], False, nlayers, cpu=True)
    bound = gpus_on_node is not None and len(visible) < gpus_on_node
    if bound:
        n = nb_part or len(visible)
        first = 0
    else:
        n = nb_part or len(visible) // tasks_on_node
        first = local_rank * n
    if n < 1:
        findings.error("more-tasks-than-gpus",
                       f"{where}: {tasks_on_node} tasks share {len(visible)} visible GPU(s): nb_part = "
                       f"{len(visible)} // {tasks_on_node} = 0; use --ntasks-per-node <= {len(visible)}")
        return TaskPlan(rank, node, local_rank, tasks_on_node, 0, [], [], bound, nlayers, visible=len(visible))
    if devices:
        devices, n = explicit_devices(where, devices, nb_part, findings)
    else:
        devices = list(range(first, first + n))
    past = [d for d in devices if d >= len(visible)]
    if past:
        findings.error("gpu-index-past-visible",
                       f"{where} would use GPU index {past[0]}"
                       + (f" (and {len(past) - 1} more)" if len(past) > 1 else "")
                       + f" but sees only {len(visible)} GPU(s), indices 0-{len(visible) - 1} "
                       f"(CUDA_VISIBLE_DEVICES={','.join(visible)}); "
                       + (f"with per-task binding use --nb-part <= {len(visible)}" if bound
                          else f"use --nb-part <= {len(visible) // tasks_on_node}"))
        devices = [d for d in devices if d < len(visible)]
    return TaskPlan(rank, node, local_rank, tasks_on_node, n, devices, [visible[d] for d in devices], bound,
                    nlayers, visible=len(visible))


def explicit_devices(where: str, devices: Sequence[int], nb_part: int | None,
                     findings: Findings) -> tuple[list[int], int]:
    """--devices: one visible GPU index per part. Parts may share a GPU (then they run one after the other and
    their memory adds up): that is for checking nb_part > 1 on a one-GPU node, not for speed."""
    devices = list(devices)
    n = nb_part or len(devices)
    if len(devices) != n:
        findings.error("devices-count", f"{where}: --devices {','.join(map(str, devices))} lists {len(devices)} "
                       f"GPU(s) for nb_part {n}: give one index per part, e.g. --devices "
                       f"{','.join(str(i % max(len(devices), 1)) for i in range(n))}")
        devices = (devices * n)[:n]
    shared = sorted({d for d in devices if devices.count(d) > 1})
    if shared:
        findings.warn("parts-share-gpu", f"{where}: --devices {','.join(map(str, devices))} puts several parts on "
                      f"GPU {','.join(map(str, shared))}: they run one after the other and their memory adds up "
                      f"(a one-GPU check of the pipeline, not a speed figure)")
    return devices, n
