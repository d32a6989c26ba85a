"""Modern job scripts on the real Slurm 22.05.8 (issue 40): every case of tests/job_cases.py submitted at once to the
local cluster, each job's fate measured (refused, pending, or each step's exit status and placement), held equal to
the one recorded in the table, and the checker's verdict on the same script held to what Slurm did just now.
`pytest -s` prints the measured table."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

import check_topology as ct
from job_cases import CASES, NAME, measure, verdict_problems

pytestmark = pytest.mark.slurm


def test_each_case_meets_its_measured_fate_and_the_checker_agrees(slurm_cluster, tmp_path):
    measured = measure(slurm_cluster)
    wrong = []
    print(f"\n{'case':45} {'fate':8} what Slurm did")
    for case in CASES:
        fate, output = measured[case.name]
        shown = fate.text or fate.state + " steps " + " ".join(f"{line}:{rc}" for _, line, rc in fate.steps)
        print(f"{case.name:45} {fate.kind:8} {shown}")
        if fate != case.fate._replace(words=()):
            wrong.append(f"{case.name}: measured {fate}, recorded {case.fate._replace(words=())}")
        missing = [w for w in case.fate.words if w not in output]
        if missing:
            wrong.append(f"{case.name}: the job's output lacks {missing}: {output[-800:]}")
        (tmp_path / NAME).write_text(case.script)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ct.main(["--json", "--site", "jean-zay", str(tmp_path / NAME)])
        wrong += [f"{case.name}: {p}" for p in verdict_problems(case, fate, json.loads(out.getvalue()))]
    assert not wrong, "\n".join(wrong)
