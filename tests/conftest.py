"""Shared test fixtures: repo imports, the real Slurm cluster, the lanes that CI must not skip, and the
compatibility results each lane writes (tests marked `compat("<column>")`; tests/compat_table.py renders them)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_slurm import LocalCluster, SlurmUnavailable, unavailable_reason  # noqa: E402

# A shell's background job (`make test &`, `( ... & )` in a script) starts with SIGINT ignored, and an ignored signal
# stays ignored across exec: the trainers these tests start would be deaf to the Ctrl-C the signal tests send, and
# hold_stop_signals() keeps an ignored SIGINT ignored (as it must for a user's background job). pytest's own default
# is Python's handler, which its children get back as the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def skip_or_fail(reason: str, required_by: str) -> None:
    """Skip with the reason, or fail where CI (KIT_REQUIRE_*=1) says this lane must run."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{reason} ({required_by}=1: this lane must run here)", pytrace=False)
    pytest.skip(reason)


def started_cluster(variant: str = "default"):
    """A real local Slurm cluster of `variant` (tests/local_slurm.py), for a fixture to yield; stopped after."""
    reason = unavailable_reason(variant)
    if reason:
        skip_or_fail(reason, "KIT_REQUIRE_SLURM")
    # under /tmp and world-traversable: munged and the job users must reach the munge socket
    root = Path(tempfile.mkdtemp(prefix=f"kit-slurm-{variant}-"))
    cluster = LocalCluster(root, variant)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        skip_or_fail(str(exc), "KIT_REQUIRE_SLURM")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root / "db", ignore_errors=True)  # the accounting variant's database (90 MB); logs stay


CLUSTER_FIXTURES = {"slurm_cluster", "slurm_accounting", "affinity_cluster"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses a local cluster is a Slurm test, marked or not: `make test` runs the Slurm tests beside the
    lanes and the others alone (-m "not slurm"), so one left unmarked would start a cluster among the timed tests.
    Runs before -m selects (tryfirst)."""
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(autouse=True)
def own_environment():
    """Every test's changes to os.environ end with it: idr_torch.export_env() and nccl_environment() write it
    themselves (monkeypatch undoes only its own setenv), and a RANK=4 left by one test made the trainers that a later
    test started print nothing (only rank 0 speaks)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster (slurmctld, one slurmd per node of local_slurm.PARTITIONS, munged) started once, stopped at
    the end of the session."""
    yield from started_cluster()


@pytest.fixture(scope="session")
def slurm_accounting():
    """A real Slurm cluster whose slurmctld enforces QoS and associations kept by a real slurmdbd and MariaDB
    (local_slurm.py's "accounting" variant: Jean Zay's QoS, accounts abc@v100, abc@a100, abc@cpu, xyz@v100). Skipped
    where slurmdbd or mariadb-server is missing, a failure instead where KIT_REQUIRE_SLURM=1."""
    yield from started_cluster("accounting")


# ---- the matrix: every lane (one venv per torch release) records what its compat-marked tests showed ----------------
# KIT_COMPAT_DIR (set by `make test`) receives torch-<version>.json: per column, the tests that passed, failed,
# or passed by checking the release's refusal (a test calls `refused(request, message)` for those).
_COMPAT: dict[str, dict[str, list[str]]] = {}


def refused(request: pytest.FixtureRequest, message: str) -> None:
    """Record that this test passed by checking the release's up-front refusal, not by running the feature."""
    request.node.user_properties.append(("compat_refused", message))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    marks = [v for k, v in report.user_properties if k == "compat_columns"]
    if not marks or (report.when != "call" and report.passed):
        return
    why = [v for k, v in report.user_properties if k == "compat_refused"]
    outcome = "failed" if report.failed else "skipped" if report.skipped else "refused" if why else "passed"
    for column in marks[0]:
        cell = _COMPAT.setdefault(column, {"passed": [], "failed": [], "skipped": [], "refused": []})
        cell[outcome].append(report.nodeid + (f" ({why[0]})" if why else ""))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    columns = [c for m in item.iter_markers("compat") for c in m.args]
    if columns:
        item.user_properties.append(("compat_columns", columns))


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("KIT_COMPAT_DIR")
    if not folder or not _COMPAT:
        return
    import torch
    version = torch.__version__.split("+")[0]
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = Path(folder) / f"torch-{version}.json"
    # one release's tests may come in several runs (make test: test-local, then test-slurm): each adds its own
    columns = json.loads(out.read_text())["columns"] if out.exists() else {}
    for column, cell in _COMPAT.items():
        for outcome, tests in cell.items():
            columns.setdefault(column, {}).setdefault(outcome, []).extend(tests)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"torch": version, "columns": columns}, indent=1, sort_keys=True))
    tmp.replace(out)
