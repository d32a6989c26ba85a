"""slurm/report.py on known records, and the local CPU sweep end to end (make sweep at small scale)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from launch import ROOT, clean_env

sys.path.insert(0, str(ROOT / "slurm"))
import report  # noqa: E402


def record(tasks, nb_part, batch, chunks, sps, layout="replica", acc=0.9, **options):
    return {"device": "cuda", "tasks": tasks, "nb_part": nb_part, "batch_size": batch, "chunks": chunks,
            "samples_per_s": sps, "epoch_time_s": 10.0, "peak_gpu_mem_gb": 3.5, "test_acc": acc, "layout": layout,
            "gpus": tasks if layout == "stage" else tasks * nb_part, "engine": "fairscale", "torch": "2.13.0",
            **options}


def test_table_merges_repeats_and_names_regimes(tmp_path):
    runs = tmp_path / "runs.jsonl"
    rows = [record(1, 4, 128, 4, 100.0), record(1, 4, 128, 4, 120.0), record(1, 4, 128, 4, 300.0),
            record(2, 2, 64, 2, 250.0), record(4, 1, 32, 1, 400.0), record(4, 2, 64, 4, 380.0, layout="stage")]
    runs.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    r = subprocess.run([sys.executable, str(ROOT / "slurm" / "report.py"), str(runs), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "runs.jsonl:7: skipped" in r.stderr  # the broken line is named, not fatal
    md = (tmp_path / "out" / "sweep.md").read_text()
    # median of 100, 120, 300; records without the options ran without them
    assert "| 1 | 4 | pure model parallel | 32 | 128 | 4 | fp32 | no | no | 120.0 | 3.50 |" in md
    assert "| 2 | 2 | hybrid | 32 | 64 | 2 | fp32 | no | no | 250.0 |" in md
    assert "| 4 | 1 | pure data parallel | 32 | 32 | 1 | fp32 | no | no | 400.0 |" in md
    assert "stage: pp 2 x dp 2" in md
    assert "Fastest: 4 task(s) x nb_part 1 (pure data parallel)" in md
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert len(list(csv.DictReader(f))) == 4


def test_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (plots only) and not installed here")
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(json.dumps(r) for r in [record(2, 2, 64, 2, 250.0), record(4, 1, 32, 1, 400.0)]))
    assert report.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 10_000


def test_options_are_columns_with_memory_beside_throughput(tmp_path):
    runs = tmp_path / "runs.jsonl"
    plain = record(2, 2, 64, 2, 250.0, precision="fp32", activation_checkpointing=False, zero=False,
                   estimated_mem_gb=9.0)
    cheap = dict(record(2, 2, 64, 2, 210.0, precision="bf16", activation_checkpointing=True, zero=True,
                        estimated_mem_gb=4.25), peak_gpu_mem_gb=4.0)
    runs.write_text(json.dumps(plain) + "\n" + json.dumps(cheap) + "\n")
    assert report.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "sweep.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| ntasks"))
    assert "| precision | act. ckpt | zero | samples/s | peak GPU mem (GiB) | estimate (GiB/GPU) |" in header
    assert "| 2 | 2 | hybrid | 32 | 64 | 2 | fp32 | no | no | 250.0 | 3.50 | 9.00 |" in md  # not merged together
    assert "| 2 | 2 | hybrid | 32 | 64 | 2 | bf16 | yes | yes | 210.0 | 4.00 | 4.25 |" in md
    with open(tmp_path / "out" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["precision"], r["activation_checkpointing"], r["zero"], r["estimated_mem_gb"]) for r in rows) \
        == [("bf16", "True", "True", "4.25"), ("fp32", "False", "False", "9.0")]
    cpu = dict(plain, device="cpu", peak_gpu_mem_gb=None, host_rss_gb=0.75)
    runs.write_text(json.dumps(cpu) + "\n")
    assert report.main([str(runs), "--out", str(tmp_path / "cpu")]) == 0
    md = (tmp_path / "cpu" / "sweep.md").read_text()
    assert "| host RSS (GiB) |" in md and "| 250.0 | 0.75 | 9.00 |" in md  # a CPU run has no GPU peak to show


def test_no_matplotlib_still_writes_tables(tmp_path, monkeypatch):
    runs = tmp_path / "runs.jsonl"
    runs.write_text(json.dumps(record(2, 2, 64, 2, 250.0)) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "sweep.md").exists() and not (tmp_path / "out" / "throughput.png").exists()


def test_empty_results_fail_clearly(tmp_path, capsys):
    runs = tmp_path / "empty.jsonl"
    runs.write_text("")
    assert report.main([str(runs), "--out", str(tmp_path / "out")]) == 1
    assert "no usable result" in capsys.readouterr().err


@pytest.mark.multiproc
def test_local_sweep_end_to_end(tmp_path):
    results = tmp_path / "cpu.jsonl"
    env = clean_env(PYTHON=sys.executable, TASKS="1 2", BATCH_PER_PART="8", CHUNKS="1 2", STAGE_PP="2",
                    SYNTHETIC="300", MODEL="--nlayers 4 --d-model 32 --n-head 4 --d-hid 64 --seq-len 32")
    r = subprocess.run(["bash", str(ROOT / "slurm" / "sweep_local.sh"), str(results)], env=env, capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    got = sorted((x.get("layout", "replica"), x["tasks"], x["nb_part"], x["chunks"]) for x in lines)
    expect = [("replica", 1, 4, 1), ("replica", 1, 4, 2), ("replica", 2, 2, 1), ("replica", 2, 2, 2)]
    import importlib.util
    if importlib.util.find_spec("torch.distributed.pipelining"):
        expect.append(("stage", 4, 2, 2))
    assert got == sorted(expect)
    assert {(x["d_model"], x["seq_len"]) for x in lines} == {(32, 32)}  # MODEL reached every run, the stage's too
    assert report.main([str(results), "--out", str(tmp_path / "out")]) == 0
    # matplotlib is optional (the torch 2.3 lane has none): tables always, the plot where it imports
    assert (tmp_path / "out" / "throughput.png").exists() == bool(importlib.util.find_spec("matplotlib"))
