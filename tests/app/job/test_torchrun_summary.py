"""An rrfp refusal under a bare torchrun: torchrun's agent prints its own failure summary, and
the line it shows for the failed rank is rrfp's, read by torch's own ProcessFailure from the
error file the agent gave the rank."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from rrfp.app.job.job_lines import refuse_once


def test_torchruns_summary_shows_the_refusal_line(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = "rrfp: error: schedule.hnt: unknown key (did you mean hint?)"
    refuse_once("schedule.hnt: unknown key", line)
    assert capsys.readouterr().err.strip() == line
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("rrfp", {0: failure}).format_msg()
    assert line in summary and "To enable traceback" not in summary, summary


def test_without_torchrun_no_error_file_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    refuse_once("x", "rrfp: error: x")
    assert list(tmp_path.iterdir()) == []
