"""A model as the kit plans it, whoever wrote its layers: the one place that recognises the kit's own Transformer
(KIT_CLASSES), says a model's layers, its class count and each layer's measured costs (LayerCost), and cuts it into
nb_part parts for every --split (even, time, memory; with or without --activation-checkpointing). The trainers
(kit.train.own), the checker (kit.own_split), --advise (kit.advise.advise_layers) and python -m kit.own_model all
ask Model.sizes, so the split one of them shows is the split the others run. No torch here: kit.own_model builds
and measures the layers, this module reads their classes and attributes (the checker's path stays free of torch).
Owns: KIT_CLASSES, ModelError, LayerCost (and the check of one read back: costs_from_json), Model (its splits, which
layers checkpointing recomputes, its tied weights and the splits the trainers refuse: Model.refusal), recognise,
what --sample means (default_sample, is_token_ids).
Imports: kit.arguments, kit.layer_memory, kit.plan.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

from kit.arguments import PRECISIONS, SPLITS
from kit.layer_memory import estimate_peaks
from kit.plan import layer_split, split_contents

# Where the kit's own Transformer's classes are defined, by class name: a --model whose first layer is the kit's
# Encoder and whose last is its Decoder gets the page's even split (the Encoder with the first part, the Decoder with
# the last); with the kit's Layers between them, all of one configuration, kit.memory's own estimate. When a class
# moves to another module, this is the one line to change.
KIT_CLASSES = {"Encoder": "kit.train.transformer", "Decoder": "kit.train.transformer",
               "TransformerEncoderLayer": "torch.nn.modules.transformer", "CheckpointedLayer": "kit.train.transformer"}

KIT_LAYERS = ("TransformerEncoderLayer", "CheckpointedLayer")  # the kit's Layer block, plain or checkpointed


class ModelError(ValueError):
    """The model, the sample or a layer refused: one line that names it and the fix."""


@dataclass
class LayerCost:
    """One layer, per sample of the batch (activations and FLOPs grow with the batch; parameters do not), as
    kit.own_model measures it."""
    name: str
    params: int  # elements
    param_bytes: int
    flops: float  # forward + backward, per sample
    out_bytes: float  # the output, per sample: what a part boundary sends
    saved: dict[str, float] = field(default_factory=dict)  # bytes saved for backward per sample, by precision
    saved_fixed: dict[str, float] = field(default_factory=dict)  # and per micro-batch whatever its size (autocast's
    # low-precision copies of the weights): the two from runs at the sample's batch and at twice it
    saved_checkpointed: float = 0.0  # with activation checkpointing: the layer's input alone, per sample
    how: str = "fake"  # "fake": fake tensors; "cpu": a real forward on a batch of one (fake tensors failed);
    # "fake, 2-8 steps carried to N": a GRU or RNN measured on a few steps of its sequence (kit.own_model)
    tensors: list[int] = field(default_factory=list)  # elements of each parameter (ZeRO's partition, AdamW's step)
    buffer_bytes: int = 0  # buffers (BatchNorm's running statistics), fp32 beside the weights
    input_saved: dict[str, float] = field(default_factory=dict)  # of `saved`, the layer's input itself, per sample:
    # on the first part that is a view of the batch, already counted there
    output_saved: dict[str, float] = field(default_factory=dict)  # and its output itself (a ReLU's), per sample:
    # the same storage as the next layer's input, when that one saves it too
    out_by_precision: dict[str, float] = field(default_factory=dict)  # the output per sample in each precision (a
    # low-precision one under autocast): the next layer's input, what checkpointing keeps of it
    out_shape: list[int] = field(default_factory=list)  # the output's shape per sample (a stage's send, the classes)
    flops_missed: list[str] = field(default_factory=list)  # ops of the layer FlopCounterMode has no formula for and
    # kit.own_model none either: its `flops` leave them out (said, and --split time refused on them)


# What each LayerCost field holds when it is read back (a cache entry, the measuring child's answer): a number, a
# number by precision, a list of whole numbers or of names. Anything else, and any number that is not finite and
# non-negative, is a damaged entry.
_NUMBERS = ("params", "param_bytes", "flops", "out_bytes", "saved_checkpointed", "buffer_bytes")
_BY_PRECISION = ("saved", "saved_fixed", "input_saved", "output_saved", "out_by_precision")
_WHOLE_LISTS = ("tensors", "out_shape")


def _fine(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _cost_from_json(raw: object) -> LayerCost:
    """One LayerCost from its JSON form, every field there and of its kind: ValueError naming the first that is
    not."""
    names = {f.name for f in dataclasses.fields(LayerCost)}
    if not isinstance(raw, dict) or set(raw) != names:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"a layer's fields are {got}, not {sorted(names)}")
    bad = [k for k in _NUMBERS if not _fine(raw[k])]
    bad += [k for k in _BY_PRECISION if not (isinstance(raw[k], dict) and set(raw[k]) == set(PRECISIONS)
                                             and all(_fine(v) for v in raw[k].values()))]
    bad += [k for k in _WHOLE_LISTS if not (isinstance(raw[k], list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw[k]))]
    bad += [k for k in ("name", "how") if not isinstance(raw[k], str)]
    bad += [] if isinstance(raw["flops_missed"], list) and all(isinstance(v, str) for v in raw["flops_missed"]) \
        else ["flops_missed"]
    if bad:
        raise ValueError(f"layer {str(raw.get('name'))[:40]!r}: {', '.join(bad)} not finite non-negative numbers "
                         "of the right kind")
    return LayerCost(**raw)


def costs_from_json(raw: object, nlayers: int | None = None) -> list[LayerCost]:
    """The layers' costs read back from JSON (kit.own_model's cache, the measuring child's answer), each field
    checked (_cost_from_json), `nlayers` of them where it is known: ValueError on any doubt, and the caller measures
    again or refuses."""
    if not isinstance(raw, list) or not raw or (nlayers is not None and len(raw) != nlayers):
        raise ValueError(f"{len(raw) if isinstance(raw, list) else type(raw).__name__} layer(s) where the model has "
                         f"{nlayers}")
    return [_cost_from_json(c) for c in raw]


def default_sample(batch_size: int, seq_len: int) -> str:
    """--sample where the line gives none: token ids of the kit's batch and review length."""
    return f"{batch_size}x{seq_len}"


def is_token_ids(sample: str) -> bool:
    """--sample BxS: a shape of token ids (the kit's data), not FILE.py:function."""
    return re.fullmatch(r"\d+x\d+", sample) is not None


def is_kit_class(layer: object, name: str) -> bool:
    """Whether `layer` is an instance of the kit's class `name` (KIT_CLASSES), by its class's name and module (the
    module found under a package too: copy.kit.train.transformer)."""
    cls, home = type(layer), KIT_CLASSES[name]
    return cls.__name__ == name and (cls.__module__ == home or cls.__module__.endswith("." + home))


def recognise(layers: Sequence[object], sample_shape: Sequence[int], sample_float: bool) -> tuple[bool, dict | None]:
    """(ends, kit) of a sequence of layers built by kit.own_model: `ends`, the first layer the kit's Encoder and the
    last its Decoder; `kit`, the kit's own Transformer's arguments (kit.memory's model dict less the batch) when the
    layers between are the kit's Layers, all of one configuration, and the sample token ids (batch x seq_len), else
    None. The layers are read by their attributes, as the kit builds them."""
    ends = len(layers) >= 2 and is_kit_class(layers[0], "Encoder") and is_kit_class(layers[-1], "Decoder")
    blocks = list(layers[1:-1])
    if not ends or not blocks or not all(any(is_kit_class(b, k) for k in KIT_LAYERS) for b in blocks):
        return ends, None
    enc, head, first = layers[0], layers[-1].head, blocks[0]
    d = enc.embedding.embedding_dim
    model = dict(nlayers=len(blocks), d_model=d, n_head=first.self_attn.num_heads,
                 d_hid=first.linear1.out_features, seq_len=sample_shape[-1], vocab_size=enc.embedding.num_embeddings,
                 dropout=enc.dropout.p)
    same = all(b.self_attn.embed_dim == d and b.self_attn.num_heads == model["n_head"] and b.self_attn.batch_first
               and b.linear1.out_features == model["d_hid"] and b.dropout.p == model["dropout"]
               and not b.norm_first for b in blocks)
    if (not same or len(sample_shape) != 2 or sample_float or head[0].in_features != d
            or head[0].out_features != model["d_hid"] or head[2].out_features != 2):
        return ends, None
    return ends, model


def part_peak(costs: Sequence[LayerCost], micro: int, alive: int, precision: str = "fp32",
              checkpointing: bool = False, loss: bool = True) -> float:
    """The peak of a GPU holding `costs` alone, with `alive` micro-batches of `micro` samples in flight (GPipe:
    all of them): kit.layer_memory's estimate (weights, AdamW, gradients, DDP's bucket, the micro-batches' saved
    tensors, precision, checkpointing, the gradients in flight, AdamW's step, the loss on the output where `loss`:
    the model's last layer), without the allowance. The cost per layer the split by memory balances."""
    return float(estimate_peaks(costs, [len(costs)], micro, alive, precision, checkpointing=checkpointing,
                                loss=loss)[0].peak)


@dataclass
class Model:
    """A sequence of layers as the kit plans it: --model's (or the kit's own Transformer given through it), measured
    on --sample. Its splits are the one definition the trainers run and every tool shows."""
    spec: str  # --model
    sample: str  # --sample
    costs: list[LayerCost] = field(repr=False)
    ends: bool = False  # the kit's Encoder first and its Decoder last (recognise)
    kit: dict | None = None  # the kit's whole Transformer: its arguments (kit.memory's estimate applies to it)
    shared: list[tuple[int, int, str]] = field(default_factory=list)  # tied weights: (the layer that owns the
    # parameter, a later layer that uses the same Parameter object, its name in the first), counted in the first only

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.costs]

    @property
    def nlayers(self) -> int:
        return len(self.costs)

    @property
    def flops_per_sample(self) -> float:
        """Forward and backward, all layers (kit.own_model's FLOP counter)."""
        return sum(c.flops for c in self.costs)

    @property
    def classes(self) -> int | None:
        """The classes the model scores: its last layer's output per sample where that is one number of logits."""
        shape = self.costs[-1].out_shape if self.costs else []
        return shape[0] if len(shape) == 1 else None

    def flops_missed(self) -> str:
        """'' where every layer's FLOPs are counted, else which are not (the first layer and its ops)."""
        missed = [c for c in self.costs if c.flops_missed]
        return "" if not missed else (f"FLOPs not counted in {len(missed)} layer(s) ({missed[0].name}: "
                                      f"{', '.join(missed[0].flops_missed)})")

    def recomputed(self) -> list[bool]:
        """Which layers --activation-checkpointing recomputes in the backward: every one, but for the kit's Encoder
        and Decoder, which the kit's own model never checkpoints (its Layer blocks only)."""
        return [not (self.ends and i in (0, self.nlayers - 1)) for i in range(self.nlayers)]

    def layer_costs(self, split: str, micro: int = 1, chunks: int = 1, precision: str = "fp32",
                    checkpointing: bool = False, times: Sequence[float] | None = None) -> list[float] | None:
        """The cost per layer that --split balances: None for even, the FLOPs (or the measured `times`) for time,
        for memory each layer's peak alone with `chunks` micro-batches of `micro` samples in flight, in that
        precision, recomputed where --activation-checkpointing recomputes it (part_peak)."""
        if split == "even":
            return None
        if split == "time":
            if times:
                return list(times)
            missed = self.flops_missed()
            if missed:
                raise ModelError(f"--split time balances the layers' FLOPs, but {missed}: use --split even or memory, "
                                 f"or time the layers (python -m kit.own_model --model {self.spec} --time-layers, "
                                 "where the job runs)")
            return [c.flops for c in self.costs]
        if split == "memory":
            return [part_peak([c], micro, chunks, precision, checkpointing and again, loss=i == self.nlayers - 1)
                    for i, (c, again) in enumerate(zip(self.costs, self.recomputed()))]
        raise ModelError(f"--split {split!r} is not one of {', '.join(SPLITS)}")

    def sizes(self, nb_part: int, split: str = "even", micro: int = 1, chunks: int = 1, precision: str = "fp32",
              checkpointing: bool = False, times: Sequence[float] | None = None) -> list[int]:
        """Layers per part of the split (kit.plan.layer_split): the page's even split (the kit's Encoder with the
        first part and its Decoder with the last, where there are layers enough between them for every part), or
        the one balanced by layer_costs. ModelError where the model has fewer layers than parts."""
        if not 1 <= nb_part <= self.nlayers:
            raise ModelError(
                f"--model {self.spec} has {self.nlayers} layer(s), fewer than the {nb_part} parts of the split: each "
                f"part needs one layer at least; use {self.nlayers} parts or fewer (--nb-part, or --pp in the stage "
                "layout), or return the model as finer layers")
        costs = self.layer_costs(split, micro, chunks, precision, checkpointing, times)
        return layer_split(self.nlayers, nb_part, costs, ends=self.ends and self.nlayers - 2 >= nb_part)

    def refusal(self, sizes: Sequence[int], layout: str, others: dict[str, list[int]] | None = None) -> str | None:
        """One line where the trainers cannot run this split as written, with the fix, else None: a weight tied
        across two parts (each part would train its own copy: untied in silence), or, in the stage layout, a stage
        without parameters (each stage has its own AdamW and DDP, which refuse an empty parameter list). `others`:
        the other splits' sizes (Model.splits), one of which may be the fix."""
        part = [p for p, n in enumerate(sizes) for _ in range(n)]
        names, contents = self.names, split_contents(sizes)
        fine = [k for k, alt in (others or {}).items() if self.refusal(alt, layout) is None]
        another = f"--split {fine[0]} ({list(others[fine[0]])}), " if fine else ""
        for a, b, param in self.shared:
            if part[a] != part[b]:
                return (f"--model {self.spec}: layers {names[a]!r} and {names[b]!r} share the parameter {param} (tied "
                        f"weights), and the split puts them on parts {part[a]} and {part[b]}, which would each train "
                        f"a copy of it: untie them in your model (Hugging Face: tie_word_embeddings=False), or give "
                        f"{another}a split that keeps layers {a}-{b} on one part"
                        + (" (here the whole model: one part)" if (a, b) == (0, self.nlayers - 1) else ""))
        empty = [p for p in range(len(sizes)) if layout == "stage"
                 and not any(c.params for c in self.costs[sum(sizes[:p]):sum(sizes[:p + 1])])]
        if empty:
            p = empty[0]
            held = ", ".join(n.split(": ", 1)[-1] for n in names[sum(sizes[:p]):sum(sizes[:p + 1])])
            return (f"--model {self.spec}: stage {p} ({contents[p]}: {held}) has no parameter to train, and each "
                    f"stage trains with its own optimizer and DDP: use {another}fewer stages (--pp), or return "
                    "those layers inside the layer before them")
        return None

    def splits(self, nb_part: int, micro: int = 1, chunks: int = 1, precision: str = "fp32",
               checkpointing: bool = False, times: Sequence[float] | None = None) -> dict[str, list[int]]:
        """Every --split's sizes, by name (not time where FLOPs are not counted and no times are given)."""
        return {split: self.sizes(nb_part, split, micro, chunks, precision, checkpointing, times)
                for split in SPLITS if split != "time" or times or not self.flops_missed()}

