"""An output path a command cannot write is refused at its start with one line (exit 2), before the
minutes of work it would otherwise lose; what it writes gets the usual file mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import ROOT

from rrfp.app.cli.main import main
from rrfp.observe.trace import write_atomic


def _cases(blocked: Path):
    """(argv, flag) for every command that writes a file the user named; ``blocked`` is a plain
    file, so nothing can be made under it."""
    bad = blocked / "sub" / "out.json"
    return [
        (
            ["sim", "--pp", "2", "--n-microbatches", "2", "--seeds", "1", "--json", str(bad)],
            "--json",
        ),
        (
            ["sim", "--pp", "2", "--n-microbatches", "2", "--seeds", "1", "--trace", str(bad)],
            "--trace",
        ),
        (
            [
                "sim",
                "--pp",
                "2",
                "--n-microbatches",
                "2",
                "--seeds",
                "1",
                "--plot",
                str(bad.with_suffix(".png")),
            ],
            "--plot",
        ),
        (
            [
                "calibrate",
                "--config",
                str(ROOT / "configs/gpt-tiny.toml"),
                "--pp",
                "2",
                "--out",
                str(bad),
            ],
            "--out",
        ),
        (["bench", "--quick", "--out", str(blocked / "results")], "--out"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_an_unwritable_output_is_one_line_at_the_start(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv(
        "LOCAL_WORLD_SIZE", "1"
    )  # calibrate sets it for its one process: not for later tests
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder\n")
    argv, flag = _cases(blocked)[case]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith(f"rrfp: error: {flag} ")
        and "cannot write there" in err[0]
    ), err
    assert f"{blocked} is a file, not a folder" in err[0] or "Not a directory" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-file"
    ]  # nothing made, nothing half-written


def test_plot_refuses_an_unwritable_png(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert (
        main(
            [
                "sim",
                "--pp",
                "2",
                "--n-microbatches",
                "2",
                "--seeds",
                "1",
                "--hints",
                "1f1b",
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    assert main(["plot", str(trace), "--out", str(blocked / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rrfp: error: --out ") and "is a file, not a folder" in err[-1], err


def test_written_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left beside it
