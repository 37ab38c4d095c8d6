"""The waits a run bounds, each its own number: one user-facing ``timeout_s`` gives them all a
default, and any one can be set apart (a slow store on a big cluster, a long CUDA kernel) without
moving the others."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, fields, replace

from rrfp.comm.nccl_groups import watchdog_timeout_s

DEFAULT_TIMEOUT_S = 60.0  # every default timeout_s, the one value the waits derive from
PROGRESS_TIMEOUTS = 10  # progress_s, in timeouts
TASK_PROGRESS = 2  # task_s, in progress_s: above a wait at a collective inside a task
# With a heartbeat, how long gloo lets one operation wait: a backstop. Silence is the heartbeat's
# to find; a peer that beats but never sends, the executor's, and one that never reaches a
# collective, the watcher's (both progress_s). A wait that blocks the loop thread, where neither
# runs, sets its own bound for its span (the tie setup's exchange).
BACKSTOP = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Timeouts:
    timeout_s: float  # the one user-facing value the others default from
    store_connect_s: float  # connecting to the rendezvous store (the attempt's, the heartbeat's)
    process_group_s: float  # gloo's process groups: start-up, and every collective without a beat
    nccl_watchdog_s: float  # NCCL's watchdog: above peer_wait_s, so rrfp names the peer first
    heartbeat_s: float  # how long a peer may stay silent (no beat) before it is named (gloo)
    peer_wait_s: float  # how long a stage waits on a peer's message before it names it
    cuda_deadline_s: float  # how long a rank waits for its own device's work (CUDA)
    # with a heartbeat, how long a stage waits on a peer that beats but makes no progress: nothing
    # reaches the stage and no rank of the job runs a task (a deadlock, a rank stuck outside the
    # pipeline). Ten timeouts, as NCCL's default ten minutes: a peer's long task is progress
    progress_s: float
    # the floor of a task's own bound (rrfp/pipeline/task_bound.py): a task that runs longer than
    # that and than ten times the longest of its kind so far is named as stuck. Twice progress_s
    # (set or derived), so that a wait at a collective inside a task names the absent peer first
    task_s: float = 0.0

    @classmethod
    def derive(cls, timeout_s: float, **overrides: float | None) -> Timeouts:
        """Every wait from ``timeout_s``; NCCL's watchdog is ``2 * timeout_s + 30``, a backstop
        behind rrfp's own deadline. ``overrides``: waits set apart (None or 0: derived)."""
        derived = cls(
            timeout_s=timeout_s,
            store_connect_s=timeout_s,
            process_group_s=timeout_s,
            nccl_watchdog_s=watchdog_timeout_s(timeout_s),
            heartbeat_s=timeout_s,
            peer_wait_s=timeout_s,
            cuda_deadline_s=timeout_s,
            progress_s=PROGRESS_TIMEOUTS * timeout_s,
        )
        known = {f.name for f in fields(cls)} - {"timeout_s"}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown timeouts {sorted(unknown)} (known: {sorted(known)})")
        waits = replace(derived, **{k: v for k, v in overrides.items() if v})
        return waits if waits.task_s else replace(waits, task_s=TASK_PROGRESS * waits.progress_s)

    @classmethod
    def given(cls, timeouts: Timeouts | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Timeouts:
        """The waits an entry point's two arguments set: ``timeouts`` when given, else each derived
        from ``timeout_s``. The one road from those arguments to the waits."""
        return timeouts or cls.derive(timeout_s)

    def key(self, wait: str) -> str:
        """The config key that set ``wait``, for a message: run.timeout_s unless set apart."""
        if wait == "task_s":  # derived from progress_s, whichever key set that
            derived = self.task_s == TASK_PROGRESS * self.progress_s
            return self.key("progress_s") if derived else "timeouts.task_s"
        derived = getattr(Timeouts.derive(self.timeout_s), wait)
        return "run.timeout_s" if getattr(self, wait) == derived else f"timeouts.{wait}"

    def said(self, wait: str) -> str:
        """``wait``'s bound as a message says it: the key that set it, and its value."""
        value, key = getattr(self, wait), self.key(wait)
        if wait == "task_s" and value == TASK_PROGRESS * self.progress_s:
            return f"timeouts.task_s = {value:g} s, {TASK_PROGRESS:g} x timeouts.progress_s"
        if key == "run.timeout_s" and value != self.timeout_s:
            return f"timeouts.{wait} = {value:g} s, {value / self.timeout_s:g} x run.timeout_s"
        return f"{key} = {value:g} s"
