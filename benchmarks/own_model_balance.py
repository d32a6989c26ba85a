#!/usr/bin/env python
"""The split balanced by FLOPs (kit.model's Model.sizes: the trainers' --split time) against the time each part really
takes, on this CPU: for three models the kit did not write for itself (tests/models_zoo.py: a convolutional stack, a
residual MLP with uneven blocks, and the kit's own Transformer built from the page's classes), every part of the
page's even split and of the balanced one is timed, forward and backward of one micro-batch on its real input,
median of --repeats, one thread. Target (issue 34): the balanced split's slowest part within 10 % of the mean part
time. "by measured time" is the best split of each layer's own measured time (what a profile of the layers would
give): how far any contiguous split can go, since a layer is not cut.

    python benchmarks/own_model_balance.py                 # the three models, nb_part 2 and 3
    python benchmarks/own_model_balance.py --repeats 30
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kit.own_model as own  # noqa: E402

ZOO = str(ROOT / "tests" / "models_zoo.py")
MODELS = {"conv stack": (f"{ZOO}:conv_stack", f"{ZOO}:conv_sample"),
          "residual MLP": (f"{ZOO}:residual_mlp", f"{ZOO}:mlp_sample"),
          "kit Transformer": (f"{ZOO}:kit_transformer", "8x64")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--nb-part", type=int, nargs="+", default=[2, 3])
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | nb_part | split | layers per part | part ms (fwd+bwd) | slowest / mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for name, (spec, sample) in MODELS.items():
        model = own.describe(spec, sample)  # its splits are the trainers' (kit.model)
        for nb_part in args.nb_part:
            layer_ms = own.layer_times(spec, sample, repeats=args.repeats)
            splits = {"even": model.sizes(nb_part), "balanced": model.sizes(nb_part, "time"),
                      "by measured time": model.sizes(nb_part, "time", times=layer_ms)}
            for kind, sizes in splits.items():
                ms = [t * 1e3 for t in own.layer_times(spec, sample, sizes, args.repeats)]
                ratio = max(ms) / statistics.mean(ms)
                worst = max(worst, ratio) if kind == "balanced" else worst
                print(f"| {name} | {nb_part} | {kind} | {sizes} | {', '.join(f'{t:.2f}' for t in ms)} | "
                      f"{ratio:.3f} |", flush=True)
    print(f"\nbalanced: the slowest part is at most {100 * (worst - 1):.1f} % above the mean part time "
          f"(target 10 %): {'met' if worst <= 1.10 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
