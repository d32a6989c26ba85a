"""The model families users bring (issue 41), planned: tied weights found and counted once (GPT-2's head tied to its
embedding), the loss over the gathered output in the last part's estimate."""
from __future__ import annotations

import pytest
import torch

from kit import own_model

ZOO = "tests/zoo_families.py"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def unique_params(spec: str) -> int:
    layers, _ = own_model.build_layers(spec, device="meta")
    return sum(p.numel() for p in {id(p): p for layer in layers for p in layer.parameters()}.values())


def test_tied_weights_are_found_and_counted_once():
    """GPT-2's lm_head holds wte's Parameter: the model's parameters are the unique ones (wte's 512 x 32 once), its
    pair named; untied, the head owns a weight of its own and nothing is shared."""
    tied = own_model.describe(f"{ZOO}:gpt2_tiny_lm", "4x16")
    untied = own_model.describe(f"{ZOO}:gpt2_tiny_lm_untied", "4x16")
    assert tied.shared == [(0, 3, "wte.weight")] and untied.shared == []
    assert sum(c.params for c in tied.costs) == unique_params(f"{ZOO}:gpt2_tiny_lm")
    assert sum(c.params for c in untied.costs) == sum(c.params for c in tied.costs) + 512 * 32
    assert sum(sum(c.tensors) for c in tied.costs) == sum(c.params for c in tied.costs)
    assert tied.refusal([4], "replica") is None and "share the parameter wte.weight" in tied.refusal([2, 2], "stage")
