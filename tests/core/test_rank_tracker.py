"""RankTracker: one rank's arbiter over its virtual stages.

V = 1 makes exactly the StageTracker's decisions; with V > 1 every task runs
once, after its dependencies, the rank budget holds and a tight budget does
not deadlock; the V turn at the last rank is local."""

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.core.budget import Budget
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.rank_tracker import RankTracker, StageTask
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import StageTracker, TrackerError


class _StageAsRank:
    """Today's StageTracker behind the RankTracker's events, to compare decisions."""

    def __init__(self, tracker: StageTracker) -> None:
        self.tr, self.stage = tracker, tracker.spec.stage

    def next(self):
        t = self.tr.next()
        return None if t is None else StageTask(self.stage, t)

    def start(self, stage, task):
        self.tr.start(task)

    def finish(self, stage, task):
        return self.tr.finish(task)

    def arrive(self, stage, kind, mb):
        self.tr.arrive(kind, mb)

    @property
    def done(self):
        return self.tr.done

    @property
    def held(self):
        return self.tr.held

    def blocked(self):
        return self.tr.blocked()


def drive(layout, ranks, seed, latency=0.05, on_start=None):
    """Run one iteration with random task times; returns every rank's (time, stage, task) decisions.
    Local destinations are delivered at once, remote ones after ``latency``."""
    rng = random.Random(seed)
    events, seq, log = [], 0, []

    def push(t, ev):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, ev))

    def decide(r, now):
        item = ranks[r].next()
        if item is None:
            return
        ranks[r].start(*item)
        log.append((r, round(now, 9), item.stage, item.task))
        if on_start:
            on_start(r, item)
        push(now + rng.uniform(0.2, 2.0), ("done", r, item))

    for r in range(len(ranks)):
        decide(r, 0.0)
    while events:
        now, _, ev = heapq.heappop(events)
        touched = set()
        while True:
            if ev[0] == "done":
                _, r, item = ev
                dest = ranks[r].finish(*item)
                touched.add(r)
                if dest is not None:
                    to = layout.rank_of(dest)
                    if to == r:
                        ranks[r].arrive(dest, item.kind, item.mb)
                    else:
                        push(now + latency, ("arrive", to, dest, item.kind, item.mb))
            else:
                _, to, dest, kind, mb = ev
                ranks[to].arrive(dest, kind, mb)
                touched.add(to)
            if not events or events[0][0] > now:
                break
            now, _, ev = heapq.heappop(events)
        for r in sorted(touched):
            decide(r, now)
    stuck = [f"rank {r} {rk.blocked()}" for r, rk in enumerate(ranks) if not rk.done]
    assert not stuck, "; ".join(stuck)
    return log


def rank_trackers(hint, layout, M, split, dispatch, budget, size_of=None):
    return [
        RankTracker(hint.rank_spec(layout, r, M, split, dispatch, budget), size_of)
        for r in range(layout.ranks)
    ]


@settings(max_examples=40, deadline=None)
@given(
    S=st.integers(1, 5),
    M=st.integers(1, 9),
    seed=st.integers(0, 10**6),
    hint=st.sampled_from(["1f1b", "gpipe", "zbh1", "bf", "bfw", "plan"]),
    dispatch=st.sampled_from(list(Dispatch)),
    budget=st.sampled_from(["1x", "2x", "1", "3"]),
    by_bytes=st.booleans(),
)
def test_one_stage_per_rank_decides_as_the_stage_tracker(
    S, M, seed, hint, dispatch, budget, by_bytes
):
    h, lay = resolve(hint), VirtualLayout(S, 1)
    split = hint in ("zbh1", "bfw", "plan")
    sizes = [random.Random(seed + m).randint(1, 100) for m in range(M)]
    b = Budget.parse("150b" if by_bytes else budget)
    old = drive(
        lay,
        [
            _StageAsRank(StageTracker(h.spec(S, s, M, split, dispatch, b), sizes.__getitem__))
            for s in range(S)
        ],
        seed,
    )
    new = drive(lay, rank_trackers(h, lay, M, split, dispatch, b, sizes.__getitem__), seed)
    assert new == old


@pytest.mark.parametrize(
    "placement,hint",
    [(p, h) for p in ("interleaved", "v") for h in ("bfw", "bf", "plan", "gpipe")]
    + [("interleaved", "1f1b"), ("v", "zbv")],
)
def test_virtual_runs_every_task_once_after_its_dependencies(placement, hint):
    S, V, M = 4, 2, 8
    lay = VirtualLayout(S, V, placement)
    h = resolve(hint)
    for dispatch in Dispatch:
        for seed in range(5):
            log = drive(lay, rank_trackers(h, lay, M, True, dispatch, Budget.parse("2x")), seed)
            seen = {}
            for i, (r, _, s, t) in enumerate(log):
                assert lay.rank_of(s) == r
                assert (s, t) not in seen
                seen[(s, t)] = i
            assert len(seen) == S * V * M * 3
            for (s, t), i in seen.items():  # F through the stages in order, B back, W after B
                if t.kind is Kind.F and s > 0:
                    assert seen[(s - 1, t)] < i
                if t.kind is Kind.B:
                    assert seen[(s, Task(Kind.F, t.mb))] < i
                    if s < S * V - 1:
                        assert seen[(s + 1, t)] < i
                if t.kind is Kind.W:
                    assert seen[(s, Task(Kind.B, t.mb))] < i


@settings(max_examples=40, deadline=None)
@given(
    S=st.integers(1, 5),
    M=st.integers(1, 12),
    seed=st.integers(0, 10**6),
    placement=st.sampled_from(["interleaved", "v"]),
    V=st.integers(2, 3),
    hint=st.sampled_from(["bf", "bfw", "plan"]),
    budget=st.sampled_from(["1x", "2x", "1", "0.5x", "0.25x"]),
)
def test_rank_budget_holds_and_tight_budgets_finish(S, M, seed, placement, V, hint, budget):
    if placement == "v":
        V = 2
    lay, b = VirtualLayout(S, V, placement), Budget.parse(budget)
    ranks = rank_trackers(resolve(hint), lay, M, hint != "bf", Dispatch.READY, b)
    limits = [b.rank_limit(lay, r).count for r in range(S)]

    def check(r, item):
        assert ranks[r].held.count <= limits[r]

    drive(lay, ranks, seed, on_start=check)  # asserts every rank finished: no deadlock
    assert all(rk.held.peak <= lim for rk, lim in zip(ranks, limits))
    assert all(rk.held.count == 0 for rk in ranks)


def test_byte_budget_over_the_rank_finishes_and_holds():
    """A byte budget over the rank: a chunk with nothing held at it or later runs alone (as a large
    microbatch does at V = 1), so the rank holds at most the limit plus V-1 chunks."""
    S, V, M = 3, 2, 10
    lay = VirtualLayout(S, V, "v")
    sizes = [10 + 7 * (m % 4) for m in range(M)]  # a chunk's bytes
    ranks = rank_trackers(
        resolve("bfw"), lay, M, True, Dispatch.READY, Budget.parse("60b"), sizes.__getitem__
    )
    over = []

    def check(r, item):
        rk = ranks[r]
        if rk.held.bytes > 60 + (V - 1) * max(sizes):
            over.append((r, rk.held.bytes))

    for seed in range(10):
        ranks[:] = rank_trackers(
            resolve("bfw"), lay, M, True, Dispatch.READY, Budget.parse("60b"), sizes.__getitem__
        )
        drive(lay, ranks, seed, on_start=check)
    assert not over
    assert max(rk.held.peak for rk in ranks) >= 3  # the budget let several chunks in at once


@settings(max_examples=40, deadline=None)
@given(
    S=st.integers(1, 4),
    M=st.integers(1, 10),
    V=st.integers(2, 3),
    placement=st.sampled_from(["interleaved", "v"]),
    limit=st.integers(20, 120),
    sizes=st.lists(st.integers(1, 150), min_size=10, max_size=10),
    hint=st.sampled_from(["bf", "bfw", "plan"]),
    seed=st.integers(0, 10**6),
)
def test_byte_budget_holds_the_caps_the_oracle_models(S, M, V, placement, limit, sizes, hint, seed):
    """What the oracle's model caps by bytes at V > 1 (``byte_caps``) is what the tracker holds:
    chunks 0..c of a rank, each counted at min(size, limit), at most limit + c * the largest,
    chunks larger than the limit included. The model is a floor only if this holds for every run."""
    from rrfp.sim.oracle import byte_caps

    if placement == "v":
        V = 2
    lay = VirtualLayout(S, V, placement)
    ranks = rank_trackers(
        resolve(hint), lay, M, hint != "bf", Dispatch.READY, Budget(bytes=limit), sizes.__getitem__
    )
    demand, caps = byte_caps(V, limit, sizes[:M])
    over = []

    def check(r, item):
        rk = ranks[r]  # checked after every start: only an F's start adds to what a rank holds
        prefix = 0
        for c, s in enumerate(rk.stages):
            prefix += sum(
                demand[m] for g, m in rk._sizes if g == s
            )  # the (stage, mb) chunks held now
            if prefix > caps[c]:
                over.append((r, c, prefix, caps[c]))

    drive(lay, ranks, seed, on_start=check)
    assert not over


def test_the_v_turn_is_local_and_named():
    lay = VirtualLayout(2, 2, "v")  # rank 1 holds stages 1 and 2
    rk = RankTracker(resolve("bfw").rank_spec(lay, 1, 2, True, Dispatch.READY, Budget.parse("2x")))
    assert rk.blocked().startswith(
        "has nothing ready (stage 1: 2 input(s) and 2 gradient(s) not arrived; "
        "stage 2: 2 input(s) and 2 gradient(s) not arrived)"
    )
    rk.arrive(1, Kind.F, 0)
    item = rk.next()
    assert item == StageTask(1, Task(Kind.F, 0))
    rk.start(*item)
    assert rk.finish(*item) == 2 and rk.holds(
        2
    )  # the destination is on this rank: deliver it at once
    rk.arrive(2, Kind.F, 0)
    assert rk.next() == StageTask(2, Task(Kind.F, 0))
    with pytest.raises(TrackerError, match="rank 1 holds stages 1, 2, not stage 3"):
        rk.arrive(3, Kind.F, 0)
    rk.start(2, Task(Kind.F, 0))
    with pytest.raises(TrackerError, match="started while F0 of stage 2 runs"):
        rk.start(1, Task(Kind.F, 1))
    assert "is running F0@2" in rk.blocked()


def test_later_chunk_has_room_reserved():
    """With room for one microbatch (2 chunk units): a chunk-0 F is refused once one unit is held,
    so the microbatch's own chunk-1 F always fits; without the reserve the rank would deadlock."""
    lay = VirtualLayout(2, 2, "v")
    rk = RankTracker(resolve("bfw").rank_spec(lay, 1, 3, True, Dispatch.READY, Budget.parse("1")))
    assert rk.spec.limit.count == 2
    rk.arrive(1, Kind.F, 0)
    rk.arrive(1, Kind.F, 1)
    rk.start(1, Task(Kind.F, 0))
    assert rk.finish(1, Task(Kind.F, 0)) == 2
    assert rk.next() is None  # F1 of chunk 0 would take the unit chunk 1 needs
    assert "budget full" in rk.blocked()
    rk.arrive(2, Kind.F, 0)
    assert rk.next() == StageTask(2, Task(Kind.F, 0))


def test_nx_gives_every_layout_1f1bs_peak_per_device_spread_by_need():
    """Nx at V stages per rank: the fullest rank gets N times 1F1B's peak (S microbatches of its
    layers), every rank the same share of its need (1F1B's S - r at V = 1; balanced in the v shape),
    so at the same N every layout has the same peak per device."""
    from rrfp.core.budget import rank_need

    S = 8
    assert [rank_need(VirtualLayout(S, 1), r) for r in range(S)] == [S - r for r in range(S)]
    assert {rank_need(VirtualLayout(S, 2, "v"), r) for r in range(S)} == {S + 0.5}
    assert [rank_need(VirtualLayout(S, 2), r) for r in range(S)] == [
        (3 * S - 2 * r) / 2 for r in range(S)
    ]
    layouts = (
        VirtualLayout(S, 1),
        VirtualLayout(S, 2),
        VirtualLayout(S, 2, "v"),
        VirtualLayout(S, 3),
        VirtualLayout(S, 4),
    )
    for n in ("0.5x", "1x", "1.5x", "2x", "4x"):
        budget = Budget.parse(n)
        for lay in layouts:
            counts = [budget.rank_limit(lay, r).count for r in range(S)]
            assert max(counts) == budget.multiple * S * lay.virtual, (
                n,
                lay,
                counts,
            )  # 1F1B's peak x N
            needs = [
                rank_need(lay, r) for r in range(S)
            ]  # spread by need: less need, never more room
            by_need = [c for _, c in sorted(zip(needs, counts), reverse=True)]
            assert by_need == sorted(by_need, reverse=True), (n, lay, counts)
    # interleaved, 1x: rank r gets 16 x (24 - 2r) / 24 chunks, rounded down (rank 0: 1F1B's 8
    # microbatches)
    assert [Budget.parse("1x").rank_limit(VirtualLayout(S, 2), r).count for r in range(S)] == [
        16,
        14,
        13,
        12,
        10,
        9,
        8,
        6,
    ]
    two = Budget.parse("2x")
    assert [two.rank_limit(VirtualLayout(S, 2, "v"), r).count for r in range(S)] == [
        4 * S
    ] * S  # ZB-V's x 2
    assert two.rank_limit(VirtualLayout(S, 1), 3) == two.limit(S, 3)
    assert (
        Budget.parse("0.1x").rank_limit(VirtualLayout(S, 2, "v"), 0).count == 2
    )  # one microbatch through both
    assert (
        Budget.parse("3").rank_limit(VirtualLayout(S, 2), 0).count == 6
    )  # 3 microbatches = 6 chunks
    assert two.rank_limit(4, 0, 2) == two.rank_limit(
        VirtualLayout(4, 2), 0
    )  # the int form of the first commit
