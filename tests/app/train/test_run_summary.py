"""The start-up summary ``rrfp train`` prints and writes into run.json, built from the config and
the memory check's footprints: each pipeline rank's budget against 1F1B's count (S - r), the
estimate beside 1F1B's with the same per-microbatch activations, the data each kind of source
says it found, and what is said when the model cannot be measured."""

from __future__ import annotations

from harness.synthetic_costs import cost_file

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.train.run_summary import run_summary, summary_lines
from rrfp.app.train.start_checks import footprints


def test_each_rank_beside_1f1b():
    cfg = TrainConfig.load("configs/gpt-tiny.toml", ["pp=4"], world_size=4)
    prints = footprints(cfg)
    summary = run_summary(cfg, prints)
    ranks = summary["ranks"]
    assert [r["stages"] for r in ranks] == [[0], [1], [2], [3]]
    assert [r["in_flight_1f1b"] for r in ranks] == [4, 3, 2, 1]  # S - r
    assert [r["in_flight_limit"] for r in ranks] == [8, 6, 4, 2]  # budget 2x
    assert [r["in_flight_estimate"] for r in ranks] == [8, 6, 4, 2]  # all within M = 8
    for r, fp in zip(ranks, prints, strict=True):
        assert r["memory_estimate"] == fp.total  # the memory check's own estimate
        extra = (r["in_flight_estimate"] - r["in_flight_1f1b"]) * fp.one
        assert r["memory_estimate"] - r["memory_estimate_1f1b"] == extra
        assert r["params"] == list(fp.stage_params) and all(n > 0 for n in r["params"])
    assert summary["schedule"] == {
        "hint": "bfw",
        "dispatch": "ready",
        "budget": "2x",
        "n_microbatches": 8,
        "microbatches_per_step": 8,
    }
    data = summary["data"]
    assert data.startswith("the Python standard library's source as bytes: "), data
    assert f"{cfg.data.corpus_bytes:,} tokens (vocab 256" in data
    lines = summary_lines(summary)
    assert lines[0].startswith("run: gpt on 4 rank(s): pp=4 x tp=1 x dp=1; backend ")
    assert len(lines) == 3 + 4 and lines[3].startswith("pipeline rank 0: stage 0 (")


def test_the_schedule_line_names_the_stages_left_unsplit():
    cfg = TrainConfig.load("configs/gpt-tiny.toml", ["unsplit_stages=[-1, 0]"], world_size=4)
    summary = run_summary(cfg, footprints(cfg))
    assert summary["schedule"]["unsplit_stages"] == [0, 3]
    assert summary_lines(summary)[1].endswith("; stage 0, 3 unsplit (B the whole backward)")


def test_the_schedule_line_says_what_auto_chose_and_why(tmp_path):
    sets = ['unsplit_stages="auto"', f"emulation.cost={cost_file(tmp_path, pays=3)}"]
    cfg = TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=4)
    summary = run_summary(cfg, footprints(cfg))
    assert summary["schedule"]["unsplit_stages"] == [3]
    line = summary_lines(summary)[1]
    assert '; stage 3 unsplit (B the whole backward); unsplit_stages "auto": predicted ' in line
    assert line.endswith("x the makespan split everywhere"), line


def test_virtual_stages_and_data_parallel_replicas():
    sets = ["pp=2", "dp=2", "virtual=2", "n_microbatches=4"]
    cfg = TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=4)
    summary = run_summary(cfg, footprints(cfg))
    assert [r["stages"] for r in summary["ranks"]] == [[0, 2], [1, 3]]
    assert all(len(r["params"]) == 2 for r in summary["ranks"])
    assert summary["schedule"]["microbatches_per_step"] == 8  # 4 per replica, 2 replicas
    assert "pp=2, virtual=2 (interleaved) x tp=1 x dp=2" in summary_lines(summary)[0]


def test_a_workload_without_a_data_account_and_a_model_not_measured():
    cfg = TrainConfig.load("examples/my_model.toml", [], world_size=2)
    summary = run_summary(cfg, None)
    assert summary["data"] == (
        "the workload's own batches (my_model.batches; a microbatch: (16x32, 16x1))"
    )
    assert "params" not in summary["ranks"][0]
    lines = summary_lines(summary)
    assert lines[3] == (
        "pipeline rank 0: stage 0 (memory not estimated: the model does not build on the meta "
        "device); budget 4 in flight"
    )


def test_synthetic_data_says_so():
    cfg = TrainConfig.load("configs/vlm-tiny.toml", [], world_size=2)
    assert run_summary(cfg, None)["data"].startswith("synthetic: ")
