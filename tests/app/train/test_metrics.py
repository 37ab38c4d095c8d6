"""What a run reports: the MFU count against a hand count, the JSON-lines file (fields, a line per
step, flushed, never written over), TensorBoard events, and the step lines on a terminal or not."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types

import pytest
import torch

from rrfp.app.cli.progress import StepProgress, step_line
from rrfp.app.train.metrics import RunMetrics
from rrfp.app.train.metrics_files import JsonLines, TensorBoardEvents, run_folder
from rrfp.app.train.metrics_mfu import ModelFlops, Peak, device_peak, model_flops
from rrfp.app.train.training import StepReport
from rrfp.models.gpt import GPTConfig, workload

TINY = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=64)  # configs/gpt-tiny.toml's model


def _hand_count(L: int, d: int, V: int) -> int:
    """gpt-tiny's matmul parameters, by hand: per block ln_1 and ln_2 (2d each), c_attn (3d x d +
    3d), attn c_proj (d x d + d), c_fc (4d x d + 4d), mlp c_proj (4d x d + d); then ln_f (2d) and
    the lm head (V x d, no bias). The token and position embeddings are only looked up."""
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return L * block + 2 * d + V * d


def test_mfu_of_gpt_tiny_against_a_hand_count():
    flops = model_flops(workload, TINY)
    n = _hand_count(4, 64, 256)
    assert n == 4 * (12 * 64 * 64 + 13 * 64) + 2 * 64 + 256 * 64 == 216_448
    assert flops == ModelFlops(n, 4, 64)
    assert model_flops(workload, TINY, num_stages=2) == flops  # counted over the run's stages
    for stages in (1, 2):  # the tied table counts once, as the lm head
        tied = model_flops(workload, dataclasses.replace(TINY, tie_embeddings=True), stages)
        assert tied.params == n
    # a step of two microbatches: 4 rows of 32 tokens and 4 rows of 100
    tokens, attn = 4 * 32 + 4 * 100, 4 * 32**2 + 4 * 100**2
    want = 6 * n * tokens + 12 * 4 * 64 * attn
    assert flops.step(tokens, attn) == want == 821_170_176
    metrics = RunMetrics.__new__(RunMetrics)
    metrics.flops, metrics.peak, metrics.ranks = flops, Peak(0.5, "test"), 4
    assert metrics.mfu(tokens, attn, wall_s=0.25) == pytest.approx(want / 0.25 / (0.5e12 * 4))


def test_peak_by_device():
    cpu = device_peak(torch.device("cpu"), "off", threads=4)
    assert cpu.tflops == pytest.approx(0.4) and cpu.indicative and "assumed" in cpu.source
    given = device_peak(torch.device("cpu"), "off", threads=4, configured=7.5)
    assert given == Peak(7.5, "output.peak_tflops") and not given.indicative


def _report(step: int, **kw) -> StepReport:
    base = dict(loss=2.0 - step / 10, tokens_per_s=1000.0, bubble=0.25, wall_s=0.5)
    return StepReport(step, 5, **{**base, **kw}, tokens=512.0, attn=8192.0, lr=1e-3)


def test_json_lines_one_flushed_line_per_step(tmp_path):
    folder = run_folder(str(tmp_path / "{model}-{time}"), "gpt", now=0)
    assert folder.name == "gpt-19700101-000000"
    metrics = RunMetrics(folder, ModelFlops(1000, 2, 8), Peak(1.0, "test"), 2, tensorboard=False)
    path = folder / "metrics.jsonl"
    for step in range(3):
        metrics.step(_report(step, grad_norm=0.5 if step else None))
        lines = path.read_text().splitlines()  # before close: every line is on disk already
        assert len(lines) == step + 1
    metrics.step(_report(3, loss=float("nan"), skipped=True))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    first = rows[0]
    assert set(first) == {
        "step", "loss", "lr", "tokens", "tokens_per_s", "mfu", "bubble", "wall_s", "skipped",
        "time",
    }  # fmt: skip
    assert "grad_norm" not in first and rows[1]["grad_norm"] == 0.5  # a field left None: left out
    assert first["mfu"] == pytest.approx((6 * 1000 * 512 + 12 * 2 * 8 * 8192) / 0.5 / 2e12)
    assert rows[3]["loss"] is None and rows[3]["skipped"] is True  # NaN is no JSON number
    metrics.close()
    # optional fields a report carries (an evaluation's loss) are written when set
    extra = dataclasses.make_dataclass(
        "EvalReport", [("eval_loss", float | None, None)], bases=(StepReport,)
    )
    again = run_folder(str(tmp_path / "{model}-{time}"), "gpt", now=0)
    assert again.name == "gpt-19700101-000000-2"  # the first run's folder is left alone
    m2 = RunMetrics(again, None, None, 1, tensorboard=False)
    m2.step(extra(0, 5, 1.0, 1.0, 0.0, 1.0, eval_loss=1.5))
    m2.close()
    row = json.loads((again / "metrics.jsonl").read_text())
    assert row["eval_loss"] == 1.5 and "mfu" not in row
    assert "eval loss 1.5000" in step_line(extra(0, 5, 1.0, 1.0, 0.0, 1.0, eval_loss=1.5))
    with pytest.raises(FileExistsError):
        JsonLines(path)  # never written over


def test_tensorboard_off_without_the_package(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level(logging.INFO, logger="rrfp.app.train.metrics_files"):
        assert TensorBoardEvents.open(tmp_path) is None
    assert "tensorboard package is not installed" in caplog.text


def test_tensorboard_scalars_per_step(tmp_path, monkeypatch):
    """Every numeric field is a scalar at the step's number, flushed each step (a fake
    SummaryWriter records the calls; test_tensorboard_event_files reads real files)."""
    calls = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("open", log_dir))

        def add_scalar(self, name, value, step):
            calls.append((name, value, step))

        def flush(self):
            calls.append("flush")

        def close(self):
            calls.append("close")

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    metrics = RunMetrics(tmp_path, ModelFlops(10), Peak(1.0, "t"), 1)
    metrics.step(_report(0, memory=[10, 30], memory_measure="rss peak"))
    metrics.step(_report(1))
    metrics.close()
    names = {c[0] for c in calls if isinstance(c, tuple) and c[0] != "open"}
    assert names == {f"train/{k}" for k in ("loss", "lr", "tokens", "tokens_per_s", "mfu",
                                            "bubble", "wall_s", "memory")}  # fmt: skip
    assert ("train/memory", 30, 1) in calls  # per rank: the largest
    assert ("train/loss", 1.9, 2) in calls and calls.count("flush") == 2 and calls[-1] == "close"


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")  # the optional package: what it writes reads back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = RunMetrics(tmp_path, ModelFlops(10), Peak(1.0, "t"), 1)
    for step in range(3):
        metrics.step(_report(step))
    metrics.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [round(e.value, 4) for e in loss] == [2.0, 1.9, 1.8]


def test_step_lines_plain_in_a_log_and_a_bar_on_a_terminal(capsys):
    lines = StepProgress(5, tty=False)
    lines(_report(0, grad_norm=0.25, mfu=0.125))
    out = capsys.readouterr().out
    assert out == step_line(_report(0, grad_norm=0.25, mfu=0.125)) + "\n"
    assert "loss 2.0000  grad norm 0.25  lr 0.001  1,000 tok/s  mfu 12.50%  bubble 25.0%" in out
    bar = StepProgress(5, first=1, tty=True)  # on stderr; each line kept above it, on stdout
    bar(_report(2))
    assert bar.bar.n == 3
    bar.close()
    shown = capsys.readouterr()
    assert "3/5" in shown.err and "loss 1.8000]" in shown.err.splitlines()[-1]
    assert shown.out == step_line(_report(2)) + "\n"


def test_measured_memory_and_in_flight_in_the_step_line_metrics_and_run_json(tmp_path):
    """Each rank's measured peak and microbatches in flight: in the printed line (MiB, with what
    the measure is), in the JSON line as lists, in TensorBoard as their largest, and the run's
    peaks in run.json beside what was there."""
    mib = 2**20
    report = _report(0, memory=[512 * mib, 300 * mib], memory_measure="rss peak", in_flight=[4, 2])
    line = step_line(report)
    assert "  mem 512/300 MiB (rss peak)  in flight 4/2  eta" in line
    many = _report(0, memory=[mib] * 9 + [7 * mib], memory_measure="cuda allocated peak")
    assert "  mem max 7 MiB (rank 9 of 10) (cuda allocated peak)" in step_line(many)
    metrics = RunMetrics(tmp_path, None, None, 2, tensorboard=False)
    metrics.write_about({"summary": {"ranks": []}})
    metrics.step(report)
    metrics.close([600 * mib, 300 * mib], "rss peak", [4, 2])
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["memory"] == [512 * mib, 300 * mib] and row["in_flight"] == [4, 2]
    assert row["memory_measure"] == "rss peak"
    about = json.loads((tmp_path / "run.json").read_text())
    assert about["summary"] == {"ranks": []}
    assert about["measured"] == {
        "memory_peak": [600 * mib, 300 * mib],
        "memory_measure": "rss peak",
        "in_flight_peak": [4, 2],
    }
