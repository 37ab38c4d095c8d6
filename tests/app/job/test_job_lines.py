"""Lines of the ranks of a job never run together: each is one write(2).

Four processes share one stderr pipe, unbuffered as under ``python -u``, and
each writes many lines at once; every line read back is whole. (``print``
writes the text and the newline apart there, which once gave
``...--resumerrfp: stopped: ...``.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT

pytestmark = pytest.mark.e2e

WRITER = """
import sys, time
from rrfp.app.job.job_lines import say
rank = int(sys.argv[1])
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # start together
for i in range(400):
    say(f"rrfp: error: rank {rank}: line {i} " + "x" * 200)
"""


@pytest.mark.timeout(60)
def test_lines_of_concurrent_ranks_stay_whole():
    import time

    start = str(time.time() + 1.5)
    script = (
        "import os, subprocess, sys\n"
        "procs = [subprocess.Popen([sys.executable, '-u', '-c', sys.argv[1], str(r), sys.argv[2]]) "
        "for r in range(4)]\n"
        "sys.exit(max(p.wait() for p in procs))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script, WRITER, start],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    broken = [
        ln
        for ln in lines
        if not (
            ln.startswith("rrfp: error: rank ")
            and ln.endswith("x" * 200)
            and ln.count("rrfp:") == 1
        )
    ]
    assert len(lines) == 4 * 400 and not broken, (len(lines), broken[:3])
