#!/usr/bin/env python
"""The model families users bring (issue 41), each planned by the kit and checked against torch's own counters:
parameters (kit.own_model's, tied weights once) against the numel of the model's unique parameters, FLOPs (the sum of
the layers' measured FLOPs) against torch.utils.flop_counter.FlopCounterMode on a real forward and backward of the
whole model, and each part's memory estimate (kit.layer_memory, the trainers' loss included) against MemTracker's
peak on a real CPU step as the replica trainer runs it (benchmarks/own_model_memory.py's step).

    python benchmarks/model_zoo.py          # the table of docs/own_model.md

The models are tests/zoo_families.py's, written for this (GPT-2 and BERT from transformers' configs, random-init; an
LSTM classifier, a long-context encoder of nn.TransformerEncoderLayer, a ResNet-like and a U-Net-like model), at
sizes that run in minutes on 2 cores; torchvision's ResNet-18 and ViT-B/16 and timm's ViT-S/16 (tests/zoo_vision.py,
full size, two 224 x 224 images) where they import (beside torch 2.14.1 only), else a line says why not:

    ~/.cache/hybrid-kit/venvs/torch-2.14.1-*/bin/python benchmarks/model_zoo.py --only "torchvision ResNet-18" \\
        "torchvision ViT-B/16" "timm ViT-S/16"
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import kit.own_model as own  # noqa: E402
import own_model_memory  # noqa: E402
from memory_grid import table  # noqa: E402

FAMILIES = str(ROOT / "tests" / "zoo_families.py")
# name: (--model, --sample, layers per part, chunks)
ZOO = {
    "GPT-2 LM (tied, 1 part)": (f"{FAMILIES}:gpt2_tiny_lm", "8x32", [4], 2),
    "GPT-2 LM (untied)": (f"{FAMILIES}:gpt2_tiny_lm_untied", "8x32", [2, 2], 2),
    "GPT-2 2-class": (f"{FAMILIES}:gpt2_tiny_classifier", "8x32", [2, 2], 2),
    "BERT 2-class": (f"{FAMILIES}:bert_tiny_classifier", "8x32", [2, 2], 2),
    "LSTM classifier": (f"{FAMILIES}:lstm_classifier", "8x32", [2, 2], 2),
    "long-context encoder": (f"{FAMILIES}:long_encoder", f"{FAMILIES}:long_sample", [3, 3], 2),
    "ResNet-like": (f"{FAMILIES}:resnet_like", f"{FAMILIES}:image_sample", [3, 3], 2),
    "U-Net-like": (f"{FAMILIES}:unet_like", f"{FAMILIES}:unet_sample", [2, 1], 2),
}
# the families from packages the kit does not depend on (tests/zoo_vision.py, beside torch 2.14.1 only): a row where
# torchvision and timm import, else a line that says why not
VISION = str(ROOT / "tests" / "zoo_vision.py")
PACKAGED = {"torchvision ResNet-18": (f"{VISION}:resnet18", f"{VISION}:image_224_pair", [3, 3], 2),
            "torchvision ViT-B/16": (f"{VISION}:vit_b_16", f"{VISION}:image_224_pair", [7, 7], 2),
            "timm ViT-S/16": (f"{VISION}:timm_vit_s_16", f"{VISION}:image_224_pair", [7, 7], 2)}


def unique_params(layers: list[nn.Module]) -> int:
    return sum(p.numel() for p in {id(p): p for layer in layers for p in layer.parameters()}.values())


def torch_flops(spec: str, sample: str) -> float:
    """FlopCounterMode's count of one forward and backward of the whole model, built for real, on the sample."""
    torch.manual_seed(0)
    layers, _ = own.build_layers(spec, device="cpu")
    x, _ = own_model_memory.real_batch(sample, 2)
    # the decomposed kernels, which FlopCounterMode counts: the LSTM without oneDNN's fused mkldnn_rnn_layer, SDPA by
    # its math kernel (the fused CPU kernels are not in its table; the kit counts them by formula)
    with warnings.catch_warnings():  # mkldnn.flags sets oneDNN's TF32 switch too, and warns that it has no Intel GPU
        warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN", UserWarning)
        with torch.backends.mkldnn.flags(enabled=False), sdpa_kernel(SDPBackend.MATH), \
                FlopCounterMode(display=False) as counter:
            y = nn.Sequential(*layers)(x)
            y.float().pow(2).mean().backward()
    return float(counter.get_total_flops())


def family(name: str) -> list[dict]:
    """One row a part: the model's parameters and FLOPs (the kit's and torch's), the part's memory (the estimate and
    MemTracker's peak)."""
    spec, sample, sizes, chunks = ZOO[name]
    model = own.describe(spec, sample)
    layers, _ = own.build_layers(spec, device="meta")
    batch = own.sample_batch(sample)().shape[0]
    own_model_memory.MODELS[name] = (spec, sample)
    start = time.monotonic()
    parts = own_model_memory.compare(name, sizes, chunks, "fp32", False)
    seconds = time.monotonic() - start
    common = dict(family=name, params=sum(c.params for c in model.costs), torch_params=unique_params(layers),
                  flops=model.flops_per_sample * batch, torch_flops=torch_flops(spec, sample), sizes=sizes,
                  chunks=chunks, batch=batch, seconds=seconds)
    return [dict(common, **r) for r in parts]


def packaged() -> str | None:
    """Why the packaged families have no row here (torchvision or timm does not import beside this torch)."""
    try:
        import timm  # noqa: F401
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError) as exc:  # PyPI's CUDA torchvision beside a CPU torch: a RuntimeError
        return (f"{', '.join(PACKAGED)}: skipped, torchvision and timm do not import here ({exc}); they install "
                "beside torch 2.14.1 only (requirements-torch-2.14.1.txt's lane)")
    ZOO.update(PACKAGED)
    return None


def main(argv: list[str] | None = None) -> int:
    why_not = packaged()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=list(ZOO), help="these families only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start, rows = time.monotonic(), []
    for name in args.only or ZOO:
        rows += family(name)
    ratio = lambda a, b: f"{a / b:.3f}" if b else ("1 (both 0)" if not a else "torch 0")  # noqa: E731
    print(table([("family", "---", lambda r: r["family"]), ("layers per part", "---", lambda r: r["sizes"]),
                 ("params (kit)", "---:", lambda r: f"{r['params']:,}"),
                 ("params / numel", "---:", lambda r: ratio(r["params"], r["torch_params"])),
                 ("MFLOP (kit)", "---:", lambda r: f"{r['flops'] / 1e6:.2f}"),
                 ("FLOPs / FlopCounterMode", "---:", lambda r: ratio(r["flops"], r["torch_flops"])),
                 ("part", "---:", lambda r: r["part"]),
                 ("MemTracker KiB", "---:", lambda r: f"{r['measured'] / 1024:.0f}"),
                 ("estimate / MemTracker", "---:", lambda r: f"{r['ratio']:.3f}")], rows))
    if why_not:
        print(why_not)
    lo, hi = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    exact = all(r["params"] == r["torch_params"] for r in rows)
    print(f"\n{len(rows)} parts of {len({r['family'] for r in rows})} families: parameters "
          f"{'exact' if exact else 'NOT exact'}, memory estimate / MemTracker from {lo:.3f} to {hi:.3f} (target 0.90 "
          f"to 1.10); {time.monotonic() - start:.0f} s on torch {torch.__version__}")
    return 0 if exact and 0.9 <= lo and hi <= 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
