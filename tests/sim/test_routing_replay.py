"""Durations from a recorded routing: the busiest EP rank's tokens set each task's time; experts on
one rank (nothing to wait for) replay the dense pipeline; bad records are one line."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.app.cli.main import main
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig
from rrfp.sim.routing_replay import Routing
from rrfp.sim.sweep import as_run, sweep

MOE = Variability.preset("moe")


def _rows(tokens, ep=1):
    """JSON lines from ``tokens[step][stage][mb][layer][replica]`` = counts per expert."""
    return [
        json.dumps(
            {
                "step": step,
                "stage": s,
                "microbatch": m,
                "layer": lay,
                "replica": r,
                "ep": ep,
                "tokens": list(c),
            }
        )
        for step, stages in enumerate(tokens)
        for s, mbs in enumerate(stages)
        for m, layers in enumerate(mbs)
        for lay, reps in enumerate(layers)
        for r, c in enumerate(reps)
    ]


def test_load_is_the_busiest_ep_ranks_tokens_over_the_mean():
    # one layer, two replicas whose counts add up: experts [10, 2, 2, 2] + [6, 2, 0, 0]
    rec = Routing.parse(_rows([[[[[[10, 2, 2, 2], [6, 2, 0, 0]]]]]]))
    assert (rec.stages, rec.microbatches, rec.experts, rec.steps) == (1, 1, 4, [0])
    assert rec.load(0, 0, 0, ep=2) == pytest.approx(20 / 12)  # ranks hold 20 and 4 of 24
    assert rec.load(0, 0, 0, ep=4) == pytest.approx(16 / 6)
    assert rec.load(0, 0, 0, ep=1) == 1.0


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(
        st.lists(st.integers(0, 50), min_size=4, max_size=4).filter(any), min_size=2, max_size=6
    )
)
def test_a_busier_rank_makes_every_kind_longer(counts):
    """One stage, one layer, one replica: microbatches ranked by their load rank alike in F, B
    and W (the backward routes the forward's tokens)."""
    rec = Routing.parse(_rows([[[[[c]] for c in counts]]]))
    dur = rec.durations(MOE, ep=4)[0][0]
    loads = np.array([rec.load(0, 0, m, 4) for m in range(len(counts))])
    for k in Kind:
        for i in range(len(counts)):
            for j in range(len(counts)):
                if loads[i] > loads[j] + 1e-9:
                    assert dur[i, k] > dur[j, k]
    assert dur[:, Kind.F].mean() == pytest.approx(1.0)


def test_experts_on_one_rank_replay_the_dense_pipeline():
    """With ep 1 nobody waits for a busier rank: every task takes the mean, and the sweep's
    makespans are the no-variability preset's."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, size=(2, 3, 4, 2, 1, 8)).tolist()  # step, stage, mb, layer, rep
    rec = Routing.parse(_rows(tokens))
    durations = rec.durations(MOE)
    assert np.allclose(np.array(durations), 1.0)
    base = SimConfig(3, 4, budget="2x", variability=MOE)
    replayed = sweep(base, ["fixed", "ready"], [], 2, durations=durations, budgets=[])
    dense = sweep(
        SimConfig(3, 4, budget="2x", variability=Variability.preset("none")),
        ["fixed", "ready"],
        [],
        2,
    )
    assert {r.key: r.makespans for r in replayed} == {r.key: r.makespans for r in dense}
    # spread over 8 ranks the same record makes microbatches differ
    assert np.array(rec.durations(MOE, ep=8)).std() > 0.01


def test_an_unsplit_backward_holds_w():
    dur = np.arange(12, dtype=float).reshape(2, 2, 3)
    folded = as_run(dur, split=False)
    assert (folded[..., Kind.W] == 0).all()
    assert np.allclose(folded[..., Kind.B], dur[..., Kind.B] + dur[..., Kind.W])
    assert as_run(dur, split=True) is dur


@pytest.mark.parametrize(
    "lines, needle",
    [
        (["{not json"], "line 1: not a routing row"),
        ([json.dumps({"step": 0, "stage": 0, "microbatch": 0, "layer": 0})], "line 1"),
        (
            _rows([[[[[[1, 2]]]]]]) + _rows([[[[[[1, 2, 3]]]]]]),
            "line 2: 3 experts, ep 1, unlike line 1",
        ),
        ([], "no routing rows"),
        (_rows([[[[[[1, 2]]], [[[1, 2]]]]], [[[[[1, 2]]]]]]), "step 1 has 1 of 2 microbatches"),
    ],
)
def test_a_bad_record_is_one_clear_line(tmp_path, capsys, lines, needle):
    path = tmp_path / "routing.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["sim", "--routing", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_flags_that_cannot_take_a_record(tmp_path, capsys):
    path = tmp_path / "routing.jsonl"
    path.write_text("\n".join(_rows([[[[[[4, 2, 1, 1]]]]]])) + "\n")
    for argv, needle in [
        (["--ep", "3"], "ep 3 does not divide the record's 4 experts"),
        (["--oracle"], "--oracle does not take them"),
        (["--virtual", "2"], "leave out --virtual"),
    ]:
        assert main(["sim", "--routing", str(path), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1], err
    assert main(["sim", "--ep", "2"]) == 2
    assert "goes with --routing" in capsys.readouterr().err
