"""The page's closing techniques as trainer options, for real: several processes, gloo on the CPU.

--zero: the same parameters and optimizer state as plain AdamW, and checkpoints that load with or without it;
--activation-checkpointing: the same loss and gradients as the plain model (fp32 and bf16);
--precision bf16 / fp16 (GradScaler): no equality to hold, so the model must learn; the checkpoint holds fp32
weights that load into any precision.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from launch import ROOT, bench, run_tasks, srun_envs

pytestmark = pytest.mark.multiproc

# small and exact: no dropout (its masks would differ between the runs compared), 4 layers over 2 parts (the CPU
# default nb_part, or --pp 2)
SMALL = ["--nlayers", "4", "--chunks", "2", "--batch-size", "8", "--dropout", "0", "--seed", "7",
         "--d-model", "32", "--d-hid", "64", "--seq-len", "32", "--vocab-size", "500"]


def ok(results: list[subprocess.CompletedProcess]) -> str:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"rank {i} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return results[0].stdout


def saved_model(path: Path) -> dict[str, torch.Tensor]:
    """The --save file: what the page loads with model.load_state_dict(torch.load(path))."""
    return torch.load(path, weights_only=True)


def resume_state(path: Path) -> dict:
    """What --resume reads besides the model (its companion file): optimizer (and GradScaler), epoch, step."""
    import kit.train.checkpoint
    import kit.train.options
    import kit.train.setup
    return torch.load(kit.train.checkpoint.resume_file(str(path)), weights_only=False)


def replica(args: list[str]) -> torch.nn.Sequential:
    """The trainer's replica before any step (its modules, its seed), in this process."""
    import kit.arguments
    import kit.plan
    import kit.train.parts
    import kit.train.setup
    cfg = kit.arguments.parse_trainer_args("replica", args)
    kit.train.setup.resolve(cfg, cuda=False)
    return torch.nn.Sequential(*kit.train.parts.model_parts(cfg, kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers,
                                                                                     cfg.nb_part)))


def initial_model(args: list[str]) -> dict[str, torch.Tensor]:
    return replica(args).state_dict()


def checkpointed_layers(args: list[str]) -> int:
    import kit.train.transformer
    return sum(isinstance(m, kit.train.transformer.CheckpointedLayer) for m in replica(args).modules())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-6,
                atol: float = 1e-7) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


# ---- --zero ----------------------------------------------------------------------------------------------------
def test_zero_equals_adamw_and_its_checkpoints_load_either_way(tmp_path):
    common = [*SMALL, "--synthetic", "200", "--cache-dir", str(tmp_path), "--epochs", "1", "--max-steps", "4"]
    outs = {}
    for name, extra in (("plain", []), ("zero", ["--zero"])):
        outs[name] = ok(bench([*common, *extra, "--save", str(tmp_path / f"{name}.pt")], ntasks=2))
    assert "ZeroRedundancyOptimizer" in outs["zero"] and "ZeroRedundancyOptimizer" not in outs["plain"]
    plain, zero = saved_model(tmp_path / "plain.pt"), saved_model(tmp_path / "zero.pt")
    assert any(not torch.equal(plain[k], initial_model(common)[k]) for k in plain)  # 4 steps moved the weights
    assert_same(zero, plain)
    # the optimizer state, consolidated on rank 0, is plain AdamW's: same layout, same numbers
    p_opt, z_opt = (resume_state(tmp_path / f"{n}.pt")["optimizer"] for n in ("plain", "zero"))
    assert z_opt["param_groups"] == p_opt["param_groups"] and z_opt["state"].keys() == p_opt["state"].keys()
    for i, s in p_opt["state"].items():
        assert_same(z_opt["state"][i], s)

    # each loads the other way round; 2 more steps each, from the same state, give the same parameters
    more = [*common[:-4], "--epochs", "2", "--max-steps", "6"]
    ok(bench([*more, "--load", str(tmp_path / "zero.pt"), "--save", str(tmp_path / "a.pt")], ntasks=2))
    ok(bench([*more, "--zero", "--load", str(tmp_path / "plain.pt"), "--save", str(tmp_path / "b.pt")], ntasks=2))
    a, b = saved_model(tmp_path / "a.pt"), saved_model(tmp_path / "b.pt")
    assert any(not torch.equal(a[k], plain[k]) for k in a)
    assert_same(a, b)


# ---- --activation-checkpointing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_gives_the_plain_loss_and_gradients(tmp_path, precision):
    """One training step of the hybrid model (Pipe + DDP, 2 processes) with and without checkpointing: the
    recomputation runs the same operations under the same autocast, so loss and gradients are equal."""
    got = {}
    for name, extra in (("plain", []), ("ckpt", ["--activation-checkpointing"])):
        out = tmp_path / name
        out.mkdir()
        args = [*SMALL, "--precision", precision, *extra]
        ok(run_tasks([str(ROOT / "tests" / "hybrid_step_worker.py"), str(out), *args], srun_envs(2)))
        got[name] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
        assert checkpointed_layers(args) == (4 if extra else 0)  # the option really wrapped every Layer
    for plain, ckpt in zip(got["plain"], got["ckpt"]):
        torch.testing.assert_close(ckpt["loss"], plain["loss"], rtol=1e-6, atol=1e-7)
        assert_same(ckpt["grads"], plain["grads"], rtol=1e-5, atol=1e-7)
        assert all(g.abs().sum() > 0 for g in plain["grads"].values() if g.numel() > 2)


# ---- --precision -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,other", [("bf16", "fp16"), ("fp16", "fp32")])
def test_mixed_precision_learns_and_saves_fp32_weights(tmp_path, precision, other):
    ckpt, out = tmp_path / "model.pt", tmp_path / "runs.jsonl"
    common = ["--synthetic", "1000", "--cache-dir", str(tmp_path), "--batch-size", "16", "--chunks", "2",
              "--lr", "3e-3", "--d-model", "32", "--d-hid", "64", "--seq-len", "32"]  # narrow: autocast is slow on CPU
    stdout = ok(bench([*common, "--epochs", "2", "--precision", precision, "--save", str(ckpt), "--json-out",
                       str(out)], ntasks=2, timeout=480))
    assert f"precision {precision}" in stdout
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["precision"] == precision and record["replica_divergence"] == 0.0
    losses = [e["loss"] for e in record["epochs"]]
    # chance is 0.5. The figure is the machine's: fp16 gave exactly 0.8 on this AMD EPYC VM, run after run, where the
    # same test and wheel gave more on the previous machine (its CI passed); "learns" is well above chance
    assert losses[1] < losses[0] and record["test_acc"] > 0.7, record["epochs"]
    # autocast computes in low precision from fp32 weights: the file holds fp32, as the page's would
    model = saved_model(ckpt)
    assert {v.dtype for v in model.values() if v.is_floating_point()} == {torch.float32}
    scaler = resume_state(ckpt)["optimizer"].get("grad_scaler")
    assert (scaler is not None and scaler["scale"] > 0) == (precision == "fp16")  # fp16 came with a GradScaler
    # and it goes on in another precision (two more steps)
    steps = record["epochs"][-1]["steps"] * 2
    resumed = ok(bench([*common, "--epochs", "3", "--max-steps", str(steps + 2), "--precision", other, "--load",
                        str(ckpt)], ntasks=2, timeout=480))
    assert f"loaded {ckpt}: epoch 2" in resumed and f"precision {other}" in resumed and "epoch   3 |" in resumed


# ---- the stage layout (bench_stage.py) -------------------------------------------------------------------------
def test_stage_layout_with_zero_and_checkpointing_equals_the_plain_replica_run(tmp_path):
    """The options apply per stage there (ZeRO over each stage's dp group): 2 pipelines x pp 2 with --zero and
    --activation-checkpointing end where the plain replica layout's 2 replicas end after the same 4 steps, and
    the consolidated checkpoint has the replica layout's keys and AdamW's layout."""
    common = [*SMALL, "--synthetic", "200", "--cache-dir", str(tmp_path), "--epochs", "1", "--max-steps", "4"]
    ok(bench(["--nb-part", "2", *common, "--save", str(tmp_path / "replica.pt")], ntasks=2))
    stdout = ok(bench(["--pp", "2", "--schedule", "gpipe", *common, "--zero", "--activation-checkpointing",
                       "--save", str(tmp_path / "stage.pt")], ntasks=4, script="bench_stage.py"))
    assert "ZeroRedundancyOptimizer(AdamW) over 2 replica(s)" in stdout and "activation checkpointing on" in stdout
    stage, plain = saved_model(tmp_path / "stage.pt"), saved_model(tmp_path / "replica.pt")
    # The key third of in_proj_bias gets no gradient in exact arithmetic (softmax ignores a shift), so each
    # layout's rounding noise there, normalised by Adam, moves it by up to lr per step (seen: 1.5e-4 after 4
    # steps, every other value within 1e-6): left out of the comparison.
    d = 32  # SMALL's --d-model
    for k in [k for k in plain if k.endswith("in_proj_bias")]:
        stage[k], plain[k] = torch.cat([stage[k][:d], stage[k][2 * d:]]), torch.cat([plain[k][:d], plain[k][2 * d:]])
    assert_same(stage, plain, rtol=1e-5, atol=1e-6)
    stage_opt = resume_state(tmp_path / "stage.pt")["optimizer"]
    replica_opt = resume_state(tmp_path / "replica.pt")["optimizer"]
    assert stage_opt["state"].keys() == replica_opt["state"].keys()


def test_fp16_is_refused_where_no_gradscaler_can_go(tmp_path):
    [r, *_] = bench(["--pp", "2", "--precision", "fp16", "--cache-dir", str(tmp_path)], ntasks=2, timeout=90,
                    script="bench_stage.py")
    assert r.returncode == 1 and "fp16-stage: --precision fp16 needs a GradScaler" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
