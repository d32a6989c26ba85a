"""nccl's flight-recorder variables under the names each torch release reads first, so that none prints "Environment
variable ... is deprecated" (torch 2.11 printed it twice per task for TORCH_NCCL_TRACE_BUFFER_SIZE)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import kit.train.launch

OLD = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NEW = ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
RELEASES = {"2.3.1": OLD, "2.4.1": OLD, "2.5.1": OLD, "2.6.0": OLD, "2.7.1": OLD, "2.8.0": NEW, "2.9.1": NEW,
            "2.10.0": NEW, "2.11.0+cu130": NEW, "2.12.0": NEW, "2.13.0+cpu": NEW, "2.14.1": NEW}


@pytest.mark.parametrize("version", RELEASES)
def test_flight_recorder_names_by_release(version):
    assert kit.train.launch.flight_recorder_names(version) == RELEASES[version]


def installed_torches() -> list[Path]:
    """This venv's torch and the release lanes' (the Makefile's VENV_CACHE), where they were built."""
    cache = Path(os.environ.get("VENV_CACHE", Path.home() / ".cache/hybrid-kit/venvs"))
    return [Path(torch.__file__).parent, *sorted(cache.glob("torch-*/lib/python3*/site-packages/torch"))]


@pytest.mark.parametrize("torch_dir", installed_torches(), ids=lambda p: p.parent.parent.parent.parent.name)
def test_the_names_are_what_the_release_reads_first(torch_dir):
    """The table against each installed release's own headers: the flight recorder's buffer-size list
    (FlightRecorder.hpp from 2.6, TraceUtils.h before) starts with the name the kit sets."""
    version = re.search(r"__version__ = .*?'([^']+)'", (torch_dir / "version.py").read_text())[1]
    c10d = torch_dir / "include/torch/csrc/distributed/c10d"
    lists = [m[1] for f in ("FlightRecorder.hpp", "TraceUtils.h") if (c10d / f).exists()
             for m in re.finditer(r"max_entries_ =\s*getCvarInt\(\s*\{([^}]*)\}", (c10d / f).read_text())]
    assert lists, f"no flight recorder buffer size read in {c10d}"
    first = re.findall(r'"([A-Z_]+)"', lists[0])[0]
    assert first == kit.train.launch.flight_recorder_names(version)[0], (version, lists)


@pytest.mark.parametrize("version", ["2.6.0", "2.11.0+cu130"])
def test_nccl_environment_sets_only_the_names_read_first(version, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", version)
    for name in (*OLD, *NEW, "TORCH_NCCL_DUMP_ON_TIMEOUT", "NCCL_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    said = kit.train.launch.nccl_environment()
    size, dump = RELEASES[version]
    other = OLD if (size, dump) == NEW else NEW
    assert os.environ[size] == "2000" and os.environ[dump].endswith("/rank_")
    assert not any(name in os.environ for name in other), other
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert f"its last 2000 collectives to {os.environ[dump]}" in said


def test_a_new_name_exported_for_an_older_release_is_carried_over(monkeypatch, tmp_path):
    """TORCH_FR_BUFFER_SIZE=500 exported by the user on 2.6, which does not read it: the value goes under the name
    2.6 reads; the user's value wins over the kit's 2000."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    for name in (*OLD, *NEW):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "mine_"))
    said = kit.train.launch.nccl_environment()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "mine_")
    assert f"its last 500 collectives to {tmp_path / 'mine_'}<rank>" in said
