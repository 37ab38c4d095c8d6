"""Holds that make the all-to-all overlap happen by construction in a pp 2 x ep 2 test, not by
timing: whether a W runs beside an all-to-all must not depend on how fast the ranks are.

Installed on one rank's executor and lane (``hold_windows``), they act inside each window (the
lane's ``yielding``: an EP task waiting at an all-to-all, the device free), on the lane's thread:

- **The arbiter sees every window.** The window stays open until the rank's arbiter has looked at
  it (asked the tracker for the ready tasks while it is open) or a task already runs beside: a
  W that may run beside is started in the window, however fast the peer reaches the collective.
- **A W is ready at an EP task's window.** In each iteration, B of microbatch 0 waits in its first
  window until microbatch 1's message has reached its stage (on the last stage F1's input, on the
  first the gradient for B1). On the last stage, F1 and W0 are then both ready once B0 is done:
  the round agrees F1 (the only class offered), the free W0 waits for it, and runs beside F1's
  first all-to-all. On the first stage, B1 and W0 are both ready once B0 is done (and W0, which
  there runs the whole backward and its all-to-alls, must never run beside).

No deadlock: the last stage's B0 waits for F1, which the first stage runs after F0 without
waiting for anything of the last stage; the first stage's B0 starts only once its gradient has
come back from a B0 that saw F1 arrive, and waits for the gradient of B1, which needs only F1. A
hold that does not end within ``timeout_s`` raises, failing the test instead of hanging it.
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

    def wait(self, what: str, done) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"overlap hold: {what} did not happen in {self.timeout_s:g} s")
            time.sleep(0.0005)


def hold_windows(executor, lane, timeout_s: float = 60.0) -> None:
    """Install the holds on one rank of a pp 2 run with the overlap on (see the module)."""
    holds = _Holds(timeout_s)
    vars(lane).pop("yielding", None)  # the lane's own, not an earlier executor's holds
    make_tracker, yielding = executor.tracker, lane.yielding

    def tracker(spec, size_of):
        tr = holds.tracker = make_tracker(spec, size_of)
        holds.arrived = set()
        ready_tasks, arrive = tr.ready_tasks, tr.arrive

        def looking():
            if lane.window:
                holds.looked = holds.window
            return ready_tasks()

        def arriving(stage, kind, mb):
            arrive(stage, kind, mb)
            holds.arrived.add((stage, kind, mb))

        tr.ready_tasks, tr.arrive = looking, arriving
        return tr

    @contextlib.contextmanager
    def held():
        holds.window += 1
        mine, tr = holds.window, holds.tracker
        with yielding():
            running = tr.running
            if running is not None and (running.task.kind, running.task.mb) == (Kind.B, 0):
                stage = running.stage
                need = (stage, Kind.B, 1) if stage == 0 else (stage, Kind.F, 1)
                holds.wait(
                    f"microbatch 1's message at stage {stage} during B0",
                    lambda: need in holds.arrived,
                )
            holds.wait(
                f"the arbiter's look at window {mine} (running {running})",
                lambda: holds.looked == mine or tr.beside is not None,
            )
            yield

    executor.tracker, lane.yielding = tracker, held
