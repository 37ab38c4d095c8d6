"""How ``run.model`` finds a workload (rrfp/app/config/registry.py): a built-in name, a module
importable from the directory the command runs in, or a .py file (relative to that directory);
what it says when it finds none, and when the user's module raises on import.

Each test runs in a folder of its own that is not on ``sys.path`` (the test process has the
repository there, as a user's ``rrfp`` script has its own bin folder): what imports from it, the
resolver put there. ``sys.path`` and ``sys.modules`` are restored after each test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness import ROOT

from rrfp.app.config.registry import find_workload
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.pipeline.workload import Workload

MY_MODEL = (ROOT / "examples" / "my_model.py").read_text()


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder to run in, off sys.path; sys.path and the modules imported from it restored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if str(tmp_path) in str(getattr(sys.modules[name], "__file__", "") or ""):
            del sys.modules[name]


def write(path: Path, text: str = MY_MODEL) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def refused(name: str, config: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        find_workload(name, config)
    line = str(info.value)
    assert "\n" not in line, line
    return line


def origin(wl: Workload) -> Path:
    return Path(sys.modules[wl.build_stage.__module__].__file__).resolve()


def test_a_dotted_module_imports_from_the_directory_the_command_runs_in(here):
    write(here / "mypkg_dotted" / "convnet.py")
    wl = find_workload("mypkg_dotted.convnet")
    assert isinstance(wl, Workload) and origin(wl) == here / "mypkg_dotted" / "convnet.py"
    assert find_workload("mypkg_dotted.convnet:workload") is wl
    assert sys.path[0] == str(here)  # first, where `python -m rrfp` (the ranks) has it


def test_a_bare_name_that_is_not_built_in_is_a_module_beside(here):
    write(here / "convnet_bare.py")
    assert origin(find_workload("convnet_bare")) == here / "convnet_bare.py"


def test_a_built_in_name_wins_over_a_module_of_the_same_name(here):
    write(here / "gpt.py", "raise RuntimeError('the built-in gpt was not taken')\n")
    assert find_workload("gpt").name == "gpt"


@pytest.mark.parametrize(
    "written", ["sub/file_model.py", "sub/file_model.py:workload", "{here}/sub/file_model.py"]
)
def test_a_file_path_is_from_the_directory_the_command_runs_in(here, written):
    write(here / "sub" / "file_model.py")
    wl = find_workload(written.format(here=here))
    assert origin(wl) == here / "sub" / "file_model.py"
    # imported once, under its own name, so every rank and the launcher hold the same module
    assert sys.modules["file_model"].workload is wl
    assert find_workload("sub/file_model.py") is wl


def test_a_file_with_future_annotations_is_type_checked(here):
    """The config dataclasses' annotations are strings there: get_type_hints resolves them in the
    file's module, which therefore sits in sys.modules under its name."""
    write(here / "future_model.py", "from __future__ import annotations\n" + MY_MODEL)
    cfg = write(here / "run.toml", '[run]\nmodel = "future_model.py"\n[model]\nwidth = 32\n')
    assert TrainConfig.load(cfg, [], world_size=2).model.width == 32
    with pytest.raises(ConfigError, match=r"model.width = 16.5 has the wrong type \(expected int"):
        TrainConfig.load(cfg, ["model.width=16.5"], world_size=2)


def test_a_relative_path_beside_the_config_is_not_found_but_named(here):
    write(here / "cfg" / "beside.py")
    cfg = write(here / "cfg" / "run.toml", '[run]\nmodel = "beside.py"\n')
    line = refused("beside.py", cfg)
    assert f"no file beside.py in {here}, where the command runs" in line, line
    assert "beside the config" in line and "write cfg/beside.py" in line, line
    assert origin(find_workload("cfg/beside.py")) == here / "cfg" / "beside.py"


@pytest.mark.parametrize(
    "written,guess",
    [
        ("examples.my_modle", "examples.my_model"),  # a typo in the module
        ("my_model", "examples.my_model"),  # the module, without its folder
        ("examples/my_modle.py", "examples/my_model.py"),  # a typo in a file name
        ("my_model.py", "examples/my_model.py"),  # the file, without its folder
        ("gtp", "gpt"),  # a built-in one
        ("examples/my_model", "examples/my_model.py"),  # a path without .py
    ],
)
def test_a_name_that_finds_nothing_says_where_it_looked_and_what_is_close(here, written, guess):
    write(here / "examples" / "my_model.py")
    line = refused(written)
    assert f"(did you mean {guess}?)" in line, line
    if not written.endswith("my_model"):  # a name: where it looked, and how to name one
        assert str(here) in line, line
    if "/" not in written and not written.endswith(".py"):
        assert "run.model is a built-in model (gpt," in line and "mypkg.model" in line, line


def test_a_module_whose_import_raises_is_the_users_error_at_their_line(here):
    write(here / "raising.py", "import torch\n\nWIDTH = torch.zeros(2)[5]\n")
    line = refused("raising")
    assert line.startswith("run.model 'raising': importing raising raised IndexError: index 5 ")
    assert line.endswith("(raising.py, line 3)"), line
    # a package the module imports that is not installed is the module's error, not "no module"
    write(here / "needs_dep.py", "import a_package_nobody_has\n")
    line = refused("needs_dep.py")
    assert "raised ModuleNotFoundError: No module named 'a_package_nobody_has'" in line, line
    assert line.endswith("(needs_dep.py, line 1)") and "needs_dep" not in sys.modules, line
    write(here / "bad_syntax.py", "x = (\n")
    assert refused("bad_syntax.py").endswith("(bad_syntax.py, line 1)")


def test_a_module_without_the_workload_says_what_it_has(here):
    write(here / "named.py", MY_MODEL.replace("\nworkload = ", "\nconvnet = "))
    line = refused("named")
    assert "named has no Workload named 'workload' (it has convnet: write named:convnet)" in line
    assert find_workload("named:convnet").name == "my_model"
    write(here / "plain.py", "WIDTH = 3\n")
    assert refused("plain").endswith(
        "plain has no Workload named 'workload' (define workload = rrfp.Workload(...) in it)"
    )


def test_a_file_named_as_an_imported_module_is_refused(here):
    write(here / "json.py")
    line = refused("json.py")
    assert "would be imported as json, but a module of that name is imported already" in line
    assert "rename the file" in line


def test_a_name_that_is_no_name(here):
    assert "names no workload (did you mean gpt?)" in refused(".gpt")
    assert "after ':' comes the name of the module's Workload" in refused("gpt:")


def test_a_run_folder_names_a_file_model_without_its_py():
    from rrfp.app.train.metrics_files import model_slug

    assert model_slug("gpt") == "gpt"
    assert model_slug("convnet.py") == "convnet"
    assert model_slug("path/to/net.py:small") == "path-to-net-small"
    assert model_slug("mypkg.net:workload") == "mypkg.net-workload"
