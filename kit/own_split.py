"""A user's model through --model, planned once for the trainers and the checker: its layers measured
(kit.own_model.layer_costs, cached by source and shapes) and cut by the one split function (kit.plan.layer_split,
--split even|time|memory), said in one line that the checker prints and the trainer logs, so that what the checker
approves is what runs. torch is imported here only in model mode (kit.own_model, lazily): the checker's plain path
stays free of it. Owns: ModelPlan, plan_model, the checker's --model note, its memory estimate and fixes. Imports:
kit.arguments, kit.layer_memory, kit.memory, kit.own_model, kit.plan, kit.trainer_checks.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Sequence

from kit.arguments import Training, model_args
from kit.layer_memory import estimate_peaks
from kit.memory import GIB, NotEstimated, PartMemory
from kit.plan import layer_split, split_contents
from kit.trainer_checks import stages_per_rank


@dataclass
class ModelPlan:
    """The user's model as the trainers run it: its layers' names, the split, and the figures it came from."""
    spec: str  # --model
    sample: str  # --sample, or the default BxS
    split: str  # --split
    names: list[str]  # '0: Conv2d' ... (kit.own_model.LayerCost.name)
    sizes: list[int]  # layers per part
    kit_ends: bool  # the kit's own Encoder first and Decoder last: the even split is today's plan
    flops_per_sample: float  # forward + backward, all layers (kit.own_model's FLOP counter)
    costs: list = field(repr=False, default_factory=list)  # kit.own_model.LayerCost per layer
    kit_model: dict | None = None  # the kit's own Transformer's arguments (kit.own_model.kit_model), else None

    @property
    def contents(self) -> list[str]:
        return split_contents(self.sizes)

    def text(self) -> str:
        """The split, as the checker prints it and the trainer logs it (tests compare the two)."""
        return (f"--model {self.spec}: {len(self.names)} layers, --split {self.split}, sizes {self.sizes}: "
                + " | ".join(f"part {p}: {c}" for p, c in enumerate(self.contents)))


def default_sample(batch_size: int, seq_len: int) -> str:
    """--sample where the line gives none: token ids of the kit's batch and review length."""
    return f"{batch_size}x{seq_len}"


def is_token_ids(sample: str) -> bool:
    """--sample BxS: a shape of token ids (the kit's data), not FILE.py:function."""
    return re.fullmatch(r"\d+x\d+", sample) is not None


def _kit_ends(spec: str) -> bool:
    """Whether the user's sequence is the kit's own Transformer: kit.train.transformer's Encoder first and Decoder
    last, the classes bench_ddp_transformer.py shows (built on the meta device: no memory; the checker's path and the
    trainers' see the same classes)."""
    from kit import own_model
    layers, _ = own_model.build_layers(spec)
    first, last = type(layers[0]), type(layers[-1])
    return (len(layers) >= 2 and (first.__name__, last.__name__) == ("Encoder", "Decoder")
            and first.__module__ == last.__module__ == "kit.train.transformer")


def split_costs(costs: Sequence, split: str, micro: int, chunks: int, precision: str) -> list[float] | None:
    """The cost per layer that --split balances: None (even), FLOPs (time), or each layer's first-order peak
    with `chunks` micro-batches of `micro` samples in flight (memory; kit.own_model.part_peak)."""
    from kit import own_model
    if split == "time":
        return [c.flops for c in costs]
    if split == "memory":
        return [own_model.part_peak([c], micro, chunks, precision) for c in costs]
    return None


@functools.lru_cache(maxsize=8)  # the checker asks for the split, then for the memory of the same line
def plan_model(spec: str, sample: str, nb_part: int, split: str, micro: int, chunks: int,
               precision: str = "fp32") -> ModelPlan:
    """Measure the model (cached) and split it over nb_part: kit.own_model.ModelError, one line naming the value
    and its fix, where the model does not load, is not a sequence, does not take the sample, or has fewer layers
    than parts."""
    from kit import own_model
    # a layer that refuses fake tensors is measured otherwise and said in one line by kit.own_model: torch's own
    # traceback of it (logged at ERROR by FakeTensorMode) would bury that line
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    costs = own_model.layer_costs(spec, sample)
    if nb_part > len(costs):
        raise own_model.ModelError(
            f"--model {spec} has {len(costs)} layer(s), fewer than the {nb_part} parts of the split: each part needs "
            f"one layer at least; use {len(costs)} parts or fewer (--nb-part, or --pp in the stage layout), or "
            "return the model as finer layers")
    ends = len(costs) - 2 >= nb_part and _kit_ends(spec)  # else part_sizes would leave a part empty
    sizes = layer_split(len(costs), nb_part, split_costs(costs, split, micro, chunks, precision), ends=ends)
    return ModelPlan(spec, sample, split, [c.name for c in costs], sizes, ends, sum(c.flops for c in costs), costs,
                     own_model.kit_model(spec, sample) if ends else None)


def line_plan(t: Training, nb_part: int, cpu: bool) -> ModelPlan:
    """The plan of a trainer line with --model (nb_part: one replica's parts, or one pipeline's stages)."""
    model = model_args(t, cpu)
    sample = t.sample or default_sample(model["batch_size"], model["seq_len"])
    return plan_model(t.model_spec, sample, nb_part, t.split, max(1, model["batch_size"] // model["chunks"]),
                      model["chunks"], t.precision)


def checker_note(t: Training, nb_part: int, cpu: bool) -> tuple[ModelPlan, str]:
    """The checker's plan of a line with --model: the split the trainer will run, and the note that says it.
    ModelError as plan_model."""
    plan = line_plan(t, nb_part, cpu)
    return plan, plan.text()


def own_memory(t: Training, nb_part: int, replicas: int, arch: str, cpu: bool = False) -> list[PartMemory]:
    """The per-GPU peak of each part (stage) of the line's --model split, with kit.memory's terms
    (kit.layer_memory.estimate_peaks; the kit's own Transformer is kit.memory's estimate itself)."""
    if t.layout == "stage" and stages_per_rank(t.schedule, t.virtual_stages) > 1:
        raise NotEstimated(f"--schedule {t.schedule} puts {t.virtual_stages} stages of a --model on each task, which "
                           "its estimate does not model yet (one stage a task: --schedule gpipe or 1f1b)")
    plan = line_plan(t, nb_part, cpu)
    model = model_args(t, cpu)
    return estimate_peaks(plan.costs, plan.sizes, max(1, model["batch_size"] // model["chunks"]), model["chunks"],
                          t.precision, replicas, t.zero, t.activation_checkpointing, t.layout, arch, t.schedule,
                          kit_model=plan.kit_model)


def own_fixes(t: Training, nb_part: int, replicas: int, arch: str, v100: bool, gib: float) -> list[str]:
    """What may make a --model split fit on a GPU of `gib` GiB, each with its own new estimate of the worst GPU
    (re-estimated, not scaled); a change that saves under 5 % is left out."""
    tries = []
    if t.split != "memory":
        tries.append(("--split memory (balance the parts' peaks)", dataclasses.replace(t, split="memory")))
    if t.precision == "fp32":
        low = "fp16" if v100 else "bf16"
        tries.append((f"--precision {low}", dataclasses.replace(t, precision=low)))
    if replicas > 1 and not t.zero:
        tries.append(("--zero (AdamW's states shared by the replicas)", dataclasses.replace(t, zero=True)))
    model = model_args(t)
    if model["batch_size"] >= 2 * model["chunks"]:  # (--sample gives the shape; --batch-size the batch)
        half = model["batch_size"] // 2
        tries.append((f"--batch-size {half}", dataclasses.replace(t, batch_size=half)))
    now, out = max(part.total for part in own_memory(t, nb_part, replicas, arch)), []
    for text, alt in tries:
        worst = max(part.total for part in own_memory(alt, nb_part, replicas, arch))
        if worst < 0.95 * now:
            out.append(f"{text}: {worst / GIB:.1f} GiB" + (" (fits)" if worst / GIB <= gib else ""))
    return out + ["more GPUs per replica (nb_part), or finer layers for the split to balance"]
