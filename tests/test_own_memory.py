"""The per-GPU peak of a user's model (issue 34, kit/layer_memory.py): against MemTracker on a real CPU step of the
zoo's models (benchmarks/own_model_memory.py's --quick rows), the kit's own Transformer through --model equal to
kit.memory's estimate to the byte and the generic composition of its layers within the band of kit.memory's tape,
and --advise over a user's model's splits."""
from __future__ import annotations

import subprocess
import sys

import pytest

import kit.advise
import kit.arguments
import kit.layer_memory as lm
import kit.memory
import kit.model
import kit.own_model as own
import kit.plan
from launch import ROOT, clean_env

sys.path.insert(0, str(ROOT / "benchmarks"))
ZOO = str(ROOT / "tests" / "models_zoo.py")
MLP = (f"{ZOO}:residual_mlp", f"{ZOO}:mlp_sample")
KIT = (f"{ZOO}:kit_transformer", "8x64")
HIGH, LOW = 0.10, 0.05  # the kit's memory band (benchmarks/memory_grid.py): within 10 %, never 5 % low

try:
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401  torch >= 2.5
    HAS_MEMTRACKER = True
except ImportError:
    HAS_MEMTRACKER = False


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.skipif(not HAS_MEMTRACKER, reason="MemTracker exists from torch 2.5 on")
@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r[0]}-{r[1]}-{r[2]}-{r[3]}{'-ckpt' if r[4] else ''}")
                                 for r in [("conv", [3, 3], 4, "fp32", False), ("conv", [2, 4], 2, "bf16", True),
                                           ("mlp", [3, 7], 4, "bf16", False), ("mlp", [10], 4, "fp32", True)]])
def test_the_estimate_is_within_the_band_of_memtracker(row):
    """A real CPU step of the conv stack and the residual MLP (GPipe's micro-batches, one backward, AdamW), every
    part charged as a GPU would hold it: the estimate from the layers' figures within 10 % of MemTracker's peak and
    never more than 5 % below it, in fp32 and bf16, with and without checkpointing, one part and split."""
    import own_model_memory
    rows = own_model_memory.compare(*row)
    assert len(rows) == len(row[1])
    for r in rows:
        assert 1 - LOW <= r["ratio"] <= 1 + HIGH, (r["part"], r["ratio"], r["measured"], r["estimated"], r["kinds"])


def kit_training(precision, ckpt, zero, layout, nb_part):
    return kit.arguments.Training(layout=layout, pp=nb_part, schedule="1f1b", virtual_stages=1, precision=precision,
                                  activation_checkpointing=ckpt, zero=zero)


@pytest.mark.parametrize("layout,nb_part,replicas,chunks,precision,ckpt,zero,arch", [
    ("replica", 1, 1, 2, "fp32", False, False, "sm80"), ("replica", 2, 2, 4, "bf16", True, True, "sm80"),
    ("replica", 3, 1, 8, "fp16", False, False, "sm70"), ("replica", 2, 4, 2, "fp32", True, True, "cpu"),
    ("stage", 2, 1, 4, "bf16", False, False, "sm80"), ("stage", 4, 2, 8, "fp32", True, True, "sm80")])
def test_the_kits_transformer_is_kit_memorys_estimate_to_the_byte(layout, nb_part, replicas, chunks, precision,
                                                                     ckpt, zero, arch):
    """--model of the kit's own Encoder, Layers and Decoder: recognised, its arguments recovered (the CPU defaults
    kit_transformer builds), and on the kit's own split the estimate is kit.memory's, every term to the byte."""
    described = own.describe(*KIT)
    costs, model = described.costs, described.kit
    cpu = kit.arguments.CPU_DEFAULTS
    assert model == dict(nlayers=cpu["nlayers"], d_model=cpu["d_model"], n_head=cpu["n_head"], d_hid=cpu["d_hid"],
                         seq_len=64, vocab_size=cpu["vocab_size"], dropout=0.0)
    sizes = lm.kit_sizes(model["nlayers"], nb_part)
    assert described.sizes(nb_part, "even", 8 // chunks, chunks) == sizes
    got = lm.estimate_peaks(costs, sizes, 8 // chunks, chunks, precision, replicas, zero, ckpt, layout, arch,
                            kit_model=model)
    t = kit_training(precision, ckpt, zero, layout, nb_part)
    want = (kit.memory.estimate_stage_memory if layout == "stage" else kit.memory.estimate_memory)(
        dict(model, batch_size=8, chunks=chunks), t, nb_part, replicas, arch)
    assert got == want


def test_a_model_that_only_looks_like_the_kits_is_not_taken_for_it():
    assert own.describe(*MLP).kit is None and not own.describe(*MLP).ends
    assert own.describe(KIT[0], "8x32").kit is not None  # shorter reviews: the same model, seq_len from the sample


MISSES = {(3, "fp32", True, 1): 0.906, (3, "fp32", True, 2): 0.928, (3, "bf16", True, 1): 0.933}


@pytest.mark.parametrize("nb_part,chunks", [(1, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_the_generic_composition_of_the_kits_layers_lands_on_its_tape(nb_part, chunks, precision, ckpt):
    """Cross-validation: the kit's Transformer composed from its measured layers as any model is (not recognised)
    against kit.memory's op-by-op tape of the same step (traced, the CPU; the tape itself held to MemTracker by
    tests/test_memory.py): within the band, but for the misses docs/own_model.md states, all checkpointed, in the
    3-part split (a part of one Layer, and the last part): the composition does not know a Layer's own backward
    temporaries, and the tape also counts what fairscale's Pipe keeps (its waiting input gradient, its worker's
    last task), which the real step of benchmarks/own_model_memory.py does not run (it measures 0.937, 0.959 in
    fp32 and 1.027, 1.012 in bf16 for those parts)."""
    described = own.describe(*KIT)
    costs, model = described.costs, described.kit
    sizes = lm.kit_sizes(model["nlayers"], nb_part)
    generic = lm.estimate_peaks(costs, sizes, 8 // chunks, chunks, precision, checkpointing=ckpt, arch="cpu",
                                traced=True)
    tape = lm.estimate_peaks(costs, sizes, 8 // chunks, chunks, precision, checkpointing=ckpt, arch="cpu",
                             traced=True, kit_model=model)
    for g, k, n in zip(generic, tape, sizes):
        miss = MISSES.get((nb_part, precision, ckpt, g.part))
        if miss:  # a stated miss, held to its figure so that a change shows
            assert g.peak / k.peak == pytest.approx(miss, abs=0.002)
        else:
            assert 1 - LOW <= g.peak / k.peak <= 1 + HIGH, (g.part, g.peak / k.peak)


def test_the_stage_layouts_schedule_sets_the_micro_batches_alive():
    """GPipe keeps every micro-batch until its backward, 1F1B at most pp - rank on task rank (kit.memory's
    stage_actions): fewer activations, the rest the same."""
    costs = own.layer_costs(*MLP)
    gpipe = lm.estimate_peaks(costs, [5, 5], 2, 8, layout="stage", schedule="gpipe", arch="cpu")
    one = lm.estimate_peaks(costs, [5, 5], 2, 8, layout="stage", schedule="1f1b", arch="cpu")
    assert [m.alive for m in gpipe] == [8, 8] and [m.alive for m in one] == [2, 1]
    assert all(o.peak <= g.peak for o, g in zip(one, gpipe)) and gpipe[0].params == one[0].params


def test_zero_shares_adamws_states_over_the_replicas():
    costs = own.layer_costs(*MLP)
    alone = lm.estimate_peaks(costs, [3, 7], 4, 4, replicas=4)
    shared = lm.estimate_peaks(costs, [3, 7], 4, 4, replicas=4, zero=True)
    for a, s in zip(alone, shared):
        assert a.optimizer == 2 * a.params and a.params / 4 <= s.optimizer / 2 < a.params


def test_advise_ranks_what_fits_first_and_the_balanced_split_best():
    """The residual MLP's blocks are uneven: over 3 GPUs, on GPUs too small for the whole model on one, the
    FLOPs-balanced split of 3 parts is the fastest row and the single part, which does not fit, comes last."""
    costs = own.layer_costs(*MLP)
    whole = lm.estimate_peaks(costs, [10], 16, 1, arch="cpu")[0].total
    split = max(m.total for m in lm.estimate_peaks(costs, kit.plan.part_sizes(10, 3), 1, 16, arch="cpu"))
    assert split < whole
    gib = (whole + split) / 2 / kit.memory.GIB
    rows = kit.advise.advise_layers(own.describe(*MLP), 3, gib, "cpu", 48)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and not fits[-1] and rows[-1]["nb_part"] == 1
    best = rows[0]
    assert best["fits"] and best["nb_part"] == 3 and "time" in best["split"]
    assert best["sizes"] == kit.plan.balanced_sizes([c.flops for c in costs], 3) != kit.plan.part_sizes(10, 3)
    even = next(r for r in rows if r["split"] == "even" and r["chunks"] == best["chunks"])
    assert even["relative_speed"] < best["relative_speed"] == 1.0


def test_the_command_prints_each_parts_estimate_and_advises():
    r = subprocess.run([sys.executable, "-m", "kit.own_model", "--model", KIT[0], "--sample", KIT[1], "--nb-part",
                        "2", "--chunks", "2", "--precision", "bf16", "--arch", "v100-16g"], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "part 0 (Encoder + Layer 0-1): " in r.stdout and "fits in 15.8 GiB (v100-16g" in r.stdout, r.stdout
    assert "kit.memory's estimate itself" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kit.own_model", "--model", MLP[0], "--sample", MLP[1], "--advise",
                        "--gpus", "4", "--arch", "h100", "--top", "3"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("--advise for --model: 4 GPU(s) of 79.6 GiB (h100") and len(lines) == 5, r.stdout
    r = subprocess.run([sys.executable, "-m", "kit.own_model", "--model", MLP[0], "--sample", MLP[1], "--advise"],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--advise needs --gpus N" in r.stderr


def test_the_checkers_advise_ranks_the_users_model_not_the_kits():
    """check_topology --advise with --model: the same table as kit.own_model's (the user's layers, their splits),
    not the kit's Transformer's; --profile (a profile of the kit's model) is refused with it in one line."""
    flags = ["--advise", "--nodes", "1", "--gpus-per-node", "4", "-C", "h100", "--global-batch", "16", "--model",
             MLP[0], "--sample", MLP[1]]
    r = subprocess.run([sys.executable, "check_topology.py", *flags, "--top", "3"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    gib = float(r.stdout.split(" GPU(s) of ")[1].split()[0])  # the H100's usable memory, as the checker reads -C
    expected = kit.advise.advise_layers(own.describe(*MLP), 4, gib, "sm80", 16)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("--advise for --model: 4 GPU(s) of ") and len(lines) == 5, r.stdout
    assert str(expected[0]["sizes"]) in lines[2] and "Layer" not in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "check_topology.py", *flags, "--profile", "p.json"], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--profile is a profile of the kit's own Transformer" in r.stderr, r.stderr


def test_part_peak_is_the_estimate():
    """The split by memory (kit.model, the one the trainers run) balances each layer's peak from the same
    estimate, the trainers' loss on the last layer's output alone (issue 41)."""
    model = own.describe(*MLP)
    for i, (c, cost) in enumerate(zip(model.costs, model.layer_costs("memory", 4, 4, "bf16"))):
        last = i == model.nlayers - 1
        assert (kit.model.part_peak([c], 4, 4, "bf16", loss=last)
                == lm.estimate_peaks([c], [1], 4, 4, "bf16", loss=last)[0].peak == cost)
