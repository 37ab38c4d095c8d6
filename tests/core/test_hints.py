import pytest

from rrfp.core.budget import Budget, InFlight, Limit
from rrfp.core.hints import BUILTIN, HintError, csv_hint, default_split, resolve, validate
from rrfp.core.policy import Dispatch, choose
from rrfp.core.tasks import B, F, Kind, Task, W, stage_tasks


def test_task_text_round_trip():
    for t in stage_tasks(12, True):
        assert Task.parse(str(t)) == t
    assert str(B(3)) == "B3"
    with pytest.raises(ValueError, match="not a task"):
        Task.parse("X1")


@pytest.mark.parametrize("name", list(BUILTIN))
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("S,M", [(1, 1), (2, 1), (4, 3), (4, 8), (8, 5)])
def test_builtin_orders_are_valid(name, split, S, M):
    h = resolve(name)
    for s in range(S):
        order = h.order(S, s, M, split)
        assert sorted(order) == sorted(stage_tasks(M, split))
        validate(order, M, split)


def test_1f1b_shape():
    order = resolve("1f1b").order(4, 1, 6, False)
    assert [str(t) for t in order] == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5".split()
    split = resolve("1f1b").order(4, 3, 2, True)
    assert [str(t) for t in split] == "F0 B0 W0 F1 B1 W1".split()


def test_gpipe_shape():
    assert [str(t) for t in resolve("gpipe").order(2, 0, 2, True)] == "F0 F1 B0 W0 B1 W1".split()


def test_class_hints_rank_by_kind():
    r = resolve("bfw").priority(4, 0, 4, True)
    assert max(r[B(m)] for m in range(4)) < min(r[F(m)] for m in range(4))
    assert max(r[F(m)] for m in range(4)) < min(r[W(m)] for m in range(4))
    r = resolve("bf").priority(4, 0, 4, False)
    assert r[B(3)] < r[F(0)]


def test_zbh1_keeps_1f1b_memory_and_defers_w():
    S, M = 4, 8
    for s in range(S):
        order = resolve("zbh1").order(S, s, M, True)
        inflight = peak = 0
        for t in order:
            inflight += t.kind is Kind.F
            inflight -= t.kind is Kind.W
            peak = max(peak, inflight)
        assert peak == min(S - s, M)
        # warm-up is 1F1B's
        assert order[: S - s - 1] == [F(m) for m in range(S - s - 1)]
    # stage 0 defers W: some W comes after a later B
    o = resolve("zbh1").order(S, 0, M, True)
    assert o.index(W(4)) > o.index(B(4)) and o[-1] == W(M - 1)


def test_validate_rejects_bad_orders():
    with pytest.raises(HintError, match="B0 comes before F0"):
        validate([B(0), F(0)], 1, False)
    with pytest.raises(HintError, match="twice"):
        validate([F(0), F(0), B(0)], 1, False)
    with pytest.raises(HintError, match="missing 1"):
        validate([F(0)], 1, False)
    with pytest.raises(HintError, match="W0 comes before B0"):
        validate([F(0), W(0), B(0)], 1, True)


def test_unknown_hint():
    with pytest.raises(HintError, match="unknown hint 'nope'"):
        resolve("nope")


def test_csv_hint(tmp_path):
    p = tmp_path / "h.csv"
    rows = ["stage,task"] + [
        f"{s},{t}" for s in range(2) for t in resolve("1f1b").order(2, s, 3, False)
    ]
    p.write_text("\n".join(rows))
    h = csv_hint(p)
    assert h.order(2, 1, 3, False) == resolve("1f1b").order(2, 1, 3, False)
    p.write_text("stage,task\n0,F0\n0,Q1\n")
    with pytest.raises(HintError, match=r"h.csv:3: not a task"):
        resolve(str(p))
    p.write_text("0,F0,B0\n")
    with pytest.raises(HintError, match="expected 'stage,task'"):
        resolve(str(p))
    p.write_text("0,B0\n0,F0\n")
    with pytest.raises(HintError, match="B0 comes before F0"):
        resolve(str(p)).order(1, 0, 1, False)


def test_callable_hint():
    h = resolve(
        lambda S, s, M, split: [f"F{m}" for m in range(M)] + [f"B{m}" for m in reversed(range(M))]
    )
    assert h.order(2, 0, 2, False) == [F(0), F(1), B(1), B(0)]
    assert resolve("rrfp.core.hints:gpipe").order(2, 0, 2, False) == resolve("gpipe").order(
        2, 0, 2, False
    )


def test_budget_parse():
    assert Budget.parse("2x").microbatches(8, 0) == 16
    assert Budget.parse("2x").microbatches(8, 7) == 2
    assert Budget.parse("1.5x").microbatches(4, 3) == 1
    assert Budget.parse(3).microbatches(8, 0) == 3
    assert Budget.parse("512MiB").bytes == 512 * 2**20
    assert Budget.parse("1GB").bytes == 10**9
    for bad in ["0", "-1", "0x", "lots", "0B"]:
        with pytest.raises(ValueError):
            Budget.parse(bad)


def test_policy_ready_and_fixed():
    prio = {t: i for i, t in enumerate([B(0), F(1), F(2), W(0)])}
    order = [F(1), B(0), W(0), F(2)]
    held = InFlight(count=1)
    assert choose(Dispatch.READY, {F(1), F(2), W(0)}, prio, order, 0, held, Limit(count=2)) == F(1)
    assert choose(Dispatch.READY, {F(1), W(0)}, prio, order, 0, held, Limit(count=1)) == W(
        0
    )  # budget full
    assert choose(Dispatch.READY, {F(2)}, prio, order, 0, held, Limit(count=1)) is None
    assert choose(Dispatch.READY, {B(0), F(1)}, prio, order, 0, held, Limit(count=5)) == B(0)
    assert (
        choose(Dispatch.FIXED, {F(2), W(0)}, prio, order, 1, held, Limit(count=1)) is None
    )  # waits for B0
    assert choose(Dispatch.FIXED, {B(0)}, prio, order, 1, held, Limit(count=1)) == B(0)
    # bytes: the best F does not fit, so no F runs (head of line)
    sizes = {1: 100, 2: 1}
    held = InFlight(count=1, bytes=50)
    assert (
        choose(
            Dispatch.READY, {F(1), F(2)}, prio, order, 0, held, Limit(bytes=120), sizes.__getitem__
        )
        is None
    )
    # a microbatch larger than the whole budget runs alone
    assert choose(
        Dispatch.READY, {F(1)}, prio, order, 0, InFlight(), Limit(bytes=10), sizes.__getitem__
    ) == F(1)


def test_default_split():
    assert default_split("bfw") and default_split("zbh1") and not default_split("1f1b")
