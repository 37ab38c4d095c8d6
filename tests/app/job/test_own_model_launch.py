"""A user's own model through the launcher the README recommends, `rrfp train --nproc-per-node 2`,
as a new user runs it: the `rrfp` script, from a folder of their own. The script's process has its
bin folder on sys.path, not the folder it runs in, and its ranks (forks of it, set up as `python
-m rrfp` is) have that folder first; both must import the same module, and bad input stops in the
launcher with one line and nothing of torchrun's.

The children import rrfp from a folder that holds nothing else (``lib``: rrfp/), never
the repository, so that examples/ is found where the command runs, or not at all.

The job that trains the README's example is the console script as a user starts it, a fresh
interpreter: its sys.path, and its ranks' as they fork from it, are the point. The commands that
train nothing (a refusal at load, --dry-run, rrfp calibrate) and the jobs whose point is which
module a name resolves to (a one-file model, a project's own ``models`` package beside rrfp's
``gpt``) run the same script in a child of the test session's preloaded forkserver
(tests/harness/forked_python.py) with the sys.path that interpreter would have, not the
session's: where the model is found is still what is tested, without torch's import each time."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT
from harness.forked_python import run_python
from harness.launch import child_env

from rrfp.app.config.registry import known

pytestmark = pytest.mark.e2e

SCRIPT = Path(sys.executable).with_name("rrfp")  # the console script `pip install` wrote
TINY = ["--set", "run.steps=2", "--set", "schedule.n_microbatches=2"]


def user_folder(tmp: Path) -> Path:
    """A checkout as a user has it (examples/my_model.py and .toml), and rrfp importable from a
    folder of its own."""
    shutil.copytree(
        ROOT / "examples", tmp / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp / "lib").mkdir()
    (tmp / "lib" / "rrfp").symlink_to(ROOT / "rrfp")
    return tmp


def rrfp_script(folder: Path, tmp: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"no console script {SCRIPT}: install rrfp (make .venv/.installed)"
    return subprocess.run(
        [str(SCRIPT), *args, "--set", f"output.dir={tmp}/runs/{{model}}"],
        cwd=folder,
        env=child_env(PYTHONPATH=str(tmp / "lib")),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rrfp_forked(folder: Path, tmp: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``rrfp_script``'s command from the preloaded forkserver, with the script's own sys.path."""
    return run_python(
        [str(SCRIPT), *args, "--set", f"output.dir={tmp}/runs/{{model}}"],
        cwd=folder,
        env=child_env(PYTHONPATH=str(tmp / "lib")),
        timeout=timeout,
        own_path=True,
    )


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step +\d+/2 +loss (\d+\.\d+)", stdout)]


@pytest.mark.timeout(450)
def test_the_example_and_a_scratch_file_train_through_the_launcher(tmp_path):
    """examples/my_model.toml (a dotted module, from where the command runs) and a one-file model
    in a scratch folder (a file path), each on 2 ranks started by `rrfp train --nproc-per-node`:
    the example as a user starts the console script, the file through the same command from a
    forkserver child with the script's sys.path (``rrfp_forked``: where the file is found from is
    the point, which a second fresh interpreter's start would only repeat); the file under bare
    torchrun too, on one rank: a fresh ``python -m rrfp`` that finds the file from where it runs
    is the point there, which a second rank would only repeat."""
    here = user_folder(tmp_path)
    res = rrfp_script(
        here, tmp_path, "train", "--nproc-per-node", "2", "--config", "examples/my_model.toml",
        *TINY, timeout=140,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert len(losses(res.stdout)) == 2 and "done: 2 steps" in res.stdout, res.stdout
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "convnet.py").write_text((ROOT / "examples" / "my_model.py").read_text())
    (scratch / "run.toml").write_text('[run]\nmodel = "convnet.py:workload"\n')
    res = rrfp_forked(
        scratch, tmp_path, "train", "--nproc-per-node", "2", "--config", "run.toml", *TINY,
        timeout=140,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert len(losses(res.stdout)) == 2 and "done: 2 steps" in res.stdout, res.stdout
    # bare torchrun, the documented other launcher: the same file, from the same folder; the agent
    # from the preloaded forkserver (it imports no model), its rank a fresh interpreter
    res = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "rrfp",
         "train", "--config", "run.toml", *TINY, "--set", f"output.dir={tmp_path}/runs/{{model}}"],
        timeout=140, cwd=scratch, env={**os.environ, "PYTHONPATH": str(tmp_path / "lib")},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert len(losses(res.stdout)) == 2 and "done: 2 steps" in res.stdout, res.stdout


@pytest.mark.timeout(200)
def test_user_mistakes_at_load_are_one_line_under_the_launcher(tmp_path):
    """A [model] key of the wrong type, a module that is not there, and one whose import raises:
    the launcher's one line is the whole of stderr, exit 2, no rank started."""
    here = user_folder(tmp_path)
    (here / "raising.py").write_text("import torch\n\nWIDTH = torch.zeros(2)[5]\n")
    cases = [
        (
            ["--set", "model.width=16.5"],
            "rrfp: error: --set model.width = 16.5 has the wrong type (expected int)\n",
        ),
        (
            ["--set", "run.model=examples.my_modle"],
            f"rrfp: error: run.model 'examples.my_modle': no module examples.my_modle importable "
            f"from {here}, where the command runs (did you mean examples.my_model?); run.model is "
            f"a built-in model ({', '.join(known())}), a module importable from where the "
            "command runs (mypkg.model, mypkg.model:workload) or a .py file (path/to/model.py, "
            "from there too)\n",
        ),
        (
            ["--set", "run.model=raising"],
            "rrfp: error: run.model 'raising': importing raising raised IndexError: index 5 is out "
            "of bounds for dimension 0 with size 2 (raising.py, line 3)\n",
        ),
    ]
    for sets, stderr in cases:
        res = rrfp_forked(
            here, tmp_path, "train", "--nproc-per-node", "2", "--config", "examples/my_model.toml",
            *sets, timeout=60,
        )  # fmt: skip
        assert (res.returncode, res.stderr, res.stdout) == (2, stderr, ""), res.stderr


@pytest.mark.timeout(200)
def test_dry_run_and_calibrate_load_the_model_from_where_they_run(tmp_path):
    here = user_folder(tmp_path)
    res = rrfp_forked(
        here, tmp_path, "train", "--config", "examples/my_model.toml", "--dry-run", timeout=60
    )
    assert res.returncode == 0 and 'model = "examples.my_model"' in res.stdout, res.stderr
    res = rrfp_forked(
        here, tmp_path, "calibrate", "--config", "examples/my_model.toml", "--pp", "2",
        "--samples", "2", "--out", str(tmp_path / "cost.json"), timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and (tmp_path / "cost.json").is_file(), res.stderr


@pytest.mark.timeout(300)
def test_a_project_with_its_own_models_package_trains_a_built_in_model_and_its_own(tmp_path):
    """``models`` is a common name for a project's package: with one in the folder the command
    runs in (first on sys.path), ``gpt`` is still rrfp's and ``models.mine`` is the project's.
    Which module each name resolves to is the point: both jobs run the console script's command
    from a child of the preloaded forkserver with the script's sys.path (``rrfp_forked``, the
    ranks forks of it; the forkserver has imported rrfp.models.gpt), the example's job above
    being the fresh interpreter's start."""
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text('"""The project\'s own models."""\n')
    (project / "models" / "mine.py").write_text((ROOT / "examples" / "my_model.py").read_text())
    (project / "lib").mkdir()
    (project / "lib" / "rrfp").symlink_to(ROOT / "rrfp")
    small = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.block_size=64",
             "--set", "data.max_seq_len=64"]  # fmt: skip
    (project / "gpt.toml").write_text('[run]\nmodel = "gpt"\n')
    (project / "mine.toml").write_text('[run]\nmodel = "models.mine"\n')
    train = ["train", "--nproc-per-node", "2", *TINY]
    for config, extra in (("gpt.toml", small), ("mine.toml", [])):
        res = rrfp_forked(project, project, *train, "--config", config, *extra, timeout=140)
        assert res.returncode == 0, config + res.stdout[-2000:] + res.stderr[-3000:]
        assert len(losses(res.stdout)) == 2 and "done: 2 steps" in res.stdout, res.stdout
