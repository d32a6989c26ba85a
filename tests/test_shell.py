"""kit/shell.py: a job script's shell run in the mind as bash runs it (kit/bash.py's lexer and parser beneath it): which
commands run with which words, expansions against bash itself, and any text read without a crash. The shell's cost
budget against hostile scripts: tests/test_faults_round3.py and tests/test_faults_checker.py; the launch lines it
finds: tests/test_jobscript.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kit.shell


# ---- the shell, read as bash reads it ---------------------------------------------------------------------------
def commands(text: str, variables: dict | None = None) -> list[list[str]]:
    ran: list = []
    shell = kit.shell.ShellRun({k: kit.shell.ShellRun.known(v) for k, v in (variables or {}).items()}, ran.append)
    shell.run_script(text)
    return [r.fields for r in ran]


@pytest.mark.parametrize("text,expected", [
    ('A=1\nB="x $A"\necho $B "$B"', [["echo", "x", "1", "x 1"]]),  # unquoted values split, quoted ones don't
    ('ARGS="--chunks $CH"\nrun $ARGS', [["run", "--chunks", "$CH"]]),  # an unknown expansion stays whole
    ('X=(a b "c d")\necho ${X[1]} "${X[@]}" ${#X[@]} "${X[*]}"', [["echo", "b", "a", "b", "c d", "3", "a b c d"]]),
    ("N=${N:-4}\necho $((N * 2)) ${M:-$N}", [["echo", "8", "4"]]),  # a default when the script never sets it
    ('if [ -z "$Y" ]; then Y=1; fi\necho $Y', [["[", "-z", "$Y", "]"], ["echo", "$Y"]]),  # set in one branch only
    ("if true; then Y=1; else Y=1; fi\necho $Y", [["true"], ["echo", "1"]]),  # every branch agrees
    ("for b in 32 64; do run $b; done", [["run", "$b"]]),  # a loop's variable: any of its words
    ("cat > j.sh <<EOF\n#SBATCH -N 2\nsrun x\nEOF\nsbatch j.sh", [["cat"], ["sbatch", "j.sh"]]),  # a heredoc's body
    ("f() { srun python \"$@\"; }\nf t.py --a 1", [["srun", "python", "t.py", "--a", "1"]]),  # function call
    ("module purge; module load a b && ml c", [["module", "purge"], ["module", "load", "a", "b"], ["ml", "c"]]),
    ("srun -c $SLURM_CPUS_PER_TASK x 2>&1 | tee log", [["srun", "-c", "10", "x"], ["tee", "log"]]),
    ("exit 0\necho never", []),
    ("echo `date` $(hostname) \\\n  done", [["echo", "$(date)", "$(hostname)", "done"]]),
    ("case $1 in\n a) X=1 ;;\n *) X=1 ;;\nesac\necho $X", [["echo", "1"]]),
    ("(cd sub && X=2)\necho ${X:-none}", [["cd", "sub"], ["echo", "none"]]),  # a subshell keeps its variables
])
def test_the_shell_as_bash_runs_it(text, expected):
    assert commands(text, {"SLURM_CPUS_PER_TASK": "10"}) == expected


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@settings(max_examples=40 if os.environ.get("CI") == "true" else 150, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(["a", "b c", "x y  z", "", "--chunks=8", "*", "$((1+2))", "${N:-7}", "p q"]),
                min_size=1, max_size=4), st.booleans())
def test_expansion_matches_bash(values, quoted):
    """Random assignments and expansions: the fields equal what bash gives a function (with `set -f`: file-name
    globbing is the one expansion the reader leaves out, a launch line's program never depends on it)."""
    lines = "\n".join(f"V{i}={json.dumps(v)}" for i, v in enumerate(values))
    use = " ".join((f'"$V{i}"' if quoted else f"$V{i}") for i in range(len(values)))
    bash = subprocess.run(["bash", "-c", "set -f\n" + lines + "\nf() { printf '%s\\n' \"$#\" \"$@\"; }\nf " + use],
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"]}).stdout.split("\n")[:-1]
    mine = commands(lines + "\nf " + use)[0][1:]
    assert [str(len(mine))] + mine == bash, lines + "\n" + use


@settings(max_examples=60 if os.environ.get("CI") == "true" else 300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(list("ab $'\"`(){}[];&|<>\\\n#=-*") + ["EOF", "<<", "$(", "${", "if ", "fi",
                                 "do ", "done", "f() ", "case ", " in ", ";;", "esac"]), max_size=80))
def test_any_text_is_read_without_crashing(pieces):
    ran: list = []
    kit.shell.ShellRun({}, ran.append).run_script("".join(pieces))  # never raises, never loops
