"""Parameters shared between stages (a tied input embedding and LM head): each holder keeps its own
copy, and after every iteration the copies' gradients are summed across their holders, so every copy
gets the whole gradient and, stepped by the same optimizer, the copies stay equal.

A tie is declared per stage module, ``{tie name: qualified parameter name}``. At setup (collective:
every rank calls it, in the same order) every rank learns every rank's ties from one exchange over
the world (two all-reduces of the pickled declarations); each tie held by several ranks gets one
process group per (tp, dp) coordinate over the ranks that hold it (``new_group`` on every rank in
one order, members or not), and its copies are made equal by a broadcast from the holder of its
lowest stage. Copies on one rank that are different Parameter objects are summed locally; one
Parameter object in two stage modules needs nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rrfp.comm.channels import named_collective
from rrfp.comm.collectives import completed
from rrfp.comm.grad_norm import local
from rrfp.pipeline.timeouts import BACKSTOP

log = logging.getLogger("rrfp.pipeline.ties")


@dataclass
class _Tie:
    name: str
    params: list[
        tuple[int, nn.Parameter]
    ]  # (stage, parameter) on this rank, distinct objects, by stage
    group: object = (
        None  # over the ranks that hold it (same tp and dp); None: held by this rank only
    )
    ranks: list[int] = field(default_factory=list)
    counted: bool = False  # this rank holds the tie's lowest stage: its norm counts the tie once
    root: int = 0  # the global rank that holds the lowest stage: every copy takes its values


def _declared(
    modules: Sequence[nn.Module], stages: Sequence[int], tied
) -> dict[str, list[tuple[int, nn.Parameter]]]:
    """{tie: [(stage, parameter)]} on this rank. ``tied``: one dict looked up in every module, or
    one per module."""
    if tied is None:
        return {}
    shared = not isinstance(
        tied, (list, tuple)
    )  # one dict for every module: a name need not be in each
    per_module = [tied] * len(modules) if shared else list(tied)
    if len(per_module) != len(modules):
        raise ValueError(
            f"tied: one dict per stage module, got {len(per_module)} for stages {list(stages)}"
        )
    found: dict[str, list[tuple[int, nn.Parameter]]] = {}
    wanted: dict[str, str] = {}
    for module, stage, ties in zip(modules, stages, per_module):
        if not isinstance(ties, Mapping):
            raise TypeError(
                f"tied must map tie names to parameter names, got {type(ties).__name__}"
            )
        for tie, qual in ties.items():
            if not isinstance(tie, str) or not isinstance(qual, str):
                raise TypeError(
                    f"tied: tie names and parameter names are strings, got {tie!r}: {qual!r}"
                )
            wanted[tie] = qual
            try:
                p = module.get_parameter(qual)
            except AttributeError:
                if not shared or len(modules) == 1:  # a module's own dict: the name must be there
                    raise ValueError(
                        f"tie {tie!r}: stage {stage} has no parameter {qual!r}"
                    ) from None
                continue
            held = found.setdefault(tie, [])
            if all(p is not q for _, q in held):
                held.append((stage, p))
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(
            f"tie {missing[0]!r}: no parameter {wanted[missing[0]]!r} in stage(s) {list(stages)}"
        )
    for tie, held in found.items():
        shapes = {tuple(p.shape) for _, p in held}
        if len(shapes) > 1:
            raise ValueError(
                f"tie {tie!r}: the copies on stages {[s for s, _ in held]} differ in shape "
                f"{sorted(shapes)}"
            )
    return found


@contextlib.contextmanager
def _bounded(rt, what: str):
    """The setup's exchange waits at most ``process_group_s`` for a rank that never calls
    ``stage_executor``, as the start-up's waits do, and fails as one line naming ``what``: it
    blocks the loop thread, where the heartbeat's watcher cannot bound it, and with a heartbeat
    the world group's own timeout is the one-day backstop."""
    bound = datetime.timedelta(seconds=rt.timeouts.process_group_s)
    backstop = rt.heartbeat is not None
    if backstop:
        dist.distributed_c10d._set_pg_timeout(bound, rt.cpu_group)
    try:
        with named_collective(f"{what} ({rt.timeouts.said('process_group_s')})", rt.cpu_group):
            yield
    finally:
        if backstop:
            dist.distributed_c10d._set_pg_timeout(BACKSTOP, rt.cpu_group)


def _exchange(obj, rank: int, world: int, group) -> list:
    """Every rank's ``obj`` (blocking, at setup), from two all-reduces over the world: the sizes,
    then each rank's pickled bytes in its own row."""
    if world == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = data.numel()
    dist.all_reduce(sizes, group=group)
    rows = torch.zeros(world, int(sizes.max()), dtype=torch.uint8)
    rows[rank, : data.numel()] = data
    dist.all_reduce(rows, group=group)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]


def _fingerprint(p: torch.Tensor) -> str | None:
    """A hash of the values, for the forgotten-tie hint; None for a constant tensor (ones, zeros),
    which matches by accident. An FSDP-sharded parameter: this rank's shard."""
    t = local(p).detach()
    if t.numel() < 2 or bool((t == t.reshape(-1)[0]).all()):
        return None
    return hashlib.sha1(
        t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


class Ties:
    """A rank's tied parameters: ``sum_grads()`` per iteration, ``uncounted`` for the norm."""

    def __init__(self, ties: list[_Tie], poller, lane=None) -> None:
        self.ties, self.poller, self.lane = ties, poller, lane
        self.deferred = False  # a DP gradient sync sums them after its averaging (GradSync.attach)
        # parameters whose gradient another copy (the lowest stage's) already counts in the global
        # norm
        self.uncounted = {
            id(p) for t in ties for i, (_, p) in enumerate(t.params) if i > 0 or not t.counted
        }

    @classmethod
    def setup(cls, rt, modules: Sequence[nn.Module], tied) -> Ties:
        """Exchange all ranks' ties over ``rt``'s world, make their groups, equalize the copies."""
        stages = list(rt.stages)
        found = _declared(modules, stages, tied)
        coords = rt.layout.coords(rt.rank)
        ends = cls._end_params(modules, stages, rt.num_stages, found)
        mine = {
            "rank": rt.rank,
            "tp": coords.tp,
            "dp": coords.dp,
            "ties": {t: (held[0][0], tuple(held[0][1].shape)) for t, held in found.items()},
            "ends": {s: [(n, tuple(p.shape)) for n, p in named] for s, named in ends.items()},
        }
        with _bounded(rt, "tie setup: the world's exchange of tied parameters"):
            everyone = _exchange(mine, rt.rank, rt.layout.world_size, rt.cpu_group)
        ties = []
        timeout = datetime.timedelta(seconds=rt.timeouts.process_group_s)
        for tie in sorted({t for r in everyone for t in r["ties"]}):
            for tp, dp in sorted({(r["tp"], r["dp"]) for r in everyone if tie in r["ties"]}):
                holders = sorted(
                    (r["ties"][tie][0], r["rank"], r["ties"][tie][1])
                    for r in everyone
                    if tie in r["ties"] and (r["tp"], r["dp"]) == (tp, dp)
                )
                shapes = {shape for *_, shape in holders}
                if len(shapes) > 1:
                    where = ", ".join(f"stage {s} {list(shape)}" for s, _, shape in holders)
                    raise ValueError(
                        f"rank {rt.rank}: tie {tie!r}: the tied parameters differ in shape "
                        f"({where})"
                    )
                ranks = sorted({r for _, r, _ in holders})
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rt.rank in ranks:
                    root = holders[0][1]
                    if group is not None and rt.heartbeat is not None:
                        dist.distributed_c10d._set_pg_timeout(BACKSTOP, group)
                    ties.append(
                        _Tie(tie, found[tie], group, ranks, counted=rt.rank == root, root=root)
                    )
                    log.info(
                        "rank %d: tie %r over ranks %s (stages %s)",
                        rt.rank,
                        tie,
                        ranks,
                        [s for s, _, _ in holders],
                    )
        for t in ties:
            cls._make_equal(t)
        cls._hint_forgotten(rt, everyone, ends, modules, stages)
        return cls(ties, rt.poller, rt.lane)

    @staticmethod
    @torch.no_grad()
    def _make_equal(t: _Tie) -> None:
        first = t.params[0][1]
        if t.group is not None:
            dist.broadcast(first.data, src=t.root, group=t.group)
        for _, p in t.params[1:]:
            p.copy_(first)

    @staticmethod
    def _end_params(
        modules, stages, num_stages: int, found
    ) -> dict[int, list[tuple[str, nn.Parameter]]]:
        """First and last stage parameters no tie declares (on this rank, when it holds them)."""
        if num_stages < 2:
            return {}
        declared = {id(p) for held in found.values() for _, p in held}
        return {
            s: [(n, p) for n, p in m.named_parameters() if id(p) not in declared]
            for m, s in zip(modules, stages)
            if s in (0, num_stages - 1)
        }

    @staticmethod
    def _hint_forgotten(rt, everyone, ends, modules, stages) -> None:
        """A parameter of the first stage and one of the last with the same shape and the same
        values that no tie declares: one warning (a hint, not proof), on the first stage's rank of
        tp 0 and dp 0. Every rank takes part in the second exchange alike, since every rank can tell
        whether it is needed."""
        last = rt.num_stages - 1
        pairs = []  # (tp, dp, first-stage name, last-stage name)
        for tp, dp in sorted({(r["tp"], r["dp"]) for r in everyone}):
            at = [r for r in everyone if (r["tp"], r["dp"]) == (tp, dp)]
            firsts = [(n, shape) for r in at for n, shape in r["ends"].get(0, [])]
            lasts = [(n, shape) for r in at for n, shape in r["ends"].get(last, [])]
            pairs += [(tp, dp, a, b) for a, sa in firsts for b, sb in lasts if sa == sb]
        if not pairs:
            return
        coords = rt.layout.coords(rt.rank)
        named = {s: dict(params) for s, params in ends.items()}
        prints = {}
        for tp, dp, a, b in pairs:
            if (tp, dp) == (coords.tp, coords.dp):
                if 0 in named:
                    prints[(0, a)] = _fingerprint(named[0][a])
                if last in named:
                    prints[(last, b)] = _fingerprint(named[last][b])
        everyone_prints = _exchange(prints, rt.rank, rt.layout.world_size, rt.cpu_group)
        if not (0 in named and coords.tp == 0 and coords.dp == 0):
            return
        seen: dict[tuple[int, str], str | None] = {}
        for r, got in zip(everyone, everyone_prints):
            if (r["tp"], r["dp"]) == (0, 0):
                seen.update(got)
        for tp, dp, a, b in pairs:
            if (
                (tp, dp) == (0, 0)
                and seen.get((0, a)) is not None
                and seen.get((0, a)) == seen.get((last, b))
            ):
                log.warning(
                    "stage 0's %r and stage %d's %r have the same shape and the same values, and "
                    "no tie declares them: if they are one shared parameter, declare it (tied=), "
                    "or each copy trains on its own part of the gradient",
                    a,
                    last,
                    b,
                )

    async def sum_grads(self) -> None:
        """Every copy's gradient becomes the sum over all copies (a missing one counts as zeros)."""
        lane_order = (
            self.lane.stream_context() if self.lane is not None else contextlib.nullcontext()
        )
        with lane_order:  # the gradients are written in the lane's order (its stream on GPU)
            pending = [
                self._launch(t) for t in self.ties if t.group is not None or len(t.params) > 1
            ]
        for t, total, work in pending:
            if work is not None:
                await completed(
                    self.poller,
                    work,
                    f"sum of tie {t.name!r}'s gradients over ranks {t.ranks}",
                    group=t.group,
                )
            for i, (_, p) in enumerate(t.params):
                if (
                    p.requires_grad
                ):  # a frozen copy keeps no gradient; the sum still runs, as on its peers
                    p.grad = total if i == 0 else total.clone()

    @staticmethod
    def _launch(t: _Tie) -> tuple[_Tie, torch.Tensor, object]:
        """This rank's sum of the tie's copies, with the all-reduce over its holders started."""
        grads = [p.grad.to_dense() for _, p in t.params if p.grad is not None]
        total = torch.zeros_like(t.params[0][1]) if not grads else grads[0].clone()
        for g in grads[1:]:
            total += g
        work = dist.all_reduce(total, group=t.group, async_op=True) if t.group is not None else None
        return t, total, work
