"""Renamed public names keep their old spelling for one release: the old module path, CLI flag,
class or keyword still works, gives the same thing as the new one, and says once that it is
deprecated and what replaces it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert warned.startswith("warned: rrfp.sim.planning is deprecated: import rrfp.sim.planned_hint")
    assert same == "True"
