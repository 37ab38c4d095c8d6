"""What the `rrfp` command sets in its environment before torch loads, which every process it
starts inherits (the ranks `--nproc-per-node` forks, torchrun's agent): one OpenMP thread unless
the user chose a count (a rank's ``compute.threads`` sets its own), and torch's C++ warnings off
unless the user chose a level."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from rrfp.app.cli import main as cli_main


def _entry_env(monkeypatch, **user: str) -> dict[str, str]:
    """The environment ``entry()`` leaves, started with ``user`` set and the two variables
    otherwise unset; main itself is not run."""
    for name in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    with mock.patch.object(cli_main, "main", return_value=0), pytest.raises(SystemExit) as ended:
        cli_main.entry()
    assert ended.value.code == 0
    return {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")}


def test_unset_variables_get_one_openmp_thread_and_no_cpp_warnings(monkeypatch):
    assert _entry_env(monkeypatch) == {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def test_the_users_own_values_are_kept(monkeypatch):
    env = _entry_env(monkeypatch, OMP_NUM_THREADS="4", TORCH_CPP_LOG_LEVEL="WARNING")
    assert env == {"OMP_NUM_THREADS": "4", "TORCH_CPP_LOG_LEVEL": "WARNING"}
