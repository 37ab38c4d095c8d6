"""Every command a comment in configs/*.toml shows runs as written: each ``rrfp ...`` line of a
comment is run from the repository root, ``rrfp train`` with ``--dry-run`` added (the configs are
for GPUs and long runs; the dry run checks the command line, the config with its overrides, the
layout and the backend the way a real start does, and prints the estimate). A command refused
fails the test with its stderr."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
from harness import ROOT
from harness.launch import child_env, rrfp_argv

pytestmark = pytest.mark.e2e

COMMAND = re.compile(r"^#\s+rrfp\s+(.+?)\s*$")


def commands() -> list[tuple[str, list[str]]]:
    """(config file name, the command's arguments after ``rrfp``) for every comment command."""
    found = []
    for path in sorted((ROOT / "configs").glob("*.toml")):
        for line in path.read_text().splitlines():
            m = COMMAND.match(line)
            if m:
                found.append((path.name, shlex.split(m.group(1))))
    return found


COMMANDS = commands()


def test_the_configs_show_commands():
    """Not vacuous: llama-1b.toml shows its two-GPU and its one-GPU command."""
    shown = {" ".join(args) for name, args in COMMANDS if name == "llama-1b.toml"}
    assert "train --nproc-per-node 2 --config configs/llama-1b.toml" in shown, shown
    assert any("virtual=2" in c for c in shown), shown


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,args", COMMANDS, ids=[" ".join(a) for _, a in COMMANDS])
def test_a_comment_command_runs_as_written(name, args):
    if args[0] == "train" and "--dry-run" not in args:
        args = [*args, "--dry-run"]
    res = subprocess.run(
        rrfp_argv(*args),
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert res.returncode == 0, f"{name}: rrfp {' '.join(args)}: {res.stderr}"
    assert "error" not in res.stderr, res.stderr
