"""The model descriptor (kit/model.py): the kit's Transformer recognised in one place, and one split for every
--split that the checker, both trainers, --advise and python -m kit.own_model all show (issue 43: for the kit's
Encoder and Decoder around the user's own layers the checker and trainers ran --split even as [2, 1, 1, 2] while
the tool and --advise showed [1, 1, 2, 2]). All in-process: the checker's and the tool's main, the trainers' setup
path without a training."""
from __future__ import annotations

import re

import pytest

import check_topology
import kit.advise
import kit.arguments
import kit.model
import kit.own_model as own
import kit.own_split
import kit.schedules
import kit.train.own
import kit.train.setup
from launch import ROOT

ZOO = str(ROOT / "tests" / "models_zoo.py")
MIXED = (f"{ZOO}:kit_ends_mixed", "8x64")  # the kit's Encoder, 4 layers of the user's, the kit's Decoder
KIT = (f"{ZOO}:kit_transformer", "8x64")
MLP = (f"{ZOO}:residual_mlp", f"{ZOO}:mlp_sample")
# micro-batches of 4, 16 of them in flight: what each layer saves outweighs its weights, and checkpointing (its input
# alone saved) changes the split by memory at 2, 3 and 4 parts
LINE = ["--model", MIXED[0], "--sample", MIXED[1], "--batch-size", "64", "--chunks", "16"]


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """One measurement of each model for the whole file (kit.own_model's cache, in a temporary folder)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        kit.own_split.described.cache_clear()
        yield
        kit.own_split.described.cache_clear()


def test_the_kits_transformer_is_recognised_once_by_its_classes():
    """The mixed model has the kit's ends but not its Layers: the page's even split, not kit.memory's estimate; the
    kit's own model has both; another model neither. Checkpointing never recomputes the kit's Encoder or Decoder."""
    mixed = own.describe(*MIXED)
    assert (mixed.ends, mixed.kit, mixed.nlayers, mixed.classes) == (True, None, 6, 2)
    ends, whole = kit.model.recognise(own.build_layers(KIT[0])[0], [8, 64], False)
    assert ends and whole["nlayers"] == kit.arguments.CPU_DEFAULTS["nlayers"]
    assert kit.model.recognise(own.build_layers(KIT[0])[0], [8, 64], True) == (True, None)  # not token ids
    assert kit.model.recognise(own.build_layers(MLP[0])[0], [16, 64], True) == (False, None)
    assert mixed.recomputed() == [False, True, True, True, True, False]
    assert mixed.sizes(4) == [2, 1, 1, 2] and mixed.sizes(5) == kit.plan.part_sizes(6, 5)  # too few between the ends
    assert [kit.model.is_kit_class(layer, "Encoder") for layer in own.build_layers(MIXED[0])[0][:2]] == [True, False]
    with pytest.raises(kit.model.ModelError, match="6 layer.s., fewer than the 7 parts"):
        mixed.sizes(7)


def checker_sizes(capsys, split: str, nb_part: int, stage: bool, ckpt: list[str]) -> list[int]:
    """check_topology's plan of the line (planning flags: a node of nb_part GPUs), the sizes it prints."""
    where = (["--layout", "stage", "--pp", str(nb_part), "--schedule", "gpipe", "--ntasks-per-node", str(nb_part)]
             if stage else ["--nb-part", str(nb_part), "--ntasks-per-node", "1"])
    check_topology.main(["--nodes", "1", "--gpus-per-node", str(nb_part), *where, *LINE, "--split", split, *ckpt])
    out = capsys.readouterr().out
    found = re.search(r"--split \w+, sizes (\[[\d, ]+\])", out)
    assert found, out
    return eval(found.group(1))


def trainer_sizes(split: str, nb_part: int, stage: bool, ckpt: list[str]) -> list[int]:
    """The trainer's setup path before any process group: its arguments, its plan (the replica layout's make_plan),
    --model's verdict and split (kit.train.own.resolve_model, as both trainers' main call it)."""
    layout = "stage" if stage else "replica"
    where = ["--pp", str(nb_part), "--schedule", "gpipe"] if stage else ["--nb-part", str(nb_part)]
    cfg = kit.arguments.parse_trainer_args(layout, [*LINE, *where, "--split", split, *ckpt])
    kit.arguments.resolve_defaults(cfg, cuda=False)
    if stage:
        parts = cfg.pp * kit.schedules.stages_per_rank(cfg.schedule, cfg.virtual_stages)
    else:
        parts = kit.train.setup.make_plan(cfg, cuda=False).nb_part
    return kit.train.own.resolve_model(cfg, parts).plan.sizes


def tool_sizes(capsys, nb_part: int, stage: bool, ckpt: list[str]) -> dict[str, list[int]]:
    """python -m kit.own_model's table (its main), the sizes of each split."""
    where = ["--layout", "stage", "--pp", str(nb_part), "--schedule", "gpipe"] if stage else ["--nb-part", str(nb_part)]
    assert own.main([*LINE, *where, *ckpt]) == 0
    out = capsys.readouterr().out
    return {kind: eval(sizes) for kind, sizes in re.findall(r"split by (\w+) +(\[[\d, ]+\])", out)}


def advise_sizes(capsys, nb_part: int) -> dict[str, list[int]]:
    """check_topology --advise --model's rows of nb_part parts, one replica, 16 chunks (kit.advise.advise_layers, as
    python -m kit.own_model --advise), each split's sizes: a GPU too large for any split not to fit in fp32."""
    assert check_topology.main(["--advise", "--nodes", "1", "--gpus-per-node", str(nb_part), "--gpu-mem", "10000",
                                "--global-batch", "64", "--model", MIXED[0], "--sample", MIXED[1]]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +([\w=]+) +(\[[\d, ]+\]) +fp32 ", out, re.M)
    sizes = {kind: eval(s) for n, r, b, c, split, s in rows if (n, r, b, c) == (str(nb_part), "1", "64", "16")
             for kind in split.split("=")}
    assert set(sizes) == set(kit.arguments.SPLITS), out
    return sizes


@pytest.mark.parametrize("nb_part", [2, 3, 4, 5])
def test_the_checker_the_trainers_the_tool_and_advise_run_one_split(capsys, nb_part):
    """For every --split, in both layouts, with and without --activation-checkpointing (which the split by memory
    counts): the checker prints, the trainers run, the tool and --advise show the sizes kit.model.Model.sizes gives.
    6 layers on 4 GPUs split evenly is [2, 1, 1, 2]: the Encoder with the first part, the Decoder with the last."""
    model = own.describe(*MIXED)
    advised = advise_sizes(capsys, nb_part)
    for ckpt in ([], ["--activation-checkpointing"]):
        want = model.splits(nb_part, 4, 16, checkpointing=bool(ckpt))
        if not ckpt:
            assert advised == want
        for stage in (False, True):
            assert tool_sizes(capsys, nb_part, stage, ckpt) == want, (stage, ckpt)
            for split in kit.arguments.SPLITS:
                assert checker_sizes(capsys, split, nb_part, stage, ckpt) == want[split], (split, stage, ckpt)
                assert trainer_sizes(split, nb_part, stage, ckpt) == want[split], (split, stage, ckpt)
    if nb_part == 4:  # the bug: the tool and --advise showed [1, 1, 2, 2]
        assert want["even"] == [2, 1, 1, 2]
    if nb_part < 5:  # the split by memory of checkpointed layers is not the one of plain layers (all hold it)
        assert want["memory"] != model.sizes(nb_part, "memory", 4, 16)
