"""A script's command line run in this process, for the tests about its verdict: `run_checker(*args)` (check_topology.py)
and `run_main(script, main, *args)` (slurm/report.py, slurm/first_run_report.py) return the subprocess.CompletedProcess
that `subprocess.run([python, script, *args], capture_output=True, text=True)` returns, so a call site changes by one
word, without a Python start-up and the script's imports each time (the checker: about 0.15 s on an idle 2-core
machine, 0.5 s on a loaded one, where main() itself takes a few milliseconds; report.py: matplotlib's import too).

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
from collections.abc import Callable
from pathlib import Path

import check_topology
import idr_torch
from kit import own_split, site_slurm

ROOT = Path(__file__).resolve().parent.parent


def _reset_module_state() -> None:
    """What a module keeps between two calls of main() in one process that a new process would not have:
    kit.site_slurm._SILENT (a Slurm that did not answer, remembered per user and SLURM_CONF: a later test's cluster
    would not be asked), kit.own_split.described's cache (keyed by the --model spec, a file a test may rewrite) and
    idr_torch.current()'s Launch and its once-a-process note (kit.trainer_checks asks it where no environment is
    given). The other caches of the checker's path (kit.arguments._reading_parser, kit.memory's) are pure functions
    of their arguments."""
    site_slurm._SILENT.clear()
    own_split.described.cache_clear()
    idr_torch._current, idr_torch._current_key, idr_torch._said_plain = None, None, False


RESET_BETWEEN_CALLS = (_reset_module_state,)


def run_checker(*args: str, env: dict[str, str] | None = None, cwd: Path | str | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """check_topology.main(args) in this process (run_main); the module caches a new process would not have, emptied
    first. `timeout` is taken for the subprocess form's sake and not enforced: a test whose point is a bound uses the
    real process."""
    del timeout
    for reset in RESET_BETWEEN_CALLS:
        reset()
    return run_main(ROOT / "check_topology.py", check_topology.main, *args, env=env, cwd=cwd)


def run_main(script: Path, main: Callable[[list[str]], int | None], *args: str, env: dict[str, str] | None = None,
             cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """`python script args` as main(args) in this process: `env` the whole environment (None: this process's), `cwd`
    the working folder (None: this one), sys.argv[0] the script (argparse's prog), stdout and stderr captured; an
    uncaught SystemExit is its exit status, as in a process. An exception main() lets out fails the test with its
    traceback, where the process would have printed one."""
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    out, err = io.StringIO(), io.StringIO()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [str(script), *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")  # printed to the captured stderr, as a fresh python does
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        if dict(os.environ) != saved_env:
            os.environ.clear()
            os.environ.update(saved_env)
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code or 0, out.getvalue(),
                                       err.getvalue())
