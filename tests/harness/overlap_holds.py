"""Holds that make the all-to-all overlap happen by construction in a pp 2 x ep 2 test, not by
timing: whether a W runs beside an all-to-all must not depend on how fast the ranks are.

Installed on one rank's executor and lane (``hold_windows``), they act inside each window (the
lane's ``yielding``: an EP task waiting at an all-to-all, the device free), on the lane's thread:

- **The arbiter sees every window.** The window stays open until the rank's arbiter has looked at
  it (asked the tracker for the ready tasks while it is open) or a task already runs beside: a
  W that may run beside is started in the window, however fast the peer reaches the collective.
- **A W is ready at an EP task's window.** In each iteration, on the last stage the first B
  waits in its first window until the input of a forward not yet started has arrived: once that B
  is done, its W is ready and so is an EP task (that forward, or the B of a forward already run
  when the budget holds the new one back), on both replicas alike; the round agrees one of them,
  the free W waits for it, and runs beside its first all-to-all. On the first stage, whose B has
  no all-to-all and whose W runs the whole backward, all-to-alls included (so a W there is an
  agreed class, never run beside), the last forward waits in its first window until two
  gradients have arrived: under BFW two B's then run before any W, and the first W's windows
  open with the second W ready (or the last forward's with a W ready), which must not run
  beside.

No deadlock (M >= 4, budget 2 on the last stage): the first stage runs M - 1 forwards without
waiting for anything of the last stage, which then has more inputs than its budget lets it start,
and needs nothing more to run two forwards and their B's, the gradients the first stage's last
forward waits for. A hold that does not end within ``timeout_s`` raises, failing the test instead
of hanging it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from rrfp.core.tasks import Kind


@dataclass
class _Holds:
    timeout_s: float
    tracker: object = None  # the iteration's RankTracker
    window: int = 0  # windows opened so far on this rank
    looked: int = -1  # the window the arbiter last looked at while it was open
    arrived: set = field(default_factory=set)  # (stage, kind, microbatch) reached this rank
    backwards: int = 0  # B's started this iteration

    def count(self, kind: Kind) -> int:
        return sum(1 for _, k, _ in self.arrived if k is kind)

    def wait(self, what: str, done) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"overlap hold: {what} did not happen in {self.timeout_s:g} s")
            time.sleep(0.0005)


def hold_windows(executor, lane, timeout_s: float = 60.0) -> None:
    """Install the holds on one rank of a pp 2 run with the overlap on (see the module); a lane
    shared by several executors in turn takes the last one's."""
    holds = _Holds(timeout_s)
    vars(lane).pop("yielding", None)  # the lane's own, not an earlier executor's holds
    make_tracker, yielding = executor.tracker, lane.yielding

    def tracker(spec, size_of):
        tr = holds.tracker = make_tracker(spec, size_of)
        holds.arrived, holds.backwards = set(), 0
        ready_tasks, arrive, start = tr.ready_tasks, tr.arrive, tr.start

        def looking():
            if lane.window:
                holds.looked = holds.window
            return ready_tasks()

        def arriving(stage, kind, mb):
            arrive(stage, kind, mb)
            holds.arrived.add((stage, kind, mb))

        def starting(stage, task):
            start(stage, task)
            holds.backwards += task.kind is Kind.B

        tr.ready_tasks, tr.arrive, tr.start = looking, arriving, starting
        return tr

    @contextlib.contextmanager
    def held():
        holds.window += 1
        mine, tr = holds.window, holds.tracker
        with yielding():
            running = tr.running
            kind = None if running is None else running.task.kind
            if kind is Kind.F and running.stage == 0 and tr.forwards[0] == executor.M:
                holds.wait("two gradients at the last forward", lambda: holds.count(Kind.B) >= 2)
            if kind is Kind.B and running.stage > 0 and holds.backwards == 1:
                holds.wait(
                    "the input of a forward not started, at the first B",
                    lambda: holds.count(Kind.F) > tr.forwards[0],
                )
            holds.wait(
                f"the arbiter's look at window {mine} (running {running})",
                lambda: holds.looked == mine or tr.beside is not None,
            )
            yield

    executor.tracker, lane.yielding = tracker, held
