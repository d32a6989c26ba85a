"""A user's model through --model, planned once for the trainers and the checker: its description (kit.model.Model:
the layers measured by kit.own_model, cached by source and shapes, the kit's Transformer recognised) and its split
(Model.sizes, --split even|time|memory), said in one line that the checker prints and the trainer logs, so that what
the checker approves is what runs. torch is imported here only in model mode (kit.own_model, lazily): the checker's
plain path stays free of it. Owns: ModelPlan, described (where the model is measured: a bounded child for the checker, kit.measure_child),
plan_model, the checker's --model note, its memory estimate and fixes.
Imports: kit.arguments, kit.layer_memory, kit.measure_child, kit.memory, kit.model, kit.own_model, kit.plan.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

from kit.arguments import Training, model_args
from kit.layer_memory import estimate_peaks, one_stage_a_task
from kit.memory import GIB, PartMemory
from kit.model import Model, ModelError, default_sample
from kit.plan import split_contents


@dataclass
class ModelPlan:
    """The user's model as the trainers run it: its description and the split."""
    model: Model = field(repr=False)
    split: str  # --split
    sizes: list[int]  # layers per part

    @property
    def spec(self) -> str:
        return self.model.spec

    @property
    def names(self) -> list[str]:
        return self.model.names

    @property
    def flops_per_sample(self) -> float:
        return self.model.flops_per_sample

    @property
    def contents(self) -> list[str]:
        return split_contents(self.sizes)

    def text(self) -> str:
        """The split, as the checker prints it and the trainer logs it (tests compare the two)."""
        return (f"--model {self.spec}: {len(self.names)} layers, --split {self.split}, sizes {self.sizes}: "
                + " | ".join(f"part {p}: {c}" for p, c in enumerate(self.contents)))


@functools.lru_cache(maxsize=8)  # the checker asks for the split, then for the memory of the same line
def described(spec: str, sample: str, isolated: bool = True) -> Model:
    """The model measured (cached): in a bounded child (kit.measure_child: the checker, which must not run a model's
    code in its own process) or, `isolated=False`, here (the trainers, which run it anyway)."""
    if isolated:
        from kit.measure_child import describe_isolated
        return describe_isolated(spec, sample)
    from kit import own_model
    # a layer that refuses fake tensors is measured otherwise and said in one line by kit.own_model: torch's own
    # traceback of it (logged at ERROR by FakeTensorMode) would bury that line
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    return own_model.describe(spec, sample)


def plan_model(spec: str, sample: str, nb_part: int, split: str, micro: int, chunks: int,
               precision: str = "fp32", checkpointing: bool = False, layout: str = "replica",
               isolated: bool = True) -> ModelPlan:
    """Describe the model (described: measured once, cached) and split it over nb_part (Model.sizes):
    kit.model.ModelError, one line naming the value and its fix, where the model does not load, is not a sequence,
    does not take the sample, cannot be measured, has fewer layers than parts, or is split where the `layout`'s
    trainer cannot run it (Model.refusal: weights tied across parts, a stage without parameters)."""
    model = described(spec, sample, isolated)
    sizes = model.sizes(nb_part, split, micro, chunks, precision, checkpointing)
    if model.refusal(sizes, layout) is not None:
        others = {k: v for k, v in model.splits(nb_part, micro, chunks, precision, checkpointing).items() if k != split}
        raise ModelError(model.refusal(sizes, layout, others))
    return ModelPlan(model, split, sizes)


def line_plan(t: Training, nb_part: int, cpu: bool, isolated: bool = True) -> ModelPlan:
    """The plan of a trainer line with --model (nb_part: one replica's parts, or one pipeline's stages); measured in
    a bounded child unless `isolated` is False (the trainers)."""
    model = model_args(t, cpu)
    sample = t.sample or default_sample(model["batch_size"], model["seq_len"])
    return plan_model(t.model_spec, sample, nb_part, t.split, max(1, model["batch_size"] // model["chunks"]),
                      model["chunks"], t.precision, t.activation_checkpointing, t.layout, isolated)


def checker_note(t: Training, nb_part: int, cpu: bool) -> tuple[ModelPlan, str]:
    """The checker's plan of a line with --model: the split the trainer will run, and the note that says it.
    ModelError as plan_model."""
    plan = line_plan(t, nb_part, cpu)
    return plan, plan.text()


def own_memory(t: Training, nb_part: int, replicas: int, arch: str, cpu: bool = False,
               isolated: bool = True) -> list[PartMemory]:
    """The per-GPU peak of each part (stage) of the line's --model split, with kit.memory's terms
    (kit.layer_memory.estimate_peaks; the kit's own Transformer is kit.memory's estimate itself)."""
    one_stage_a_task(t)
    plan = line_plan(t, nb_part, cpu, isolated)
    model = model_args(t, cpu)
    return estimate_peaks(plan.model.costs, plan.sizes, max(1, model["batch_size"] // model["chunks"]), model["chunks"],
                          t.precision, replicas, t.zero, t.activation_checkpointing, t.layout, arch, t.schedule,
                          kit_model=plan.model.kit)


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
        try:
            worst = max(part.total for part in own_memory(alt, nb_part, replicas, arch))
        except ModelError:  # a split the trainer would refuse (Model.refusal) is no fix
            continue
        if worst < 0.95 * now:
            out.append(f"{text}: {worst / GIB:.1f} GiB" + (" (fits)" if worst / GIB <= gib else ""))
    return out + ["more GPUs per replica (nb_part), or finer layers for the split to balance"]
