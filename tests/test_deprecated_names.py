"""Renamed public names keep their old spelling for one release: the old module path, CLI flag,
class or keyword still works, gives the same thing as the new one, and says once that it is
deprecated and what replaces it."""

import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import rrfp_in_process

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_old_planning_module_path_reexports_and_warns():
    """In a fresh interpreter: a module already imported would not warn again."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    import rrfp.sim.planning\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore')\n"
        "import rrfp.sim.planning as old, rrfp.sim.planned_hint as new\n"
        "print(all(getattr(old, n) is getattr(new, n) for n in old.__all__))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    warned, same = out.stdout.splitlines()
    assert warned.startswith(
        "warned: rrfp.sim.planning is deprecated: import rrfp.sim.planned_hint"
    )
    assert same == "True"


def rrfp_cli(*args: str) -> subprocess.CompletedProcess:
    return rrfp_in_process(*args)


def test_sim_executors_is_dispatch_with_one_warning_line():
    flags = ("sim", "--pp", "2", "--mb", "4", "--seeds", "2", "--hints", "bfw,1f1b")
    new = rrfp_cli(*flags, "--dispatch", "ready,fixed")
    old = rrfp_cli(*flags, "--executors", "ready,fixed")
    assert new.returncode == old.returncode == 0, new.stderr + old.stderr
    assert old.stdout == new.stdout and "ready    bfw" in new.stdout
    assert old.stderr.splitlines() == ["rrfp: warning: --executors is deprecated, use --dispatch"]
    assert "deprecated" not in new.stderr
    # the old flag is checked as the new one is: one line naming the bad value, exit 2
    bad = rrfp_cli("sim", "--executors", "lazy")
    assert bad.returncode == 2 and "unknown dispatch mode 'lazy'" in bad.stderr.splitlines()[-1]


def test_bench_executors_is_contenders_with_one_warning_line(capsys):
    from rrfp.app.bench_command import build_spec
    from rrfp.app.cli import build_parser

    def parse(*flags):
        return build_parser().parse_args(["bench", "--quick", *flags])

    new = parse("--contenders", "fixed-1f1b,ready-plan")
    assert capsys.readouterr().err == ""
    old = parse("--executors", "fixed-1f1b,ready-plan")
    assert capsys.readouterr().err.splitlines() == [
        "rrfp: warning: --executors is deprecated, use --contenders"
    ]
    assert old.contenders == new.contenders == ["fixed-1f1b", "ready-plan"]
    assert build_spec(old) == build_spec(new)
    assert parse().contenders is None  # not given: the default set, not the alias's placeholder
