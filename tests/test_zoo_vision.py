"""torchvision's ResNet-18 and ViT-B/16 and timm's ViT-S/16 (issue 41; tests/zoo_vision.py): planned at full size
(parameters exact, FLOPs the published count, every op counted), and their narrow twins (the same classes) trained
in both layouts on 2 tasks, the checker's split the stage trainer's. They import only beside a CUDA torch, so these
run in the torch 2.14.1 lane (requirements-torch-2.14.1.txt), as part of its core."""
from __future__ import annotations

import pytest
import torch

REASON = ("torchvision and timm import beside the CUDA torch 2.14.1 lane only (requirements-torch-2.14.1.txt); "
          f"PyPI's torchvision for torch {torch.__version__} does not load beside this torch")
pytest.importorskip("torchvision", reason=REASON)
pytest.importorskip("timm", reason=REASON)

import kit.arguments  # noqa: E402
import kit.own_model as own  # noqa: E402
import kit.releases  # noqa: E402
from launch import bench  # noqa: E402
from test_zoo_families import stage_run_is_the_checkers_plan  # noqa: E402

pytestmark = pytest.mark.core

VISION = "tests/zoo_vision.py"
# full size: (function, the published forward GMACs at 224 x 224, the parameters with a 2-class head)
# GMACs: torchvision's model cards (ResNet18_Weights, ViT_B_16_Weights: "GFLOPS" 1.81 and 17.56, counted as
# multiply-adds) and timm's (vit_small_patch16_224: 4.6 GMACs)
FULL = {"torchvision ResNet-18": ("resnet18", 1.81, 11_177_538), "torchvision ViT-B/16": ("vit_b_16", 17.56, 85_800_194),
        "timm ViT-S/16": ("timm_vit_s_16", 4.6, 21_666_434)}
NARROW = {"torchvision ResNet-18": "resnet18_narrow", "torchvision ViT-B/16": "vit_narrow",
          "timm ViT-S/16": "timm_vit_narrow"}
SHORT = ["--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--chunks", "2", "--synthetic", "200"]


@pytest.mark.parametrize("name", list(FULL))
def test_the_full_size_model_is_planned_exactly(name):
    """Described under fake tensors (nothing allocated): the unique parameters' count, and FLOPs a sample of one
    forward and backward (3 x 2 x the forward's multiply-adds) within 5 % of the published count (attention's
    matmuls and the norms are in the kit's count, not in every card's), no op uncounted."""
    fn, gmacs, params = FULL[name]
    model = own.describe(f"{VISION}:{fn}", f"{VISION}:image_224", use_cache=False)
    assert sum(c.params for c in model.costs) == params
    assert not [c.name for c in model.costs if c.flops_missed]
    assert 1.0 <= model.flops_per_sample / (6 * gmacs * 1e9) <= 1.05, model.flops_per_sample  # 1.002-1.013


def line(name: str) -> list[str]:
    return ["--model", f"{VISION}:{NARROW[name]}", "--sample", f"{VISION}:image_32", *SHORT]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(NARROW))
def test_the_narrow_twin_trains_in_the_replica_layout(tmp_path, name):
    runs = bench([*line(name), "--nb-part", "2", "--cache-dir", str(tmp_path)], ntasks=2, timeout=240)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert "replicas in sync: max parameter fingerprint difference 0" in runs[0].stdout, runs[0].stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(NARROW))
def test_the_narrow_twin_trains_in_the_stage_layout_as_the_checker_plans_it(tmp_path, name):
    """A ViT's patch embedding returns a transposed view: what its stage sends is made contiguous."""
    if kit.releases.torch_refusals(torch.__version__, kit.arguments.Training(layout="stage", schedule="gpipe"),
                                   cpu=True):
        pytest.skip("this torch has no stage layout on the CPU")
    stage_run_is_the_checkers_plan(tmp_path, line(name), ["--model", f"{VISION}:{NARROW[name]}", "--sample",
                                                          f"{VISION}:image_32"], VISION)
