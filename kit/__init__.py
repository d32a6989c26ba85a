"""The kit's modules, one concern each (docs/architecture.md has the map and how a job script and a training run flow
through them). The entry points stay beside this folder: check_topology.py (the checker's command line),
bench_ddp_transformer.py and bench_stage.py (the page's trainers), idr_torch.py (the environment).

The checker's modules import no torch: `python check_topology.py job.slurm` stays well under a second on a login node.
The trainers' machinery (kit/train/) imports torch and is imported only by the trainers, the benchmarks and the
tests, never by a module of kit/ itself; kit.own_model imports torch too, only for `--model` (python -m kit.own_model).
"""
