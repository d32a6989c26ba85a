"""The trainers' machinery and runtime, one concern a module: what bench_ddp_transformer.py and bench_stage.py need
beyond the page's code (docs/architecture.md). These modules import torch; the checker (check_topology.py) never
imports them, nor does any module of kit/. Order of imports, lowest first: signals (the standard library only: it
runs before torch is imported), errors, launch, pipe, options, setup, own, trainer, transformer, parts, checkpoint,
data, records, loop, replica, run."""
