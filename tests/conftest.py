"""Shared test fixtures: repo imports, the real Slurm cluster, the lanes that CI must not skip."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_slurm import LocalCluster, SlurmUnavailable, unavailable_reason  # noqa: E402


def skip_or_fail(reason: str, required_by: str) -> None:
    """Skip with the reason, or fail where CI (KIT_REQUIRE_*=1) says this lane must run."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{reason} ({required_by}=1: this lane must run here)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster (slurmctld, 5 slurmd, munged) started once, stopped at the end of the session."""
    reason = unavailable_reason()
    if reason:
        skip_or_fail(reason, "KIT_REQUIRE_SLURM")
    # under /tmp and world-traversable: munged and the job users must reach the munge socket
    root = Path(tempfile.mkdtemp(prefix="kit-slurm-"))
    cluster = LocalCluster(root)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        skip_or_fail(str(exc), "KIT_REQUIRE_SLURM")
    try:
        yield cluster
    finally:
        cluster.stop()
