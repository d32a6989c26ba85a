"""check_topology.py's command line run in this process, for the tests about its verdict: `run_checker(*args)` returns
the subprocess.CompletedProcess that `subprocess.run([python, "check_topology.py", *args], capture_output=True,
text=True)` returns, so a call site changes by one word, without a Python start-up and the checker's imports each time
(about 0.15 s on an idle 2-core machine, 0.5 s on a loaded one; main() itself takes a few milliseconds).

Each call sees what a fresh process sees: the environment it is given (or this one's), its own working folder, its
own stdout and stderr, warnings printed to that stderr, and none of the state an earlier call left in a module: the
caches that hold answers keyed by a name whose content can change between two calls are emptied first
(RESET_BETWEEN_CALLS). The command line itself (exit codes of a real process, stdin, Ctrl-C, resource limits, the
import time) stays with the tests that start the real process (tests/test_check_topology.py's run_cli)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import check_topology
from kit import own_split, site_slurm

ROOT = Path(__file__).resolve().parent.parent


def _reset_module_state() -> None:
    """What a module keeps between two calls of main() in one process that a new process would not have:
    kit.site_slurm._SILENT (a Slurm that did not answer, remembered per user and SLURM_CONF: a later test's cluster
    would not be asked) and kit.own_split.plan_model's cache (keyed by the --model spec, a file a test may rewrite).
    The other caches of the checker's path (kit.arguments._reading_parser, kit.memory's) are pure functions of their
    arguments."""
    site_slurm._SILENT.clear()
    own_split.plan_model.cache_clear()


RESET_BETWEEN_CALLS = (_reset_module_state,)


def run_checker(*args: str, env: dict[str, str] | None = None, cwd: Path | str | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """check_topology.main(args) with `env` as the whole environment (None: this process's), in `cwd` (None: this
    process's), its stdout and stderr captured; an uncaught SystemExit is its exit status, as in a process. `timeout`
    is taken for the subprocess form's sake and not enforced: a test whose point is a bound uses the real process."""
    del timeout
    for reset in RESET_BETWEEN_CALLS:
        reset()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")  # printed to the captured stderr, as a fresh python does
            try:
                code = check_topology.main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
    finally:
        os.chdir(saved_cwd)
        if dict(os.environ) != saved_env:
            os.environ.clear()
            os.environ.update(saved_env)
    return subprocess.CompletedProcess([sys.executable, str(ROOT / "check_topology.py"), *args], code,
                                       out.getvalue(), err.getvalue())
