"""Every command a comment in configs/*.toml shows runs as written: each ``rrfp ...`` line of a
comment is run from the repository root, ``rrfp train`` with ``--dry-run`` added (the configs are
for GPUs and long runs; the dry run checks the command line, the config with its overrides, the
layout and the backend the way a real start does, and prints the estimate). A command refused
fails the test with its stderr. The commands run in the test process (tests/harness/cli_run.py):
what is checked is the command line and the config, not the entry point, which `rrfp train`'s
subprocess smoke test covers (tests/app/cli/test_train_cli.py)."""

from __future__ import annotations

import re
import shlex

import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process

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


@pytest.mark.parametrize("name,args", COMMANDS, ids=[" ".join(a) for _, a in COMMANDS])
def test_a_comment_command_runs_as_written(name, args, monkeypatch):
    if args[0] == "train" and "--dry-run" not in args:
        args = [*args, "--dry-run"]
    monkeypatch.chdir(ROOT)
    res = rrfp_in_process(*args)
    assert res.returncode == 0, f"{name}: rrfp {' '.join(args)}: {res.stderr}"
    assert "error" not in res.stderr, res.stderr
