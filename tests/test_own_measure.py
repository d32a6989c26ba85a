"""The measurement of a user's model (issue 41, items 1, 2 and 6): the checker runs the model's code only in a bounded
child (kit/measure_child.py) and says one line whatever that code does; the measurement measures what runs
(in-place layers, one layer built for real, the sample described, a cache keyed by every source and checked); the
FLOPs the counter misses (an LSTM's, SDPA's fused CPU kernel) counted by torch's own rules, held to hand counts and
to the decomposed kernels' counts."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import kit.arguments
import kit.measure_child
import kit.model
import kit.own_model as own
from launch import ROOT, clean_env
from models_families import LSTMBody

HOSTILE = textwrap.dedent("""
    import os, sys, time
    import torch, torch.nn as nn
    def exits():
        sys.exit(0)
    def hard_exit():
        os._exit(0)
    def sleeps():
        time.sleep(1000)
    def aborts():
        os.abort()
    def allocates():
        return [nn.Linear(4, 4), torch.ones(3 * 2 ** 30, device="cpu")]
    def prints():
        print("OK from the model")
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    def sample():
        return torch.zeros(8, 4)
    def bad_sample():
        raise KeyError("no such field")
""")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def check(tmp_path: Path, fn: str, sample: str = "sample", **env: str) -> subprocess.CompletedProcess:
    """check_topology on a line with --model hostile.py:fn (the checker's own flags: no job script needed)."""
    (tmp_path / "hostile.py").write_text(HOSTILE)
    return subprocess.run([sys.executable, str(ROOT / "check_topology.py"), "--nodes", "1", "--gpus-per-node", "8",
                           "--ntasks-per-node", "1", "--nb-part", "2", "--batch-size", "8", "--model",
                           f"hostile.py:{fn}", "--sample", f"hostile.py:{sample}"], cwd=tmp_path,
                          env={**clean_env(), **env, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=200)


@pytest.mark.parametrize("fn, why", [("exits", "called sys.exit(0)"), ("hard_exit", "exited with code 0 without an"),
                                     ("aborts", "killed by SIGABRT"), ("allocates", "over the memory bound of 8 GiB"),
                                     ("sleeps", "no answer after 5 s")])
def test_whatever_the_models_code_does_the_checker_says_one_line_and_exits_2(tmp_path, fn, why):
    r = check(tmp_path, fn, **({"KIT_MEASURE_SECONDS": "5"} if fn == "sleeps" else {}))  # the others: the default
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert lines[0].startswith(f"measuring your model: importing hostile.py, calling {fn}()"), r.stderr
    assert len(lines) == 2 and "could not be measured" in lines[1] and why in lines[1], r.stderr
    assert not list(tmp_path.glob("core*"))


def test_the_models_prints_stay_out_of_the_checkers_output(tmp_path):
    r = check(tmp_path, "prints")
    assert r.returncode == 0 and "OK from the model" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "note: --model hostile.py:prints: 3 layers" in r.stdout


def test_a_sample_that_fails_is_one_line(tmp_path):
    r = check(tmp_path, "prints", sample="bad_sample")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2, r.stderr
    assert "--sample hostile.py:bad_sample: calling it failed: KeyError" in lines[1] and "fix the function" in lines[1]


def test_a_bad_bound_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("KIT_MEASURE_SECONDS", "soon")
    with pytest.raises(kit.model.ModelError, match="KIT_MEASURE_SECONDS='soon': give a positive number"):
        kit.measure_child.bounds()


def test_an_answer_that_does_not_validate_is_refused():
    good = {"costs": [json.loads(json.dumps(own.asdict(c))) for c in own.measure(*MLP)], "ends": False, "kit": None,
            "shared": [[0, 9, "weight"]]}
    assert kit.measure_child._model_of("m", "s", good).nlayers == 10
    assert kit.measure_child._model_of("m", "s", good).shared == [(0, 9, "weight")]
    for shared in ([[0, 10, "weight"]], [[3, 1, "w"]], [[0, True, "w"]], [[0, 1]], "0,1"):  # past the layers, order
        with pytest.raises(ValueError):
            kit.measure_child._model_of("m", "s", {**good, "shared": shared})
    for damage in ({"flops": -1.0}, {"saved": {"fp32": float("nan"), "bf16": 0, "fp16": 0}}, {"params": "12"},
                   {"out_shape": [2.5]}, {"extra": 1}):
        bad = json.loads(json.dumps(good))
        bad["costs"][1].update(damage)
        with pytest.raises(ValueError):
            kit.measure_child._model_of("m", "s", bad)


# ---- what runs ---------------------------------------------------------------------------------------------------
MODELS = textwrap.dedent("""
    import torch, torch.nn as nn
    from helper import AddInPlace
    def vgg_like():
        return nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True)),
                             nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
                             nn.ReLU(inplace=True), AddInPlace(),
                             nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 10)))
    def image():
        return torch.zeros(4, 3, 16, 16)
    def huge_image():
        return torch.zeros(64, 3, 2048, 2048)  # 3 GiB if it were allocated
    def mlp():
        return [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)]
    def vector():
        return torch.zeros(8, 16)
""")
HELPER = textwrap.dedent("""
    import torch.nn as nn
    class AddInPlace(nn.Module):
        def forward(self, x):
            return x.add_(1.0)
""")


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "helper.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


MLP = (str(ROOT / "tests" / "models_zoo.py") + ":residual_mlp", str(ROOT / "tests" / "models_zoo.py") + ":mlp_sample")


def real_costs(layers: list[nn.Module], x: torch.Tensor) -> list[tuple[int, float]]:
    """Each layer's saved bytes (not its parameters) and FLOPs on real tensors, its input the output of an op as in
    the model (in place works there)."""
    from torch.utils.flop_counter import FlopCounterMode
    out, x = [], x.requires_grad_(True).clone()
    for layer in layers:
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        x = x.detach().requires_grad_(True).clone()
        with FlopCounterMode(display=False) as flops:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            y.backward(torch.ones_like(y))
        out.append((sum(saved.values()), flops.get_total_flops()))
        x = y.detach()
    return out


def test_in_place_layers_are_measured_as_they_run_in_the_model(models):
    """nn.ReLU(inplace=True) (as torchvision's VGG writes it) and a layer doing x.add_(): measured, not refused, and
    their saved bytes and FLOPs those of a real run of the same layers."""
    spec, sample = f"{models}/models.py:vgg_like", f"{models}/models.py:image"
    costs = own.measure(spec, sample)
    assert [c.how for c in costs] == ["fake"] * 5
    layers, _ = own.build_layers(spec, device="cpu")
    real = real_costs(layers, torch.randn(4, 3, 16, 16))
    assert [(c.saved["fp32"] * 4, c.flops * 4) for c in costs] == [(float(s), float(f)) for s, f in real]


def test_in_place_layers_are_timed_too(models):
    """--time-layers runs each layer on its real input: an in-place layer first in a part works there too."""
    times = own.layer_times(f"{models}/models.py:vgg_like", f"{models}/models.py:image", repeats=1)
    assert len(times) == 5 and all(t > 0 for t in times)


def test_the_sample_is_described_not_allocated(models):
    """A 3 GiB sample batch, under a 1.5 GiB address-space limit: its shape read under fake tensors."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 * 2 ** 29, resource.RLIM_INFINITY)); "
            "import kit.own_model as own; print(own.sample_shape(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, "models.py:huge_image"], cwd=models, capture_output=True,
                       text=True, env={**clean_env(), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2",
                                       "PYTHONPATH": f"{ROOT}:{models}"}, timeout=120)
    assert r.returncode == 0 and "[64, 3, 2048, 2048], torch.float32" in r.stdout, r.stderr[-2000:]


def test_the_cache_key_covers_a_helper_modules_source(models):
    spec, sample = f"{models}/models.py:vgg_like", f"{models}/models.py:image"
    first = own.layer_costs(spec, sample)
    assert own.layer_costs(spec, sample) == first  # read back
    (models / "helper.py").write_text(HELPER.replace("return x.add_(1.0)", "return x.add_(1.0).repeat(1, 2, 1, 1)")
                                      .replace("class AddInPlace", "import torch\nclass AddInPlace"))
    import helper
    import importlib
    importlib.reload(helper)
    with pytest.raises(kit.model.ModelError):  # measured again: the head now refuses twice the channels
        own.layer_costs(spec, sample)


def test_a_damaged_cache_entry_is_measured_again(models):
    spec, sample = f"{models}/models.py:mlp", f"{models}/models.py:vector"
    first = own.layer_costs(spec, sample)
    [path] = (models / "cache" / "hybrid-kit" / "models").glob("*.json")
    for damage in ('{"flops": -5.0}', '{"out_bytes": NaN}', '{"saved": {"fp32": 1}}', '{"name": 3}'):
        entry = json.loads(path.read_text())
        entry[0].update(json.loads(damage))
        path.write_text(json.dumps(entry))
        assert own.layer_costs(spec, sample) == first, damage
    path.write_text(json.dumps(json.loads(path.read_text())[:2]))  # a layer short
    assert own.layer_costs(spec, sample) == first


def test_the_real_fallback_builds_that_one_layer_only(models):
    (models / "branchy.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        BUILT = []
        class Branchy(nn.Module):
            def __init__(self):
                super().__init__(); self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return self.fc(x) if float(x.sum()) > -1e30 else x  # data-dependent: refuses fake tensors
        class Big(nn.Linear):
            def reset_parameters(self):
                BUILT.append(self.weight.device.type)
                super().reset_parameters()
        def layers():
            return [Big(16, 16), Branchy(), Big(16, 4)]
    """))
    costs = own.measure(f"{models}/branchy.py:layers", f"{models}/models.py:vector")
    assert [c.how for c in costs] == ["fake", "cpu", "fake"]
    import branchy
    assert "cpu" not in branchy.BUILT  # the two Big layers were never built for real: meta, then fake storage
    layer = own.one_layer_for_real(f"{models}/branchy.py:layers", 1)
    assert layer.fc.weight.device.type == "cpu" and torch.isfinite(layer.fc.weight).all()



def test_an_lstm_is_measured_for_real_its_kernels_workspace_included(models, capsys):
    """An LSTM's CPU kernel (mkldnn_rnn_layer) saves a workspace whose fake-tensor kernel is empty: a layer holding
    one is measured by the real fallback, said on stderr, and its saved bytes are a real run's at the sample's batch
    (the fake figure was 0.39 of the step's peak in benchmarks/model_zoo.py). fp16, which oneDNN's LSTM refuses on
    this CPU, takes bf16's bytes (both 2 bytes an element). (oneDNN pads a tiny LSTM's workspace at batches of one
    and two: 3 % here.)"""
    (models / "rnn.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        from models_families import LSTMBody
        def layers():
            return [nn.Linear(32, 32), LSTMBody(32, 64, 2), nn.Linear(64, 2)]
        def sample():
            return torch.zeros(4, 24, 32)
    """))
    costs = own.measure(f"{models}/rnn.py:layers", f"{models}/rnn.py:sample")
    assert [c.how for c in costs] == ["fake", "cpu", "fake"]
    assert "1: LSTMBody holds an nn.LSTM" in capsys.readouterr().err
    layers, _ = own.build_layers(f"{models}/rnn.py:layers", device="cpu")
    real = real_costs(layers, torch.randn(4, 24, 32))
    lstm = costs[1]
    assert lstm.saved["fp32"] * 4 + lstm.saved_fixed["fp32"] == pytest.approx(real[1][0], rel=0.03)
    assert lstm.saved["fp16"] == lstm.saved["bf16"] > 0

# ---- FLOPs the counter misses -------------------------------------------------------------------------------------
class Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 4, -1).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)


def flops_of(layer: nn.Module, x: torch.Tensor) -> tuple[int, set[str]]:
    """A real forward and backward's FLOPs with the kit's formulas, and the ops it says it missed."""
    _, _, flops, _, _, missed = own._run_layer(layer, own._as_in_the_model(x), "fp32")
    return flops, missed


def test_an_lstms_flops_are_the_hand_count_and_the_decomposed_kernels():
    """mkldnn_rnn_layer (the CPU's fused LSTM) counted: 4 gates x (input + hidden) x hidden x 2 x steps, the backward
    twice that; equal to the count of the same LSTM run without mkldnn (one mm a step, which the counter sees)."""
    b, s, d, h = 2, 12, 24, 32
    layer, x = LSTMBody(d, h, 2), torch.randn(b, s, d)
    hand = 3 * 2 * b * s * 4 * h * ((d + h) + (h + h))  # forward + backward (2x), two layers
    counted, missed = flops_of(layer, x)
    assert counted == hand and not missed
    with torch.backends.mkldnn.flags(enabled=False):
        decomposed, _ = flops_of(layer, x)
    assert decomposed == hand - 2 * (2 * b * 4 * h * h)  # less the zero initial state's gradient (a step's mm a layer)


def test_sdpas_fused_cpu_kernel_is_counted_by_torchs_own_formula():
    """_scaled_dot_product_flash_attention_for_cpu: torch's sdpa_flop_count and sdpa_backward_flop_count (2 bmm
    forward; 5 backward, the scores recomputed as flash kernels do; causal not discounted, as torch's own): the math
    kernel's bmm count plus that recomputation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, s, d = 2, 64, 32
    x = torch.randn(b, s, d)
    bmm = 2 * b * s * s * d  # one of q k^T, p v, ... over the 4 heads: 2 FLOPs a multiply-add
    counted, missed = flops_of(Attention(), x)
    assert counted == 7 * bmm and not missed
    with sdpa_kernel(SDPBackend.MATH):
        math_count, _ = flops_of(Attention(), x)
    assert math_count == 6 * bmm


def test_a_computing_op_without_a_formula_is_named_and_time_split_refused(monkeypatch):
    monkeypatch.setattr(own, "flop_formulas", lambda: {})  # as a release whose kernel the kit has no formula for
    _, missed = flops_of(LSTMBody(8, 8, 1), torch.randn(2, 5, 8))
    assert missed == {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"}
    cost = kit.model.LayerCost("1: LSTMBody", 1, 4, 0.0, 1.0, flops_missed=sorted(missed))
    model = kit.model.Model("m.py:f", "2x5", [kit.model.LayerCost("0: A", 1, 4, 1.0, 1.0), cost])
    with pytest.raises(kit.model.ModelError, match="FLOPs not counted.*--time-layers"):
        model.sizes(2, "time")
    assert model.sizes(2, "even") == [1, 1]
    assert math.isfinite(model.flops_per_sample)


def test_no_part_shows_zero_gflop_without_a_word(models):
    """A part of elementwise layers alone (a ReLU) has no FLOP the counter counts: the table says why, and a part
    with ops the kit cannot count says that."""
    spec, sample = f"{models}/models.py:mlp", f"{models}/models.py:vector"
    model = kit.model.Model(spec, sample, own.measure(spec, sample))
    text = own.table(model, 3, 2, 2)
    assert "layers 1-1: 0.000 GFLOP (no matmul or convolution: elementwise FLOPs are not counted)" in text
    model.costs[0].flops_missed = ["mkldnn_rnn_layer"]
    text = own.table(model, 3, 2, 2)
    assert "FLOPs not counted (mkldnn_rnn_layer)" in text and "split by time   [" not in text
    assert "layers 0-0: 0.000 GFLOP (FLOPs not counted)" in text
    assert "no split by time on these FLOPs" in text


def test_the_child_ends_with_the_checker(tmp_path):
    """SIGKILL to the checker while its child measures a model that hangs: the child (its own session, out of reach
    of the terminal's signals) goes too, not 300 s later."""
    import os
    import signal
    import time
    (tmp_path / "hostile.py").write_text(HOSTILE)
    proc = subprocess.Popen([sys.executable, str(ROOT / "check_topology.py"), "--nodes", "1", "--gpus-per-node", "8",
                             "--ntasks-per-node", "1", "--nb-part", "2", "--model", "hostile.py:sleeps", "--sample",
                             "hostile.py:sample"], cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().startswith("measuring your model")
    deadline = time.monotonic() + 60
    children = []
    while not children and time.monotonic() < deadline:  # the child, by its parent's pid
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent_of(int(p)) == proc.pid]
        time.sleep(0.05)
    assert children, "no measuring child seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    while time.monotonic() < deadline and Path(f"/proc/{children[0]}").exists() and \
            _state_of(children[0]) != "Z":
        time.sleep(0.05)
    assert not Path(f"/proc/{children[0]}").exists() or _state_of(children[0]) == "Z"


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


# ---- recurrent layers run step by step ----------------------------------------------------------------------------
class GRUBody(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("rnn, features", [(lambda: nn.GRU(40, 16, num_layers=2, batch_first=True), 40),
                                           (lambda: nn.RNN(16, 24, batch_first=True), 16)], ids=["gru", "rnn"])
def test_a_step_by_step_recurrent_layer_is_carried_from_a_few_steps_to_the_same_figures(rnn, features):
    """A GRU or a plain RNN (no fused CPU kernel: step by step under fake tensors) measured at 2, 4 and 8 steps and
    carried to 40: every figure equal to the measurement of all 40 steps, the output's shape too (the GRU's input has
    40 features and 40 steps: the cut says which dim is the sequence)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    layer = GRUBody(rnn())
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cpu")
        xs = {p: tuple(torch.empty([4 * k, 40, features]) for k in (1, 2)) for p in kit.arguments.PRECISIONS}
        carried, outs = own._measure_steps(layer, xs, "1: GRUBody")
        whole, whole_outs = own._measure_one(layer, xs, "1: GRUBody", "fake")
    assert carried.how == "fake, 2-8 steps carried to 40"
    carried.how = "fake"
    assert carried == whole
    assert {p: [list(o.shape) for o in v] for p, v in outs.items()} == \
        {p: [list(o.shape) for o in v] for p, v in whole_outs.items()}
