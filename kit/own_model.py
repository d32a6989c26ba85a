"""Bring your own model (issue 34, first part): the user's layers named once, `--model FILE.py:function` (or
`module:function`) returning an nn.Sequential or a list of modules, a sample batch (`--sample FILE.py:function`, or
a shape of token ids such as 32x128), and each layer measured without a GPU, in seconds, on a login node:

    python -m kit.own_model --model my_model.py:layers --sample 32x128 --nb-part 4

The layers are built on the meta device (no memory) and run under fake tensors on the CPU (no data, no compute):
one forward and backward per layer and precision gives its parameters, the bytes autograd saves for the backward
(fp32, and under bf16 or fp16 autocast), its FLOPs (torch.utils.flop_counter), and the bytes of its output, which is
what a part boundary sends. A layer that cannot run under fake tensors (data-dependent control flow) is measured by a
real CPU forward on batches of one and two, and said. Results are cached by the model's source and the shapes.
Then the split: the page's even one, and the one balanced by FLOPs or by memory (kit.plan.balanced_sizes).
Owns: LayerCost and the measurement. Imports: kit.arguments, kit.plan, kit.train.errors, kit.train.options
(torch: only in this mode, never on the checker's plain path).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from kit.arguments import PRECISIONS
from kit.plan import balanced_sizes, part_sizes
from kit.train.errors import first_line
from kit.train.options import AUTOCAST_DTYPE  # each --precision's autocast dtype, as the trainers run it

CACHE_FORMAT = 1


class ModelError(ValueError):
    """The model, the sample or a layer refused: one line that names it and the fix."""


@dataclass
class LayerCost:
    """One layer, per sample of the batch (activations and FLOPs grow with the batch; parameters do not)."""
    name: str
    params: int  # elements
    param_bytes: int
    flops: float  # forward + backward, per sample
    out_bytes: float  # the output, per sample: what a part boundary sends
    saved: dict[str, float] = field(default_factory=dict)  # bytes saved for backward per sample, by precision
    saved_fixed: dict[str, float] = field(default_factory=dict)  # and per micro-batch whatever its size (autocast's
    # low-precision copies of the weights): the two from runs at the sample's batch and at twice it
    saved_checkpointed: float = 0.0  # with activation checkpointing: the layer's input alone, per sample
    how: str = "fake"  # "fake": fake tensors; "cpu": a real forward on a batch of one (fake tensors failed)


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
        x = fn()
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ModelError(f"--sample {sample} returned a {type(x).__name__}, not a batch tensor (batch first)")
        return x
    return made


def _storages(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    return {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}


def _run_layer(layer: nn.Module, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, float, float]:
    """One forward and backward of `layer`: (its output, the bytes saved for backward that are not its parameters,
    its FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode
    params = _storages([*layer.parameters(), *layer.buffers()])
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t
    dtype = AUTOCAST_DTYPE[precision]
    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                y = layer(x)
        if not isinstance(y, torch.Tensor):
            raise ModelError(f"returns a {type(y).__name__}: a layer of the sequence must return one tensor")
        if y.requires_grad:
            y.backward(torch.ones_like(y))
    return y.detach(), float(sum(saved.values())), float(flops.get_total_flops())


def _measure_one(layer: nn.Module, xs: tuple[torch.Tensor, torch.Tensor], name: str,
                 how: str) -> tuple[LayerCost, tuple[torch.Tensor, torch.Tensor]]:
    """`layer` on a batch of b and of 2b samples: what grows with the batch (per sample) apart from what does not
    (per micro-batch). Returns the cost and the two outputs (the next layer's inputs)."""
    b = xs[0].shape[0]
    outs, saved, fixed, flops = [], {}, {}, 0.0
    for precision in PRECISIONS:
        runs = [_run_layer(layer, x.detach().requires_grad_(x.is_floating_point()), precision) for x in xs]
        saved[precision] = max(0.0, (runs[1][1] - runs[0][1]) / b)
        fixed[precision] = max(0.0, runs[0][1] - saved[precision] * b)
        if precision == "fp32":
            outs, flops = [r[0] for r in runs], runs[1][2] - runs[0][2]
    x = xs[0]
    cost = LayerCost(name, sum(p.numel() for p in layer.parameters()),
                     sum(p.numel() * p.element_size() for p in layer.parameters()), flops / b,
                     outs[0].numel() * outs[0].element_size() / b, saved, fixed,
                     x.numel() * x.element_size() / b, how)
    return cost, (outs[0], outs[1])


def measure(spec: str, sample: str) -> list[LayerCost]:
    """Every layer of --model on --sample, under fake tensors (a layer that refuses them: a real CPU forward on a
    batch of one); the first layer's refusal of the sample is one line."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    layers, _ = build_layers(spec)
    make = sample_batch(sample)
    costs = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for layer in layers:
            layer.to_empty(device="cpu")  # fake CPU storage: autocast applies, nothing is allocated
        x = make()
        xs = tuple(torch.empty([k * x.shape[0], *x.shape[1:]], dtype=x.dtype) for k in (1, 2))
        for i, layer in enumerate(layers):
            name = f"{i}: {type(layer).__name__}"
            try:
                cost, xs = _measure_one(layer, xs, name, "fake")
            except ModelError as exc:
                raise ModelError(f"--model {spec}: layer {name} {exc}") from None
            except Exception as exc:  # data-dependent ops (then a real run measures it), or an input it refuses
                try:
                    cost, xs = _measure_real(spec, i, name, exc, xs)
                except ModelError:
                    if i:
                        raise
                    why = first_line(exc)[:200]
                    raise ModelError(f"--sample {sample}: the first layer ({name}) refuses a batch of shape "
                                     f"{list(x.shape)} {x.dtype}: {why}; give the shape it takes") from None
            costs.append(cost)
    return costs


def _measure_real(spec: str, index: int, name: str, why: Exception,
                  xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[LayerCost, tuple[torch.Tensor, torch.Tensor]]:
    """The fallback for one layer: built for real on the CPU, run on batches of one and two; said on stderr."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        layer = build_layers(spec, device="cpu")[0][index]
        real = tuple(torch.zeros([k, *xs[0].shape[1:]], dtype=xs[0].dtype) if not xs[0].is_floating_point()
                     else torch.randn([k, *xs[0].shape[1:]]) for k in (1, 2))
        try:
            cost, outs = _measure_one(layer, real, name, "cpu")
        except Exception as exc:
            raise ModelError(f"--model {spec}: layer {name} fails on its input: {type(exc).__name__}: "
                             f"{first_line(exc)[:200]}") from None
    print(f"own_model: layer {name} does not run under fake tensors ({first_line(why)[:200]}); measured by a real CPU "
          "forward on batches of one and two", file=sys.stderr)
    # the next layers go on under fake tensors, at the sample's batch
    return cost, tuple(torch.empty([x.shape[0], *outs[0].shape[1:]], dtype=outs[0].dtype) for x in xs)


def layer_times(spec: str, sample: str, sizes: Sequence[int] | None = None, repeats: int = 15,
                device: str = "cpu") -> list[float]:
    """Seconds of one forward and backward of each part (`sizes` layers each; default one layer a part) on its real
    input, median of `repeats` after two untimed runs, on `device`: what a profile taken where the job runs gives
    (a GPU in an allocation; the CPU here), for the split by time where FLOPs do not follow it."""
    import statistics
    import time
    layers, _ = build_layers(spec, device=device)
    x = sample_batch(sample)()
    x = (torch.randn(x.shape) if x.is_floating_point() else torch.zeros(x.shape, dtype=x.dtype)).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times, start = [], 0
    for n in sizes or [1] * len(layers):
        part = nn.Sequential(*layers[start:start + n])
        start += n
        runs = []
        for _ in range(repeats + 2):
            inp = x.detach().requires_grad_(x.is_floating_point())
            sync()
            t0 = time.perf_counter()
            y = part(inp)
            y.backward(torch.ones_like(y))
            sync()
            runs.append(time.perf_counter() - t0)
            part.zero_grad(set_to_none=True)
        times.append(statistics.median(runs[2:]))
        with torch.no_grad():
            x = part(x)
    return times


def cache_path(spec: str, sample: str, source: str) -> Path:
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, torch.__version__, spec, sample, source]).encode()).hexdigest()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid-kit" / "models"
    return root / f"{key[:24]}.json"


def layer_costs(spec: str, sample: str, use_cache: bool = True) -> list[LayerCost]:
    """measure(), cached by the model's source, the sample and the torch release (a changed file is measured again)."""
    _, source = build_layers(spec)
    if not re.fullmatch(r"\d+(x\d+)*", sample):
        source += source_text(load_callable(sample, "--sample"), sample)
    path = cache_path(spec, sample, source)
    if use_cache and path.is_file():
        try:
            return [LayerCost(**c) for c in json.loads(path.read_text())]
        except (ValueError, TypeError, OSError):
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


def part_peak(costs: Sequence[LayerCost], micro: int, alive: int, precision: str = "fp32",
              checkpointing: bool = False) -> float:
    """A first-order peak of the GPU holding `costs`: weights, AdamW's two states, the gradients and DDP's bucket
    copy (fp32, 5 x the parameters' bytes), and what `alive` micro-batches of `micro` samples saved for backward
    (GPipe keeps every micro-batch's until its backward). The kit's own Transformer has the op-by-op model of
    kit.memory; this one is for a model the kit did not write, and is said to be first-order."""
    static = 5 * sum(c.param_bytes for c in costs)
    per_micro = (sum(c.saved_checkpointed for c in costs) * micro if checkpointing
                 else sum(c.saved[precision] * micro + c.saved_fixed[precision] for c in costs))
    return static + alive * per_micro


def splits(costs: Sequence[LayerCost], nb_part: int, micro: int, chunks: int,
           times: Sequence[float] | None = None) -> dict[str, list[int]]:
    """The page's even split, and the splits balanced by time (measured `times` per layer where given, else FLOPs)
    and by memory (the peak of each part)."""
    memory = [part_peak([c], micro, chunks) for c in costs]
    return {"even": part_sizes(len(costs), nb_part),
            "time": balanced_sizes(list(times) if times else [c.flops for c in costs], nb_part),
            "memory": balanced_sizes(memory, nb_part)}


def table(costs: Sequence[LayerCost], nb_part: int, micro: int, chunks: int,
          times: Sequence[float] | None = None) -> str:
    """The per-layer figures, then each split with its parts' FLOPs and peaks."""
    lines = [f"{'layer':24s} {'params':>12s} {'MFLOP/sample':>13s} {'out KiB/sample':>15s} "
             f"{'saved KiB/sample fp32 / bf16 / fp16 / ckpt':>44s}  how"]
    for c in costs:
        saved = " / ".join(f"{c.saved[p] / 1024:.1f}" for p in PRECISIONS)
        lines.append(f"{c.name[:24]:24s} {c.params:12,d} {c.flops / 1e6:13.3f} {c.out_bytes / 1024:15.1f} "
                     f"{saved + ' / ' + format(c.saved_checkpointed / 1024, '.1f'):>44s}  {c.how}")
    if times:
        lines.append("measured ms per layer (fwd+bwd of the sample's batch): " + ", ".join(f"{t * 1e3:.2f}"
                                                                                         for t in times))
    for kind, sizes in splits(costs, nb_part, micro, chunks, times).items():
        start, parts = 0, []
        for n in sizes:
            part = costs[start:start + n]
            parts.append(f"layers {start}-{start + n - 1}: {sum(c.flops for c in part) * micro / 1e9:.3f} GFLOP, "
                         f"{part_peak(part, micro, chunks) / 2**20:.1f} MiB")
            start += n
        lines.append(f"split by {kind:6s} {sizes}: " + " | ".join(parts))
    lines.append(f"(FLOPs of one micro-batch of {micro}, forward and backward; a first-order peak of each part's GPU: "
                 f"fp32 weights, AdamW, gradients and DDP's bucket, {chunks} micro-batches' saved tensors)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kit.own_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="FILE.py:function or module:function returning the layers")
    p.add_argument("--sample", required=True, help="FILE.py:function returning a batch, or token ids BxS, e.g. 32x128")
    p.add_argument("--nb-part", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per batch (the page's Pipe chunks)")
    p.add_argument("--time-layers", action="store_true",
                   help="time each layer for real here (a GPU when there is one) and split by time on those times, "
                        "not on FLOPs: run it where the job runs (srun python -m kit.own_model ...)")
    p.add_argument("--json", action="store_true", help="the per-layer figures as JSON")
    p.add_argument("--no-cache", action="store_true")
    args = p.parse_args(argv)
    try:
        costs = layer_costs(args.model, args.sample, use_cache=not args.no_cache)
        batch = sample_batch(args.sample)().shape[0]
        if not 1 <= args.nb_part <= len(costs):
            raise ModelError(f"--nb-part {args.nb_part}: the model has {len(costs)} layers; give 1 to {len(costs)}")
        if args.chunks < 1 or batch % args.chunks:
            raise ModelError(f"--chunks {args.chunks} must divide the sample's batch of {batch}")
    except ModelError as exc:
        print(f"own_model: {exc}", file=sys.stderr)
        return 2
    times = (layer_times(args.model, args.sample, device="cuda" if torch.cuda.is_available() else "cpu")
             if args.time_layers else None)
    print(json.dumps([asdict(c) for c in costs], indent=1) if args.json else
          table(costs, args.nb_part, batch // args.chunks, args.chunks, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
