"""What the H200 run showed (../shared/evidence/h200-2026-12-04/, issue 31), held on the CPU: the defaults learn at
the GPU's width, the step makes no host sync, the summary gives the distance to the physical limit, and a run that
ends at chance says so. Each test here failed on the kit before these fixes (862cbf3)."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, bench, clean_env

sys.path.insert(0, str(ROOT))
import kit.train.transformer as trainer  # noqa: E402 (the page's model: bench_ddp_transformer.py's)
import kit.train.checkpoint  # noqa: E402
import kit.train.loop  # noqa: E402
import kit.arguments  # noqa: E402
import kit.speed  # noqa: E402

pytestmark = pytest.mark.multiproc


def running_losses(stdout: str) -> list[float]:
    """The running mean loss of every progress line ('  epoch 1 step 3/50 loss 0.7012 (4s)')."""
    return [float(m) for m in re.findall(r"step \d+/\d+ loss ([0-9.]+|nan|inf)", stdout)]


def record(path: Path) -> dict:
    [line] = path.read_text().splitlines()
    return json.loads(line)


# ---- the defaults learn at every width ---------------------------------------------------------------------------
# The GPU's model (d_model 1024, d_hid 4096, dropout 0.1) at its default lr, 2 layers and short reviews so that the CPU
# runs it in a minute. At 862cbf3's lr (1e-3, lr x d_model about 1, no warmup) the running loss went to 2-9 within a
# few steps and the test accuracy to 0.500; at the width's default (1e-4) and its warmup it stays near chance's 0.69.
WIDE = ["--d-model", "1024", "--n-head", "16", "--d-hid", "4096", "--dropout", "0.1", "--nlayers", "2",
        "--seq-len", "16", "--vocab-size", "2000", "--batch-size", "16", "--nb-part", "1", "--synthetic", "800"]


def test_the_gpu_width_at_its_default_lr_stays_stable(tmp_path):
    [r] = bench([*WIDE, "--epochs", "1", "--max-steps", "8", "--log-every", "0", "--json-out",
                 str(tmp_path / "r.jsonl")],
                timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = running_losses(r.stdout)
    assert len(losses) >= 6, r.stdout[-2000:]
    assert max(losses) < 0.69 + 0.15, f"the running loss left chance's 0.69 for {max(losses):.2f}: {losses}"
    rec = record(tmp_path / "r.jsonl")
    assert rec["lr"] == pytest.approx(kit.arguments.default_lr(1024)) and rec["architecture"] == kit.train.checkpoint.ARCHITECTURE


def test_a_narrow_model_at_the_gpu_defaults_lr_times_width_learns(tmp_path):
    """lr x d_model is what collapsed the GPU model: the CPU's narrow model at the GPU default's product must learn."""
    gpu_lr = kit.arguments.ARG["lr"].gpu or kit.arguments.default_lr(kit.arguments.GPU_DEFAULTS["d_model"])
    lr = gpu_lr * kit.arguments.GPU_DEFAULTS["d_model"] / kit.arguments.CPU_DEFAULTS["d_model"]
    [r] = bench(["--synthetic", "2000", "--epochs", "2", "--lr", f"{lr:g}", "--json-out", str(tmp_path / "r.jsonl")],
                timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = record(tmp_path / "r.jsonl")
    assert rec["test_acc"] > 0.8 and rec["learned"] is True, (lr, rec["test_acc"], r.stdout[-1500:])
    assert rec["chance_acc"] == pytest.approx(0.5, abs=0.1)
    # the distance to the physical limit: the model's FLOPs from its shapes, the TFLOP/s reached (no peak on a CPU)
    model = {k: rec[k] for k in ("d_model", "d_hid", "seq_len", "nlayers")}
    assert rec["flops_per_sample"] == kit.speed.flops_per_sample(model)
    assert rec["tflops"] == pytest.approx(rec["flops_per_sample"] * rec["samples_per_s"] / 1e12)
    assert rec["peak_share"] is None and rec["tflops_per_gpu"] is None
    assert re.search(r"samples/s \(best epoch\), [0-9.e-]+ TFLOP/s, final test acc", r.stdout), r.stdout[-800:]
    assert "did not learn" not in r.stdout


def test_a_run_that_ends_at_chance_says_so(tmp_path):
    [r] = bench(["--synthetic", "400", "--epochs", "1", "--max-steps", "3", "--lr", "1e-9",
                 "--json-out", str(tmp_path / "r.jsonl")], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = record(tmp_path / "r.jsonl")
    assert rec["learned"] is False and rec["test_acc"] <= rec["chance_acc"] + 0.1
    warning = [line for line in r.stdout.splitlines() if "did not learn" in line]
    assert len(warning) == 1 and "lower --lr (now 1e-09)" in warning[0], r.stdout[-1500:]


# ---- the learning-rate schedule ----------------------------------------------------------------------------------
def schedule(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"lr": 1e-3, "lr_warmup": 0.1, "lr_decay": "linear", **kw})


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_the_lr_warms_up_then_decays_to_a_tenth(decay):
    cfg, total = schedule(lr_decay=decay), 100
    lrs = [kit.train.loop.lr_at(cfg, s, total) for s in range(total)]
    assert all(0 < a < b for a, b in zip(lrs[:10], lrs[1:11])), lrs[:12]  # rises over the first 10 % of the steps
    assert lrs[10] == pytest.approx(1e-3) and max(lrs) == pytest.approx(1e-3)
    assert all(a > b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(kit.train.loop.LR_FLOOR * 1e-3)
    assert kit.train.loop.lr_at(schedule(lr_decay="none", lr_warmup=0.0), 57, total) == 1e-3


def test_the_default_lr_falls_with_the_width():
    assert kit.arguments.default_lr(64) == 0.1 / 64 and kit.arguments.default_lr(1024) == pytest.approx(1e-4 * 0.9765625)
    assert kit.arguments.default_lr(8) == kit.arguments.MAX_DEFAULT_LR
    ns = argparse.Namespace(d_model=1024, lr=None)
    assert kit.arguments.resolve_defaults(ns, cuda=True).lr == kit.arguments.default_lr(1024)
    assert kit.arguments.resolve_defaults(argparse.Namespace(d_model=1024, lr=3e-5), cuda=True).lr == 3e-5


def test_the_renamed_timing_option_is_refused_with_its_new_name(tmp_path):
    [r] = bench(["--warmup-steps", "3"], timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--warmup-steps is now --untimed-steps" in lines[0] and "--lr-warmup" in lines[0]


# ---- no host sync in the step ------------------------------------------------------------------------------------
def test_the_step_builds_nothing_from_host_data_and_reads_nothing_back(tmp_path):
    """tests/host_sync_worker.py records, op by op, what the trainer's own train_step and eval_step run: no tensor
    from host data (a host-to-device copy that waits, on a GPU) and no value read back (.item())."""
    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "host_sync_worker.py"), str(out), "--synthetic", "200"],
                       env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen["ops"] == [], seen["ops"]
    assert seen["stats"][2] == 32 and seen["eval"][1] == 32  # the step's statistics are still there


# ---- FLOPs and peaks ---------------------------------------------------------------------------------------------
def test_flops_per_sample_is_what_torch_counts():
    from torch.utils.flop_counter import FlopCounterMode
    model = dict(d_model=64, n_head=4, d_hid=96, seq_len=24, nlayers=3, vocab_size=100)
    net = torch.nn.Sequential(trainer.Encoder(100, 64, 0.1, 24),
                              *[trainer.Layer(64, 4, 96, 0.1) for _ in range(3)], trainer.Decoder(64, 96))
    x = torch.randint(0, 100, (5, 24))
    with FlopCounterMode(display=False) as counter:
        net(x).float().sum().backward()
    assert counter.get_total_flops() / 5 == pytest.approx(kit.speed.flops_per_sample(model), rel=1e-6)


@pytest.mark.parametrize("name,precision,tf32,peak", [
    ("NVIDIA H200", "bf16", False, 989.0), ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 495.0), ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("Tesla V100-SXM2-32GB", "fp16", False, 125.0), ("Tesla V100-SXM2-32GB", "bf16", False, None),
    ("Tesla V100-SXM2-32GB", "fp32", True, 15.7), ("NVIDIA GeForce RTX 3090", "fp32", False, None)])
def test_the_peak_of_each_gpu_for_its_precision(name, precision, tf32, peak):
    assert kit.speed.peak_tflops(name, precision, tf32) == peak


def test_tf32_is_an_option_the_checker_knows(tmp_path):
    from test_arguments import check_line, codes
    status, _, found = check_line(tmp_path, "srun python bench_ddp_transformer.py --tf32 --nlayers 8 --d-model 512")
    assert "tf32-on-v100" in codes(found) and "bad-argument" not in codes(found), found
    status, _, found = check_line(tmp_path, "srun python bench_ddp_transformer.py --nlayers 8 --d-model 512")
    assert "tf32-on-v100" not in codes(found)


def test_a_new_lr_on_resume_is_applied_and_recorded(tmp_path):
    """--lr given again on --resume trains at the new rate (AdamW's state used to bring back its own), the schedule
    going on from the saved step; the record and the saved optimizer say the rate that ran."""
    args = ["--synthetic", "400", "--batch-size", "16", "--nlayers", "2", "--cache-dir", str(tmp_path),
            "--save", str(tmp_path / "ck.pt")]
    [first] = bench([*args, "--epochs", "1", "--lr", "1e-3"])
    assert first.returncode == 0, first.stderr[-2000:]
    per_epoch = int(re.search(r"(\d+) steps per epoch", first.stdout)[1])
    [again] = bench([*args, "--epochs", "2", "--lr", "5e-4", "--resume", "--json-out", str(tmp_path / "r.jsonl")])
    assert again.returncode == 0, again.stderr[-2000:]
    rec = record(tmp_path / "r.jsonl")
    cfg = schedule(lr=5e-4, lr_warmup=kit.arguments.ARG["lr_warmup"].gpu, lr_decay=kit.arguments.ARG["lr_decay"].gpu)
    expected = kit.train.loop.lr_at(cfg, 2 * per_epoch - 1, 2 * per_epoch)
    assert rec["lr"] == 5e-4 and rec["epochs"][-1]["lr"] == pytest.approx(expected)
    companion = torch.load(tmp_path / "ck.pt.resume.pt", weights_only=True)
    assert [g["lr"] for g in companion["optimizer"]["param_groups"]] == [pytest.approx(expected)]


def test_a_checkpoint_of_the_older_architecture_is_refused_in_one_line(tmp_path):
    """post-ln/1 scaled the embedding by sqrt(d_model): its weights load into today's model under the same keys and
    mean something else, so its companion (which has no architecture, or another) is refused."""
    args = ["--synthetic", "200", "--batch-size", "16", "--nlayers", "2", "--cache-dir", str(tmp_path),
            "--save", str(tmp_path / "ck.pt"), "--epochs", "1"]
    [first] = bench(args)
    assert first.returncode == 0, first.stderr[-2000:]
    companion = tmp_path / "ck.pt.resume.pt"
    state = torch.load(companion, weights_only=True)
    del state["layout"]["architecture"]  # as 862cbf3 wrote it
    torch.save(state, companion)
    [again] = bench([*args, "--epochs", "2", "--resume"])
    lines = [line for line in again.stderr.splitlines() if line.startswith("bench_ddp_transformer:")]
    assert again.returncode != 0 and len(lines) == 1 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert "architecture post-ln/1" in lines[0] and kit.train.checkpoint.ARCHITECTURE in lines[0] and "start afresh" in lines[0]
