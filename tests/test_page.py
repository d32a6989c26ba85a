"""The page's own tests: bench_ddp_transformer.py's loop (build_module_list, the page's code under the page's names)
builds what the kit's builder builds (kit.train.transformer.module_list: the stage layout's, the benchmarks'), so the
two layouts, a checkpoint and every benchmark see one model. The only file besides the script that imports it
(tests/test_house.py holds that)."""
from __future__ import annotations

import sys

import pytest
import torch

from launch import ROOT
from test_check_topology import ours_grouping

sys.path.insert(0, str(ROOT))
import bench_ddp_transformer as page  # noqa: E402
import kit.arguments  # noqa: E402
import kit.plan  # noqa: E402
import kit.train.setup  # noqa: E402
import kit.train.transformer  # noqa: E402


def tiny(nlayers: int, checkpointing: bool) -> object:
    cfg = kit.arguments.parse_trainer_args("replica", ["--nlayers", str(nlayers), "--d-model", "8", "--n-head", "2",
                                                       "--d-hid", "8", "--vocab-size", "16", "--seq-len", "4"]
                                           + (["--activation-checkpointing"] if checkpointing else []))
    kit.train.setup.resolve(cfg, cuda=False)
    return cfg


@pytest.mark.parametrize("nlayers,nb_part", [(1, 1), (4, 2), (5, 2), (7, 3), (6, 4)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_pages_loop_builds_the_kits_module_list(nlayers, nb_part, checkpointing):
    cfg = tiny(nlayers, checkpointing)
    plan = kit.plan.plan_task(0, 0, 0, 1, [], None, cfg.nlayers, nb_part)
    built = []
    for build in (page.build_module_list, kit.train.transformer.module_list):
        torch.manual_seed(cfg.seed)
        built.append(build(cfg, plan))
    ours, kits = built
    assert [[type(m) for m in part] for part in ours] == [[type(m) for m in part] for part in kits]
    assert len(ours) == nb_part and type(ours[0][0]).__name__ == "Encoder" and type(ours[-1][-1]).__name__ == "Decoder"
    a, b = torch.nn.Sequential(*ours).state_dict(), torch.nn.Sequential(*kits).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("nlayers,nb_part", [(16, 2), (8, 4), (7, 2), (9, 4)])
def test_the_pages_loop_puts_each_module_where_the_kit_does(nlayers, nb_part):
    """Each module's GPU (its .to(cuda:i), recorded: no GPU here), the page's loop module by module, the kit's part
    by part: the same GPU for every module."""
    assert ours_grouping(nlayers, nb_part, page.build_module_list) == ours_grouping(nlayers, nb_part)
