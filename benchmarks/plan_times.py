"""Planning time of the families of models users bring (issue 41, item 8): each model of tests/models_families.py
measured as the checker measures it (kit.measure_child.describe_isolated: a bounded child, cache cold, then warm),
with its layers, parameters, FLOPs per sample and how its layers were measured. The target: under 60 s cold on 2
cores, the LSTM included.

    python benchmarks/plan_times.py            # every family (GPT-2, BERT: skipped without transformers)
    python benchmarks/plan_times.py lstm unet  # some
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kit.measure_child import describe_isolated  # noqa: E402: after the path

FAMILIES = "tests/models_families.py"
CASES = {  # name -> (--model, --sample, what it is)
    "gpt2": ("gpt2", "tokens", "GPT-2 small (transformers), 8 x 512 tokens"),
    "bert": ("bert", "tokens", "BERT-base (transformers), 8 x 512 tokens"),
    "lstm": ("lstm", "tokens", "LSTM classifier (2 layers, hidden 1024), 8 x 512 tokens"),
    "gru": ("gru", "tokens", "GRU classifier (2 layers, hidden 1024), 8 x 512 tokens"),
    "encoder": ("encoder", "long_tokens", "8 nn.TransformerEncoderLayer (d 512), 2 x 4096 tokens"),
    "resnet": ("resnet", "images", "ResNet-50-like, 16 x 3 x 224 x 224"),
    "unet": ("unet", "unet_images", "U-Net-like (3 layers: stem, U, head), 8 x 3 x 256 x 256"),
}


def row(name: str) -> str:
    fn, sample, what = CASES[name]
    if name in ("gpt2", "bert") and importlib.util.find_spec("transformers") is None:
        return f"| {what} | skipped: transformers is not installed | | | | |"
    spec, sample = f"{ROOT / FAMILIES}:{fn}", f"{ROOT / FAMILIES}:{sample}"
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        t0 = time.perf_counter()
        model = describe_isolated(spec, sample)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        describe_isolated(spec, sample)
        warm = time.perf_counter() - t0
    kinds = ["fake" if c.how == "fake" else "real CPU" if c.how == "cpu" else "carried from 2-8 steps"
             for c in model.costs]
    how = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    missed = model.flops_missed() or "all counted"
    params = sum(c.params for c in model.costs)
    return (f"| {what} | {model.nlayers} ({how}) | {params / 1e6:.1f} M | {model.flops_per_sample / 1e9:.2f} | "
            f"{cold:.1f} | {warm:.1f} | {missed} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"some of {', '.join(CASES)} (default: all)")
    names = p.parse_args().names or list(CASES)
    if set(names) - set(CASES):
        p.error(f"{', '.join(sorted(set(names) - set(CASES)))}: not one of {', '.join(CASES)}")
    print("| model | layers (measured how) | parameters | GFLOP/sample (fwd+bwd) | cold s | warm s | FLOPs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name in names:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
