"""bench_ddp_transformer.py for real: several processes, gloo on the CPU, the script's own code paths.

Runs in both lanes: on current torch with fairscale, on torch 2.3 with the page's Pipe and with fairscale.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from launch import ROOT, TORCH, bench, clean_env, run_tasks, srun_envs

pytestmark = pytest.mark.multiproc

LEGACY_TORCH = TORCH <= (2, 3)
ENGINES = ["torch-pipe", "fairscale"] if LEGACY_TORCH else ["fairscale"]


def ok(results: list[subprocess.CompletedProcess]) -> str:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"rank {i} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return results[0].stdout


def epochs_of(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


# ---- training: several replicas, nb_part 2 ------------------------------------------------------------------------
# `core` (the matrix runs it on every release) on 2 tasks; the compat mark names the compatibility table's column
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.compat(f"replica {e}")) for e in ENGINES])
@pytest.mark.parametrize("ntasks", [pytest.param(2, marks=pytest.mark.core), 4])
def test_replicas_train_in_sync_and_learn(tmp_path, engine, ntasks):
    out = tmp_path / "runs.jsonl"
    batch = 64 // ntasks  # same global batch whatever the split
    t0 = time.monotonic()
    results = bench(["--engine", engine, "--synthetic", "2000", "--epochs", "2", "--batch-size", str(batch),
                     "--chunks", "2", "--nb-part", "2", "--cache-dir", str(tmp_path), "--json-out", str(out)],
                    ntasks=ntasks, nodes=2 if ntasks == 4 else 1)
    stdout = ok(results)
    assert time.monotonic() - t0 < 200
    [record] = epochs_of(out)
    assert (record["world_size"], record["nb_part"], record["engine"], record["nodes"]) == (ntasks, 2, engine,
                                                                                            2 if ntasks == 4 else 1)
    assert record["replica_divergence"] == 0.0  # DDP kept every replica's parameters identical
    losses = [e["loss"] for e in record["epochs"]]
    assert losses[1] < losses[0]
    assert record["test_acc"] > 0.9, record["epochs"]
    assert f"world size {ntasks}" in stdout and "nb_part 2" in stdout
    assert stdout.count("epoch   1 |") == 1
    for r in results[1:]:  # only rank 0 prints
        assert "epoch" not in r.stdout


# ---- the hybrid model computes what the plain model computes --------------------------------------------------------
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.compat(f"replica {e}")) for e in ENGINES])
@pytest.mark.parametrize("ntasks,chunks", [pytest.param(2, 4, marks=pytest.mark.core), (4, 1)])
def test_hybrid_equals_reference_model(tmp_path, engine, ntasks, chunks):
    args = ["--engine", engine, "--nlayers", "4", "--nb-part", "2", "--chunks", str(chunks), "--batch-size", "8",
            "--dropout", "0", "--seed", "7"]
    ok(run_tasks([str(ROOT / "tests" / "hybrid_step_worker.py"), str(tmp_path), *args], srun_envs(ntasks)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(ntasks)]

    # the reference: the same modules, same seed, one process, no Pipe, no DDP, the whole global batch
    sys.path.insert(0, str(ROOT / "tests"))
    import kit.arguments
    import kit.plan
    import kit.train.parts
    import kit.train.setup
    from hybrid_step_worker import global_batch
    cfg = kit.arguments.parse_trainer_args("replica", args)
    kit.train.setup.resolve(cfg, cuda=False)
    reference = torch.nn.Sequential(*kit.train.parts.model_parts(cfg, kit.plan.plan_task(0, 0, 0, 1, [], None,
                                                                                          cfg.nlayers, 2)))
    x, y = global_batch(cfg, ntasks)
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()

    mean_loss = sum(r["loss"] for r in ranks) / ntasks  # equal shards: mean of means = global mean
    torch.testing.assert_close(mean_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    expected = dict(reference.named_parameters())
    for r in ranks:
        assert r["grads"].keys() == expected.keys()
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)


# ---- IMDB from a folder or a tarball, cached ---------------------------------------------------------------------
def write_imdb(root: Path, per_class: int = 48) -> Path:
    """A small aclImdb tree with IMDB's layout and learnable reviews."""
    good = "A wonderful, moving film! The actors were <br /><br />brilliant and I loved it."
    bad = "An awful, boring movie... The plot was a waste of time; I hated it (really)."
    for split in ("train", "test"):
        for label, text in (("pos", good), ("neg", bad)):
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(f"{text} Review number {i}.")
    return root / "aclImdb"


@pytest.mark.parametrize("form", ["folder", "tar.gz"])
def test_imdb_is_read_tokenised_and_cached(tmp_path, form):
    folder = write_imdb(tmp_path / "data")
    data_dir = folder.parent
    if form == "tar.gz":
        tar_dir = tmp_path / "tar"
        tar_dir.mkdir()
        with tarfile.open(tar_dir / "aclImdb_v1.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname="aclImdb")
        data_dir = tar_dir
    cache = tmp_path / "cache"
    args = ["--data-dir", str(data_dir), "--cache-dir", str(cache), "--epochs", "2", "--batch-size", "8",
            "--nlayers", "2", "--seq-len", "32", "--lr", "3e-3"]
    first = ok(bench(args, ntasks=2))
    assert "tokenised 96+96 reviews" in first and "synthetic" not in first
    [cached] = list(cache.glob("imdb-*.pt"))
    stamp = cached.stat().st_mtime_ns
    second = ok(bench(args, ntasks=2))
    assert "tokenised" not in second  # every rank read the cache
    assert cached.stat().st_mtime_ns == stamp
    acc = float(re.findall(r"test acc (\d\.\d+)", second)[-1])
    assert acc > 0.9


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def test_save_is_the_pages_file_and_loads_back(tmp_path):
    ckpt = tmp_path / "model.pt"
    common = ["--synthetic", "800", "--cache-dir", str(tmp_path), "--nlayers", "4", "--batch-size", "16"]
    saved = ok(bench([*common, "--epochs", "1", "--save", str(ckpt)], ntasks=2))
    assert saved.count("checkpoint saved:") == 1  # rank 0 alone writes it
    import kit.arguments
    import kit.plan
    import kit.train.checkpoint
    import kit.train.setup
    import kit.train.transformer
    cfg = kit.arguments.parse_trainer_args("replica", common)
    kit.train.setup.resolve(cfg, False)
    # the page's two lines, on the plain nn.Sequential of the page's module_list: the file is the state_dict
    model = torch.nn.Sequential(*kit.train.transformer.module_list(cfg, kit.plan.plan_task(0, 0, 0, 1, [], None,
                                                                                            cfg.nlayers, 2)))
    model.load_state_dict(torch.load(ckpt))
    assert "0.0.embedding.weight" in torch.load(ckpt) and not any(k.startswith("module.") for k in torch.load(ckpt))
    resume = torch.load(kit.train.checkpoint.resume_file(ckpt), weights_only=False)  # what resuming needs, beside it
    assert (resume["epoch"], resume["batch_in_epoch"], resume["layout"]["nb_part"]) == (1, 0, 2)
    assert len(resume["optimizer"]["state"]) == len(list(model.parameters())) and len(resume["rng"]) == 2
    assert sorted(p.name for p in tmp_path.glob("*model.pt*")) == ["model.pt", "model.pt.resume.pt"]  # no temp

    # the Pipe model loaded from it computes what the plain model does
    code = f"""
import sys, torch; sys.path.insert(0, {str(ROOT)!r})
import kit.arguments, kit.plan, kit.train.parts, kit.train.pipe, kit.train.setup
cfg = kit.arguments.parse_trainer_args('replica', {common!r}); kit.train.setup.resolve(cfg, False)
plan = kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers, 2)
model = kit.train.pipe.PipeModel(kit.train.parts.model_parts(cfg, plan), 'fairscale', 2, ['cpu', 'cpu'])
model.load_state_dict(torch.load({str(ckpt)!r}))
x = torch.randint(0, cfg.vocab_size, (6, cfg.seq_len), generator=torch.Generator().manual_seed(0))
model.eval(); torch.save(model(x).detach(), {str(tmp_path / 'out.pt')!r}); model.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=clean_env(), timeout=120)
    model.eval()
    x = torch.randint(0, cfg.vocab_size, (6, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), model(x).detach())

    # every rank loads; training continues from the saved epoch
    resumed = ok(bench([*common, "--epochs", "2", "--load", str(ckpt)], ntasks=2))
    assert f"loaded {ckpt}: epoch 1" in resumed and "epoch   2 |" in resumed and "epoch   1 |" not in resumed

    # another split is refused, clearly, by every rank, before training
    [bad] = bench([*common, "--epochs", "2", "--load", str(ckpt), "--nb-part", "4"])
    assert bad.returncode == 1
    assert "saved with another layout: nb_part 2 (now 4)" in bad.stderr and "--nb-part 2" in bad.stderr

    # a file the page wrote (no companion): its weights, a fresh optimizer, from epoch 0
    page_file = tmp_path / "page.pt"
    torch.save(model.state_dict(), page_file)
    page = ok(bench([*common, "--epochs", "1", "--load", str(page_file)]))
    assert "weights only" in page and "epoch   1 |" in page

    # a model file that is not the one its companion was written with is refused, not mixed
    torch.save({k: v + 1 for k, v in torch.load(ckpt).items()}, ckpt)
    [mixed] = bench([*common, "--epochs", "2", "--load", str(ckpt)])
    assert mixed.returncode == 1 and "come from different saves" in mixed.stderr, mixed.stderr


# ---- bad input: one clear line, non-zero exit, nothing half-written ------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--data-dir", "/nonexistent/imdb"], "--data-dir /nonexistent/imdb does not exist"),
    (["--chunks", "6", "--batch-size", "64"],
     "--chunks=6 must divide the batch size per replica (64): the micro-batches would differ in size; try --chunks 4 or 8"),
    (["--nlayers", "1", "--nb-part", "2"], "--nlayers=1 < nb_part=2"),
    (["--save", "/sys/ckpt.pt"], "--save /sys/ckpt.pt: cannot write in /sys"),
    (["--save", "/nonexistent/dir/ckpt.pt"], "folder /nonexistent/dir does not exist"),
    (["--engine", "torch-pipe"] if not LEGACY_TORCH else ["--d-model", "30", "--n-head", "4"],
     "--engine torch-pipe needs torch <= 2.3" if not LEGACY_TORCH else "--d-model (30) must be a multiple"),
])
def test_bad_input_fails_clearly(tmp_path, args, needle):
    [r] = bench([*args, "--cache-dir", str(tmp_path)], timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and "idr_torch:" not in line]
    assert len(lines) == 1 and lines[0].startswith("bench_ddp_transformer: error:"), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written: no cache, no checkpoint


def test_empty_data_dir_and_no_batch(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    [r] = bench(["--data-dir", str(empty), "--cache-dir", str(tmp_path)], timeout=60)
    assert r.returncode == 1 and "holds neither aclImdb/" in r.stderr
    [r] = bench(["--synthetic", "40", "--batch-size", "64", "--cache-dir", str(tmp_path)], timeout=60)
    assert r.returncode == 1 and "give no full batch of 64" in r.stderr


# ---- the main job: `make run` ----------------------------------------------------------------------------------------
def test_default_run_learns_the_synthetic_task(tmp_path):
    t0 = time.monotonic()
    # as `make run` runs it: torch's own thread count (the other tests pin OMP_NUM_THREADS=1, which made this run
    # 105-180 s on 2 cores); the timeout only guards a hang (CI's machine showed 7-23 % CPU steal)
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, str(ROOT / "bench_ddp_transformer.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no IMDB data" in r.stdout and "synthetic reviews" in r.stdout
    assert len(re.findall(r"^epoch +\d+ \|", r.stdout, re.M)) == 3
    assert "summary:" in r.stdout
    assert float(re.findall(r"final test acc (\d\.\d+)", r.stdout)[0]) > 0.8  # chance is 0.5
    print(f"default run: {time.monotonic() - t0:.1f}s")


# ---- teardown: the Pipe's worker threads never outlive main() -------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_pipe_workers_stop_and_the_process_exits(engine):
    # A forward whose output is dropped without backward used to leave fairscale's worker thread running into
    # interpreter shutdown, which aborted the process ("terminate called without an active exception") 4 times
    # out of 4 on torch 2.13; a Pipe never torn down hangs instead. Several tries: it was a race.
    code = f"""
import sys, threading, torch; sys.path.insert(0, {str(ROOT)!r})
import kit.arguments, kit.plan, kit.train.parts, kit.train.pipe, kit.train.setup
rpc = kit.train.pipe.init_rpc_for_pipe() if {engine!r} == 'torch-pipe' else None
cfg = kit.arguments.parse_trainer_args('replica', []); kit.train.setup.resolve(cfg, False)
plan = kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers)
model = kit.train.pipe.PipeModel(kit.train.parts.model_parts(cfg, plan), {engine!r}, 2, ['cpu', 'cpu'])
assert model.workers, 'the Pipe started no worker thread'
model.eval(); model(torch.randint(0, 100, (4, cfg.seq_len))).detach()
model.close()
assert threading.enumerate() == [threading.main_thread()], threading.enumerate()
if rpc is not None:
    torch.distributed.rpc.shutdown()
print('closed')
"""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "closed", r.stderr[-2000:]
