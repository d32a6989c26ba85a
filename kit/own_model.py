"""Bring your own model (issue 34, first part): the user's layers named once, `--model FILE.py:function` (or
`module:function`) returning an nn.Sequential or a list of modules, a sample batch (`--sample FILE.py:function`, or
a shape of token ids such as 32x128), and each layer measured without a GPU, in seconds, on a login node:

    python -m kit.own_model --model my_model.py:layers --sample 32x128 --nb-part 4

The layers are built on the meta device (no memory) and run under fake tensors on the CPU (no data, no compute):
one forward and backward per layer and precision gives its parameters, the bytes autograd saves for the backward
(fp32, and under bf16 or fp16 autocast), its FLOPs (torch.utils.flop_counter, with formulas for the CPU's fused RNN
and attention kernels it lacks), and the bytes and shape of its output, which is what a part boundary sends; a layer
working in place gets its input as the model gives it (not a leaf). A layer that cannot run under fake tensors
(data-dependent control flow) is built alone for real and measured by a CPU forward on batches of one and two, and
said. The sample is described under fake tensors, never allocated. Results are cached by the sources of the model's
modules, its shapes and the sample, and checked when read back. The command (and the checker) run all this in a
bounded child process (kit.measure_child), which calls `describe`; the trainers call it themselves. `describe`
gives the kit.model.Model of it (the kit's Transformer recognised there), whose splits the trainers run; the
command shows each (the page's even one, and the ones balanced by FLOPs or by memory), each
part's peak per GPU (kit.layer_memory: kit.memory's terms; the kit's own Transformer is kit.memory's estimate
itself), and whether it fits the GPU; `--advise --gpus N` ranks the splits (kit.advise.advise_layers). Its options
are the trainers' own (kit.arguments), with their defaults, and a few of its own.
Owns: the measurement (measure, layer_costs, its cache, the FLOP formulas), describe (tied weights found and
counted once: shared_parameters, count_once), the command. Imports: kit.advise, kit.arguments,
kit.bounded, kit.findings, kit.layer_memory, kit.measure_child, kit.memory, kit.model, kit.schedules, kit.site,
kit.trainer_checks (torch: only in this mode, never on the checker's plain path).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from kit.advise import GPUS, advise_layers, advise_layers_text, gpu_of
from kit.arguments import (ARG, AUTOCAST_DTYPE, CPU_NB_PART, PRECISIONS, SCRIPTS, ArgumentError, Training, add_options, given_values,
    model_args, set_values)
from kit.bounded import FileProblem, read_regular
from kit.findings import Findings, first_line, refusal_text
from kit.layer_memory import estimate_peaks, one_stage_a_task
from kit.measure_child import describe_isolated
from kit.memory import GIB, NotEstimated
from kit.model import LayerCost, Model, ModelError, costs_from_json, default_sample, recognise
from kit.schedules import schedule
from kit.trainer_checks import check_training

CACHE_FORMAT = 6  # 4: LayerCost.out_shape; 5: flops_missed, the layers' modules' sources in the key; 6: LSTM real


# ---- FLOPs the counter misses (issue 41) ----------------------------------------------------------------------------
# torch.utils.flop_counter's registry (torch 2.13.0: mm, addmm, bmm, baddbmm, convolutions, the CUDA SDPA kernels)
# has no formula for the CPU's fused kernels: an LSTM's mkldnn_rnn_layer (RNN.cpp picks it for nn.LSTM on the CPU)
# and SDPA's _scaled_dot_product_flash_attention_for_cpu (and the overrideable fused kernel). Formulas for them, as
# FlopCounterMode's custom_mapping (its arguments' tensors given as shapes): an RNN layer is a matmul of every step's
# input and hidden state by its gate weights (w_ih: gates*hidden x input, w_hh: gates*hidden x hidden), 2 FLOPs a
# multiply-add, its backward twice that (the inputs' and the weights' gradients), as torch counts mm's backward;
# attention is torch's own sdpa_flop_count and sdpa_backward_flop_count.
def _rnn_flop(input_shape: Sequence[int], w_ih: Sequence[int], w_hh: Sequence[int], *args: object,
              out_shape: object = None, **kwargs: object) -> int:
    steps = 1  # every time step of every sequence: the input's sizes but its features
    for d in input_shape[:-1]:
        steps *= d
    return 2 * steps * (w_ih[0] * w_ih[1] + w_hh[0] * w_hh[1])


def _rnn_backward_flop(*args: object, **kwargs: object) -> int:
    return 2 * _rnn_flop(*args[:3])


def _sdpa_flop(q: Sequence[int], k: Sequence[int], v: Sequence[int], *args: object, **kwargs: object) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q, k, v)


def _sdpa_backward_flop(grad_out: Sequence[int], q: Sequence[int], k: Sequence[int], v: Sequence[int],
                        *args: object, **kwargs: object) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out, q, k, v)


def flop_formulas() -> dict:
    """The formulas above by op, those of the ops this torch release has (their names vary by release)."""
    named = {"mkldnn_rnn_layer": _rnn_flop, "mkldnn_rnn_layer_backward": _rnn_backward_flop,
             "_scaled_dot_product_flash_attention_for_cpu": _sdpa_flop,
             "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward_flop,
             "_scaled_dot_product_fused_attention_overrideable": _sdpa_flop,
             "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa_backward_flop}
    return {getattr(torch.ops.aten, name): fn for name, fn in named.items() if hasattr(torch.ops.aten, name)}


# Ops whose name says they compute (a recurrent or attention kernel, a matmul or a convolution) are watched: one
# that neither torch's registry nor flop_formulas counts is named in the layer's flops_missed, and --split time is
# refused on the model (kit.model.Model.layer_costs), never a silent 0.
_COMPUTING = re.compile(r"rnn|lstm|gru|attention|_mm|mm$|matmul|conv")


def load_callable(spec: str, option: str) -> Callable:
    """FILE.py:function or package.module:function, as --model and --sample give it."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModelError(f"{option} {spec}: give FILE.py:function or module:function, e.g. {option} my_model.py:layers")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ModelError(f"{option} {spec}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"kit_user_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelError(f"{option} {spec}: {path} fails on import: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ModelError(f"{option} {spec}: cannot import {where} ({exc}); give FILE.py:function") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ModelError(f"{option} {spec}: {where} has no function {name}")
    return fn


def as_layers(built: object, spec: str) -> list[nn.Module]:
    """The layers of what --model's function returned: an nn.Sequential or a list (or tuple) of modules."""
    if isinstance(built, nn.Sequential):
        layers = list(built)
    elif isinstance(built, (list, tuple, nn.ModuleList)):
        layers = list(built)
    else:
        raise ModelError(f"--model {spec} returned a {type(built).__name__}, not a sequence of layers: return an "
                         "nn.Sequential or a list of modules, in the order the input goes through them")
    bad = [i for i, m in enumerate(layers) if not isinstance(m, nn.Module)]
    if not layers or bad:
        raise ModelError(f"--model {spec}: " + (f"item {bad[0]} is a {type(layers[bad[0]]).__name__}, not an "
                                               "nn.Module" if bad else "no layers"))
    return layers


def build_layers(spec: str, device: str = "meta") -> tuple[list[nn.Module], str]:
    """The user's layers, built on `device` (meta: no memory, whatever the size), and the source text they came
    from (the cache's key)."""
    fn = load_callable(spec, "--model")
    source = source_text(fn, spec)
    try:
        with torch.device(device):
            built = fn()
    except Exception as exc:
        raise ModelError(f"--model {spec}: building it failed: {type(exc).__name__}: {exc}") from None
    return as_layers(built, spec), source


def source_text(fn: Callable, spec: str) -> str:
    """The text of the file `fn` comes from, read now (inspect's linecache may hold an older one): the cache's key."""
    try:
        return Path(inspect.getsourcefile(fn)).read_text()
    except (OSError, TypeError):
        return spec


def sample_batch(sample: str) -> Callable[[], torch.Tensor]:
    """A maker of the sample batch: a shape of token ids (BxS: int64 ids, the kit's data), or FILE.py:function
    returning a tensor (its shape and dtype are what count; its values never do)."""
    if re.fullmatch(r"\d+(x\d+)*", sample):
        shape = [int(d) for d in sample.split("x")]
        if shape[0] < 1 or 0 in shape:
            raise ModelError(f"--sample {sample}: every size must be at least 1, e.g. --sample 32x128")
        return lambda: torch.zeros(shape, dtype=torch.int64)
    fn = load_callable(sample, "--sample")

    def made() -> torch.Tensor:
        try:
            x = fn()
        except Exception as exc:  # one line, not the function's traceback
            raise ModelError(f"--sample {sample}: calling it failed: {type(exc).__name__}: {first_line(exc)[:200]}; "
                             "fix the function (it returns a batch tensor, batch first)") from None
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ModelError(f"--sample {sample} returned a {type(x).__name__}, not a batch tensor (batch first)")
        return x
    return made


def sample_shape(sample: str) -> tuple[list[int], torch.dtype]:
    """The shape and dtype of --sample's batch, described, never allocated: its function is called under fake
    tensors (a 1 GiB batch costs nothing; a tensor it makes from data of its own, numpy's, is its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = sample_batch(sample)()
    return list(x.shape), x.dtype


def _storages(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    return {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}


class _Missed(torch.utils._python_dispatch.TorchDispatchMode):
    """The computing ops (_COMPUTING) of a run that the FLOP counter has no formula for, by name."""

    def __init__(self, counted: dict) -> None:
        super().__init__()
        self.counted, self.names = counted, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001: torch's signature
        if func.overloadpacket not in self.counted and _COMPUTING.search(func.overloadpacket.__name__):
            self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _run_layer(layer: nn.Module, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, float, float, float, float,
                                                                          set[str]]:
    """One forward and backward of `layer`: (its output, the bytes saved for backward that are not its parameters,
    its FLOPs, the bytes of its input and of its output among those saved, the computing ops not counted)."""
    from torch.utils.flop_counter import FlopCounterMode
    params = _storages([*layer.parameters(), *layer.buffers()])
    saved: dict[int, int] = {}
    own_input = id(x.untyped_storage())

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t
    dtype = AUTOCAST_DTYPE[precision] and getattr(torch, AUTOCAST_DTYPE[precision])  # as the trainers run it
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as flops, \
            _Missed(flops.flop_registry) as missed:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                y = layer(x)
        if not isinstance(y, torch.Tensor):
            raise ModelError(f"returns a {type(y).__name__}: a layer of the sequence must return one tensor")
        own_output = saved.get(id(y.untyped_storage()), 0)
        if y.requires_grad:
            y.backward(torch.ones_like(y))
    return (y.detach(), float(sum(saved.values())), float(flops.get_total_flops()), float(saved.get(own_input, 0)),
            float(own_output), missed.names)


def _measure_one(layer: nn.Module, xs: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str,
                 how: str) -> tuple[LayerCost, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """`layer` on a batch of b and of 2b samples: what grows with the batch (per sample) apart from what does not
    (per micro-batch). Each precision runs on what the layers before gave in that precision (under autocast a
    ReLU's output is already low precision, and the next layer saves it as it is). Returns the cost and the
    outputs by precision (the next layer's inputs)."""
    b = xs["fp32"][0].shape[0]
    outs, saved, fixed, flops, own, out_saved, missed, by = {}, {}, {}, 0.0, {}, {}, set(), {}
    for precision in sorted(PRECISIONS, key=lambda p: p == "fp16"):  # fp16 after bf16 (a real run's takes bf16's)
        if how == "cpu" and precision == "fp16":
            # a real CPU run: the CPU's fp16 kernels are not the GPU's (oneDNN's LSTM refuses fp16 on a CPU without
            # AVX512-FP16, or takes another path that saves a third of bf16's bytes): bf16's figures, the same bytes
            # an element, its outputs as fp16
            runs = [(y.to(torch.float16), *rest) for y, *rest in by["bf16"]]
        else:
            runs = [_run_layer(layer, _as_in_the_model(x), precision) for x in xs[precision]]
        by[precision] = runs
        missed |= runs[0][5]
        saved[precision] = max(0.0, (runs[1][1] - runs[0][1]) / b)
        fixed[precision] = max(0.0, runs[0][1] - saved[precision] * b)
        own[precision], out_saved[precision] = runs[0][3] / b, runs[0][4] / b
        outs[precision] = (runs[0][0], runs[1][0])
        if precision == "fp32":
            flops = runs[1][2] - runs[0][2]
    x, y = xs["fp32"][0], outs["fp32"][0]
    cost = LayerCost(name, sum(p.numel() for p in layer.parameters()),
                     sum(p.numel() * p.element_size() for p in layer.parameters()), flops / b,
                     y.numel() * y.element_size() / b, saved, fixed,
                     x.numel() * x.element_size() / b, how, [p.numel() for p in layer.parameters()],
                     sum(t.numel() * t.element_size() for t in layer.buffers()), own, out_saved,
                     {p: o[0].numel() * o[0].element_size() / b for p, o in outs.items()}, list(y.shape[1:]),
                     sorted(missed))
    return cost, outs


def _as_in_the_model(x: torch.Tensor) -> torch.Tensor:
    """A layer's input as it is in the model: the output of an op, not a leaf, so that a layer working in place on
    it (nn.ReLU(inplace=True), x.add_()) runs as it does there (autograd refuses an in-place op on a leaf that
    requires grad). A float input is a clone of a leaf that requires grad (the clone saves nothing for the backward,
    counts no FLOP, and its gradient is what reaches the layer before); token ids are a plain tensor."""
    if not x.is_floating_point():
        return x.detach()
    return x.detach().requires_grad_(True).clone()


# An LSTM on the CPU runs mkldnn_rnn_layer, which keeps a workspace for its backward (the gates of every step: 2.6
# times the layer's other saved bytes in the zoo's LSTM classifier); its fake-tensor kernel returns that workspace
# empty (torch/_meta_registrations.py, mkldnn_rnn_layer: `workspace = torch.empty(0, ...)`, torch 2.3 to 2.14), so
# fake tensors saw 0.39 of the real step's peak (benchmarks/model_zoo.py). A layer holding one is measured for real.
LSTM_REAL = ("holds an nn.LSTM, whose CPU kernel (mkldnn_rnn_layer) keeps a workspace for the backward that fake "
             "tensors do not show")


def measure(spec: str, sample: str) -> list[LayerCost]:
    """Every layer of --model on --sample, under fake tensors (a layer that refuses them: a real CPU forward on a
    batch of one, that layer alone built for real); the first layer's refusal of the sample is one line."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    layers, _ = build_layers(spec)
    make = sample_batch(sample)
    costs = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for layer in layers:
            layer.to_empty(device="cpu")  # fake CPU storage: autocast applies, nothing is allocated
        x = make()
        xs = dict.fromkeys(PRECISIONS, tuple(torch.empty([k * x.shape[0], *x.shape[1:]], dtype=x.dtype)
                                             for k in (1, 2)))
        for i, layer in enumerate(layers):
            name = f"{i}: {type(layer).__name__}"
            if any(isinstance(m, nn.LSTM) for m in layer.modules()):  # its ModelError names the layer already
                cost, xs = _measure_real(spec, i, name, LSTM_REAL, xs)
                costs.append(cost)
                continue
            try:
                cost, xs = _measure_steps(layer, xs, name) or _measure_one(layer, xs, name, "fake")
            except ModelError as exc:
                raise ModelError(f"--model {spec}: layer {name} {exc}") from None
            except Exception as exc:  # data-dependent ops (then a real run measures it), or an input it refuses
                try:
                    cost, xs = _measure_real(spec, i, name, f"does not run under fake tensors ({first_line(exc)[:200]})",
                                             xs)
                except ModelError:
                    if i:
                        raise
                    why = first_line(exc)[:200]
                    raise ModelError(f"--sample {sample}: the first layer ({name}) refuses a batch of shape "
                                     f"{list(x.shape)} {x.dtype}: {why}; give the shape it takes") from None
            costs.append(cost)
    return costs


# ---- recurrent layers run step by step (issue 41, item 8) -----------------------------------------------------------
# On the CPU a GRU or a plain RNN has no fused kernel (an LSTM has mkldnn_rnn_layer): under fake tensors it runs its
# steps one by one, some 100 ops a step, minutes for 512 steps. Its figures are affine in the number of steps (each step
# saves, sends and computes the same), so a layer holding one is measured at STEPS steps and its figures carried to
# the sample's length, where the three runs show them affine to the byte and the FLOP (else: measured whole).
STEPS = (2, 4, 8)


class _Probe(Exception):
    """Raised by the pre-hook that reads a recurrent module's input: nothing of the layer runs after it."""


def _sequence_dim(layer: nn.Module, x: torch.Tensor, rnns: Sequence[nn.Module]) -> int | None:
    """The dim of the layer's input that is its first recurrent module's sequence: the one dim which, cut to
    STEPS[0], gives the module STEPS[0] steps; None where there is not one such dim."""
    def steps(inp: torch.Tensor) -> int | None:
        seen: list[int] = []

        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
                seen.append(args[0].shape[1 if module.batch_first else 0])
            raise _Probe
        handles = [m.register_forward_pre_hook(hook) for m in rnns]
        try:
            with torch.no_grad():
                layer(inp)
        except _Probe:
            pass
        except Exception:  # a cut that the layer refuses before its recurrent module: not the sequence
            return None
        finally:
            for h in handles:
                h.remove()
        return seen[0] if seen else None
    whole = steps(x)
    dims = [d for d in range(1, x.dim()) if whole and x.shape[d] == whole and steps(x.narrow(d, 0, STEPS[0])) == STEPS[0]]
    return dims[0] if len(dims) == 1 else None


def _affine(values: Sequence[float], steps: int) -> float | None:
    """The value at `steps` of a figure measured at STEPS, where the three are affine (else None)."""
    a, b, c = values
    if abs((c - b) - 2 * (b - a)) > 1e-9 * max(1.0, abs(c)):
        return None
    return a + (b - a) * (steps - STEPS[0]) / (STEPS[1] - STEPS[0])


def _carried(costs: Sequence[LayerCost], steps: int) -> LayerCost | None:
    """The LayerCost at `steps` of three measured at STEPS (numbers, numbers by precision, the output's shape),
    or None where a figure is not affine."""
    runs = [asdict(c) for c in costs]
    out = dict(runs[0])
    for key, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = _affine([r[key] for r in runs], steps)
            if out[key] is None:
                return None
            out[key] = type(v)(round(out[key])) if isinstance(v, int) else out[key]
        elif isinstance(v, dict):
            out[key] = {p: _affine([r[key][p] for r in runs], steps) for p in v}
            if None in out[key].values():
                return None
    out["out_shape"] = [steps if (a, b) == STEPS[:2] else a for a, b in zip(runs[0]["out_shape"],
                                                                            runs[1]["out_shape"])]
    out["how"] = f"fake, {STEPS[0]}-{STEPS[-1]} steps carried to {steps}"
    return LayerCost(**out)


def _measure_steps(layer: nn.Module, xs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   name: str) -> tuple[LayerCost, dict] | None:
    """A layer holding a GRU or a plain RNN, measured at STEPS steps of its sequence and carried to the sample's
    (_carried); None where it holds none, the sequence is short or not one dim of its input, or the figures are not
    affine: then it is measured whole."""
    rnns = [m for m in layer.modules() if isinstance(m, (nn.GRU, nn.RNN))]
    x = xs["fp32"][0]
    d = _sequence_dim(layer, x, rnns) if rnns else None
    if d is None or x.shape[d] <= 2 * STEPS[-1]:
        return None
    runs = [_measure_one(layer, {p: tuple(v.narrow(d, 0, t) for v in pair) for p, pair in xs.items()}, name, "fake")
            for t in STEPS]
    cost = _carried([c for c, _ in runs], x.shape[d])
    if cost is None:
        return None
    outs = {}
    for p, pair in runs[0][1].items():
        shape = [x.shape[d] if (a, b) == STEPS[:2] else a for a, b in zip(pair[0].shape, runs[1][1][p][0].shape)]
        outs[p] = tuple(torch.empty([v.shape[0], *shape[1:]], dtype=pair[0].dtype) for v in xs[p])
    return cost, outs


def one_layer_for_real(spec: str, index: int) -> nn.Module:
    """Layer `index` of --model, alone built for real on the CPU: the model built on the meta device (no memory),
    that layer's storage made, its parameters drawn as its modules' reset_parameters draws them (small normal values
    for those without one), its buffers zero but where reset_parameters (BatchNorm's reset_running_stats) sets
    them. The rest of the model is never allocated."""
    layer = build_layers(spec, device="meta")[0][index]
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
        for b in layer.buffers():
            b.zero_()
        for m in layer.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    return layer


def _measure_real(spec: str, index: int, name: str, why: str,
                  xs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[LayerCost, dict]:
    """The fallback for one layer: that layer alone built for real on the CPU (one_layer_for_real), run on batches
    of one and two; said on stderr."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        try:
            layer = one_layer_for_real(spec, index)
        except Exception as exc:
            raise ModelError(f"--model {spec}: layer {name} cannot be built alone for real: {type(exc).__name__}: "
                             f"{first_line(exc)[:200]}") from None
        real = {p: tuple(torch.zeros([k, *x[0].shape[1:]], dtype=x[0].dtype) if not x[0].is_floating_point()
                         else torch.randn([k, *x[0].shape[1:]], dtype=x[0].dtype) for k in (1, 2))
                for p, x in xs.items()}
        try:
            cost, outs = _measure_one(layer, real, name, "cpu")
        except Exception as exc:
            raise ModelError(f"--model {spec}: layer {name} fails on its input: {type(exc).__name__}: "
                             f"{first_line(exc)[:200]}; fix that layer, or give --sample the batch the model "
                             "takes") from None
    print(f"own_model: layer {name} {why}; measured by a real CPU forward on batches of one and two", file=sys.stderr)
    # the next layers go on under fake tensors, at the sample's batch
    return cost, {p: tuple(torch.empty([x.shape[0], *outs[p][0].shape[1:]], dtype=outs[p][0].dtype) for x in xs[p])
                  for p in xs}


def layer_times(spec: str, sample: str, sizes: Sequence[int] | None = None, repeats: int = 15,
                device: str = "cpu") -> list[float]:
    """Seconds of one forward and backward of each part (`sizes` layers each; default one layer a part) on its real
    input, median of `repeats` after two untimed runs, on `device`: what a profile taken where the job runs gives
    (a GPU in an allocation; the CPU here), for the split by time where FLOPs do not follow it. The parts are timed
    in turn, round after round, so that a burst of other work on the machine slows every part alike instead of the
    one it happened to fall on."""
    import statistics
    import time
    layers, _ = build_layers(spec, device=device)
    x = sample_batch(sample)()
    x = (torch.randn(x.shape) if x.is_floating_point() else torch.zeros(x.shape, dtype=x.dtype)).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    parts, inputs, start = [], [], 0
    for n in sizes or [1] * len(layers):
        parts.append(nn.Sequential(*layers[start:start + n]))
        start += n
        inputs.append(x)
        with torch.no_grad():
            x = parts[-1](x.clone())  # a part working in place leaves its recorded input as it was
    runs: list[list[float]] = [[] for _ in parts]
    for _ in range(repeats + 2):
        for part, inp, times in zip(parts, inputs, runs):
            inp = _as_in_the_model(inp)  # an in-place first layer runs as in the model
            sync()
            t0 = time.perf_counter()
            y = part(inp)
            y.backward(torch.ones_like(y))
            sync()
            times.append(time.perf_counter() - t0)
            part.zero_grad(set_to_none=True)
    return [statistics.median(times[2:]) for times in runs]


def cache_path(spec: str, sample: str, source: str) -> Path:
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, torch.__version__, spec, sample, source]).encode()).hexdigest()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-kit" / "models"
    return root / f"{key[:24]}.json"


def classes_source(layers: Sequence[nn.Module]) -> str:
    """The source of every module the layers' classes come from (each layer's, its submodules', and their bases'):
    a helper file's changed forward is a changed key. torch's own files are left out (its version is in the key);
    another installed package's (transformers...) count by their path, size and time, not their text (large)."""
    torch_dir = str(Path(torch.__file__).resolve().parent)
    files = set()
    for layer in layers:
        for m in layer.modules():
            for cls in type(m).__mro__:
                try:
                    files.add(str(Path(inspect.getsourcefile(cls)).resolve()))
                except (TypeError, OSError):  # builtins, classes made at run time
                    pass
    texts = []
    for f in sorted(files):
        if f.startswith(torch_dir + os.sep):
            continue
        try:
            st = os.stat(f)
            texts.append(f"{f} {st.st_size} {st.st_mtime_ns}" if re.search(r"[/\\](site|dist)-packages[/\\]", f)
                         else f + "\n" + Path(f).read_text(errors="replace"))
        except OSError:
            texts.append(f + " unreadable")
    return "\n".join(texts)


def _cache_key(spec: str, sample: str, layers: Sequence[nn.Module], source: str) -> Path:
    """The cache's file for these layers: the model's file, every module its layers' classes come from, what it
    builds (types, parameter and buffer shapes, built on the meta device), the sample (its function's source and
    its batch's shape, described) and the torch release."""
    source += classes_source(layers)
    source += "".join(repr(layer) + repr([(n, tuple(t.shape), str(t.dtype)) for n, t in
                                          [*layer.named_parameters(), *layer.named_buffers()]]) for layer in layers)
    if not re.fullmatch(r"\d+(x\d+)*", sample):
        source += source_text(load_callable(sample, "--sample"), sample)
        source += repr(sample_shape(sample))
    return cache_path(spec, sample, source)


def layer_costs(spec: str, sample: str, use_cache: bool = True,
                built: tuple[list[nn.Module], str] | None = None) -> list[LayerCost]:
    """measure(), cached (_cache_key): a changed file is measured again, and so is a model whose layers changed
    through a file it imports. An entry read back is checked (kit.model.costs_from_json: every field, finite,
    non-negative, one a layer): on any doubt the model is measured again. `built`: build_layers' answer, when the
    caller has it."""
    layers, source = built or build_layers(spec)
    path = _cache_key(spec, sample, layers, source)
    if use_cache and os.path.lexists(path):
        try:  # a regular file, bounded (kit.bounded.read_regular: a FIFO there would block, /dev/zero fill memory)
            return costs_from_json(json.loads(read_regular(path, 16 * 2 ** 20, nofollow=True)[0]), len(layers))
        except (FileProblem, ValueError, TypeError, OSError, RecursionError):
            pass  # damaged: measured again
    costs = measure(spec, sample)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps([asdict(c) for c in costs]))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written costs the next run a measurement
    return costs


def describe(spec: str, sample: str, use_cache: bool = True) -> Model:
    """The model of --model on --sample as the kit plans it (kit.model), in this process: its layers measured
    (layer_costs, cached), and recognised where they are the kit's own (kit.model.recognise: built on the meta device,
    no memory). The trainers call it (they run the model anyway); the checker and the command measure in a bounded
    child (kit.measure_child), which calls it."""
    built = build_layers(spec)
    costs = layer_costs(spec, sample, use_cache, built)
    shape, dtype = sample_shape(sample)
    ends, kit = recognise(built[0], shape, dtype.is_floating_point)
    shared = shared_parameters(built[0])
    return Model(spec, sample, count_once(costs, shared, built[0]), ends, kit, shared)


def shared_parameters(layers: Sequence[nn.Module]) -> list[tuple[int, int, str]]:
    """Tied weights: (the first layer that holds a Parameter, a later layer holding the same object, its name in the
    first), as GPT-2's lm_head holds its wte's weight (Hugging Face's tie_word_embeddings)."""
    first: dict[int, tuple[int, str]] = {}
    out = []
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():  # (each Parameter once within a layer)
            owner, where = first.setdefault(id(p), (i, name))
            if owner != i:
                out.append((owner, i, where))
    return out


def count_once(costs: list[LayerCost], shared: list[tuple[int, int, str]],
               layers: Sequence[nn.Module]) -> list[LayerCost]:
    """The costs with each tied weight counted in its first layer only (its parameters, bytes and tensors): one
    Parameter, one gradient, one AdamW state, where the trainers keep them on one part (kit.model.Model.refusal
    refuses a split that would not)."""
    costs = list(costs)
    for owner, user, name in shared:
        p = layers[owner].get_parameter(name)
        c = costs[user]
        tensors = list(c.tensors)
        if p.numel() in tensors:
            tensors.remove(p.numel())
        costs[user] = dataclasses.replace(c, params=c.params - p.numel(),
                                          param_bytes=c.param_bytes - p.numel() * p.element_size(), tensors=tensors)
    return costs


def memory_lines(parts: Sequence, gib: float | None, gpu: str) -> list[str]:
    """Each part's estimate (GiB) and its terms, and whether it fits in the GPU's usable memory."""
    lines = []
    for m in parts:
        unit, size = ("GiB", GIB) if m.peak >= GIB else ("MiB", 2 ** 20)  # as kit.memory.format_memory
        terms = " + ".join(f"{k} {getattr(m, k) / size:.2f}" for k in m.TERMS if getattr(m, k) / size >= 0.005)
        fits = "" if gib is None else f"; {'fits' if m.total <= gib * GIB else 'does NOT fit'} in {gib:.1f} GiB ({gpu})"
        lines.append(f"  {m.unit} {m.part} ({m.contents}): {m.total / size:.2f} {unit} = {terms}; peak at "
                     f"{m.peak_at}{fits}")
    return lines


def table(model: Model, nb_part: int, micro: int, chunks: int, times: Sequence[float] | None = None,
          estimate: dict | None = None) -> str:
    """The per-layer figures, then each split (kit.model, the trainers' own) with its parts' FLOPs and peaks
    (estimate: estimate_peaks' keyword arguments, and `gib`, `gpu` for the fit)."""
    estimate = dict(estimate or {}, kit_model=model.kit)
    gib, gpu = estimate.pop("gib", None), estimate.pop("gpu", "")
    costs = model.costs
    lines = [f"{'layer':24s} {'params':>12s} {'MFLOP/sample':>13s} {'out KiB/sample':>15s} "
             f"{'saved KiB/sample fp32 / bf16 / fp16 / ckpt':>44s}  how"]
    for c in costs:
        saved = " / ".join(f"{c.saved[p] / 1024:.1f}" for p in PRECISIONS)
        lines.append(f"{c.name[:24]:24s} {c.params:12,d} {c.flops / 1e6:13.3f} {c.out_bytes / 1024:15.1f} "
                     f"{saved + ' / ' + format(c.saved_checkpointed / 1024, '.1f'):>44s}  {c.how}"
                     + (f"; FLOPs not counted ({', '.join(c.flops_missed)})" if c.flops_missed else ""))
    if model.flops_missed():
        lines.append(f"{model.flops_missed()}: no split by time on these FLOPs (--time-layers times the layers)")
    if times:
        lines.append("measured ms per layer (fwd+bwd of the sample's batch): " + ", ".join(f"{t * 1e3:.2f}"
                                                                                         for t in times))
    precision, ckpt = estimate.get("precision", "fp32"), estimate.get("checkpointing", False)
    for kind, sizes in model.splits(nb_part, micro, chunks, precision, ckpt, times).items():
        peaks = estimate_peaks(costs, sizes, micro, chunks, **estimate)
        start, parts = 0, []
        for n, m in zip(sizes, peaks):
            part = costs[start:start + n]
            gflop = sum(c.flops for c in part) * micro / 1e9
            word = (" (FLOPs not counted)" if any(c.flops_missed for c in part) else
                    " (no matmul or convolution: elementwise FLOPs are not counted)" if gflop == 0 else "")
            parts.append(f"layers {start}-{start + n - 1}: {gflop:.3f} GFLOP{word}, {m.total / GIB:.3f} GiB")
            start += n
        lines.append(f"split by {kind:6s} {sizes}: " + " | ".join(parts))
        lines += memory_lines(peaks, gib, gpu)
        why = model.refusal(sizes, estimate.get("layout", "replica"))
        lines += [f"  the trainers refuse this split: {why}"] if why else []
    lines.append(f"(FLOPs of one micro-batch of {micro}, forward and backward; the peak of each part's GPU: "
                 "kit.layer_memory, docs/own_model.md"
                 + ("; the kit's own Transformer: kit.memory's estimate itself" if model.kit else "") + ")")
    return "\n".join(lines)


# The trainers' options this tool takes (their definitions in kit.arguments: the same names, ranges and defaults, a
# GPU's where the default depends on the device: the tool plans a GPU job). The parts are --nb-part in the replica
# layout, --pp in the stage layout, as in the trainers.
TRAINER_OPTIONS = ("model_spec", "sample", "nb_part", "pp", "schedule", "virtual_stages", "chunks", "batch_size",
                   "seq_len", "precision", "activation_checkpointing", "zero")


def _arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kit.own_model", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    add_options(p.add_argument_group("the trainers' options (kit.arguments: the same ranges and defaults, a GPU's)"),
                [ARG[name] for name in TRAINER_OPTIONS],
                lambda a: f" [{SCRIPTS[a.layouts[0]]}]" if len(a.layouts) == 1 else "")
    p.add_argument("--layout", choices=("replica", "stage"), default="replica",
                   help="the trainer: replica (bench_ddp_transformer.py, --nb-part parts) or stage (bench_stage.py, "
                        "--pp stages)")
    p.add_argument("--replicas", type=int, default=1, help="the replicas the estimate shares --zero's states over")
    p.add_argument("--time-layers", action="store_true",
                   help="time each layer for real here (a GPU when there is one) and split by time on those times, "
                        "not on FLOPs: run it where the job runs (srun python -m kit.own_model ...)")
    p.add_argument("--arch", choices=GPUS, default="h100", help="the GPU (its -C feature): its usable memory and "
                   "kernels")
    p.add_argument("--gpu-mem", type=float, help="GiB of one GPU, instead of --arch's")
    p.add_argument("--advise", action="store_true", help="rank the splits of --gpus GPUs for this model")
    p.add_argument("--gpus", type=int, help="with --advise: the GPUs of the job (nb_part x replicas)")
    p.add_argument("--global-batch", type=int, help="with --advise: samples a step over all replicas (default: "
                   "--batch-size)")
    p.add_argument("--top", type=int, default=12, help="with --advise: the rows shown")
    p.add_argument("--json", action="store_true", help="the per-layer figures as JSON")
    p.add_argument("--no-cache", action="store_true")
    return p


def _request(args: argparse.Namespace) -> tuple[Training, dict, int]:
    """The trainers' options given, read and checked by the trainers' own rules (kit.arguments, kit.trainer_checks,
    kit.schedules): the Training, the model's arguments (the GPU defaults where not given) and the parts. ModelError
    (or ArgumentError, NotEstimated) with the one line that refuses them."""
    given = given_values(args, [ARG[name] for name in TRAINER_OPTIONS])
    if not given.get("model_spec"):
        raise ModelError("--model FILE.py:function (or module:function) is needed: the layers to measure")
    other = [ARG[d].flag for d in given if args.layout not in ARG[d].layouts]
    if other:
        raise ModelError(f"{', '.join(other)}: not an option of {SCRIPTS[args.layout]} (--layout {args.layout}); "
                         "the parts are --nb-part in the replica layout, --pp in the stage layout")
    t = set_values(Training(layout=args.layout), given)
    m = model_args(t)
    t.sample = t.sample or default_sample(m["batch_size"], m["seq_len"])
    parts = t.pp if t.layout == "stage" else t.nb_part or CPU_NB_PART
    findings = Findings()
    check_training(parts, t, findings)
    if t.layout == "stage":
        schedule(t.schedule).check(parts, m["chunks"], t.virtual_stages, findings)
    if findings.errors:
        raise ModelError(refusal_text(findings.errors))
    one_stage_a_task(t)  # NotEstimated where the schedule puts several stages on a task
    if args.advise and not (args.gpus and args.gpus >= 1):
        raise ModelError("--advise needs --gpus N, the GPUs of the job, e.g. --advise --gpus 8 --arch h100")
    return t, m, parts


def checker_advise(args: argparse.Namespace, t: Training) -> int:
    """check_topology --advise with --model: advise_layers on the user's layers (not the kit's Transformer's splits),
    for each --global-batch, on the request kit.advise checks; a model that cannot be measured is one line (exit 2)."""
    from kit.advise import advise_request
    from kit.findings import UsageError
    from kit.memory import requested_arch
    from kit.site import is_v100
    if args.profile:
        raise UsageError("--profile is a profile of the kit's own Transformer: with --model, --advise ranks the splits "
                         "by FLOPs (python -m kit.own_model --time-layers measures your layers' times); leave it out")
    job, gpn, gib, source, batches = advise_request(args)
    sample = t.sample or f"{max(batches)}x{model_args(t)['seq_len']}"
    try:
        model = describe_isolated(t.model_spec, sample)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    if model.flops_missed():  # the ranking's speed proxy is the FLOPs
        print(f"note: {model.flops_missed()}: the ranking's FLOPs proxy leaves them out")
    for batch in batches:
        rows = advise_layers(model, job.nodes * gpn, gib, requested_arch(is_v100(job))[0], batch)
        print(advise_layers_text(rows, job.nodes * gpn, gib, source, batch, args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _arguments().parse_args(argv)
    try:
        t, m, parts = _request(args)
        model = describe_isolated(t.model_spec, t.sample, use_cache=not args.no_cache)  # the model's code: a child
        model.sizes(parts)  # ModelError where the model has fewer layers than parts
    except (ModelError, ArgumentError, NotEstimated) as exc:
        print(f"own_model: {exc}", file=sys.stderr)
        return 2
    gib, gpu, arch = gpu_of(args.arch, args.gpu_mem)
    batch, chunks = m["batch_size"], m["chunks"]
    if args.advise:
        if model.flops_missed():  # the ranking's speed proxy is the FLOPs
            print(f"note: {model.flops_missed()}: the ranking's FLOPs proxy leaves them out")
        rows = advise_layers(model, args.gpus, gib, arch, args.global_batch or batch)
        print(advise_layers_text(rows, args.gpus, gib, gpu, args.global_batch or batch, args.top))
        return 0 if any(r["fits"] for r in rows) else 1
    times = (layer_times(t.model_spec, t.sample, device="cuda" if torch.cuda.is_available() else "cpu")
             if args.time_layers else None)
    estimate = dict(precision=t.precision, replicas=args.replicas, zero=t.zero,
                    checkpointing=t.activation_checkpointing, layout=t.layout, arch=arch, schedule=t.schedule,
                    gib=gib, gpu=gpu)
    print(json.dumps([asdict(c) for c in model.costs], indent=1) if args.json else
          table(model, parts, batch // chunks, chunks, times, estimate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
