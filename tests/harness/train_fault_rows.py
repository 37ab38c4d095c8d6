"""The rows of `rrfp train`'s fault matrix (a fault kind on rank 1 of two in one phase, and the
outcome rank 0 must see) and the bounds the outcome is judged by: the matrix's tests run them and
the embedding matrix's table in docs/faults.md prints them."""

from __future__ import annotations

TIMEOUT_S = 3.0  # run.timeout_s: the heartbeat's bound once the ranks have met
# how long the rendezvous waits: long enough for two ranks of a loaded machine to arrive apart,
# and short in the start-up rows, whose faults it is that bounds
MEET_S, START_S = 30.0, 6.0
PAUSE_S = TIMEOUT_S / 2
# timeouts.progress_s: how long a rank waits at a collective for a peer that beats but never
# arrives. In every row, so that the slow rows (a sleep under it) show a slow phase is not blamed
PROGRESS_S = 3 * TIMEOUT_S
TASK_S = 2 * PROGRESS_S  # timeouts.task_s, derived: the bound of a task once its kind was measured
SLACK_S = 6.0  # a loaded two-core machine: several jobs at once, a beat read late
API = "rrfp train"
FINISHES, NAMED, STOPS = "finishes exactly", "rank 1 named", "stops, one line"
DISK = "the disk named"
SET_ASIDE = "falls back, set aside"
# the phase: (where the fault fires, the layout)
PHASES = {
    "start-up": ("during=startup", "pp"),
    "F": ("step=2:task=F1", "pp"),
    "B": ("step=2:task=B1", "pp"),
    "W": ("step=2:task=W1", "pp"),  # BFW's split backward: the weight gradients apart
    "sync": ("step=2:during=sync", "dp"),
    "save": ("step=1:during=save", "pp"),
    "commit": ("step=1:during=commit", "pp"),
    "barrier": ("during=barrier", "pp"),
    "TP F": ("step=2:task=F1", "tp"),  # one stage on two TP ranks: hang only
    # one MoE stage on two EP ranks (configs/moe-tiny.toml): kill, stop and hang only
    "EP F": ("step=2:task=F1", "ep"),
}
KINDS = ("kill", "stop", "pause", "slow", "term")
# where a rank may hang, alive: F inside the task itself, named by its own bound (timeouts.task_s)
HANG_PHASES = ("F", "sync", "save", "commit", "barrier", "TP F", "EP F")
LAYOUTS = {
    "pp": ("pp=2",),
    "dp": ("pp=1", "dp=2"),
    "tp": ("pp=1", "tp=2"),
    "ep": ("pp=1", "dp=2", "parallel.ep=2"),
}


def _outcome(kind: str, phase: str) -> str:
    if kind in ("kill", "stop", "hang"):
        return NAMED
    if phase == "start-up":  # no heartbeat before the rendezvous: a rank late past it is absent
        return FINISHES if kind == "pause" else NAMED
    if kind == "term":  # after the last step the run is complete
        return FINISHES if phase == "barrier" else STOPS
    return FINISHES


def _bound(phase: str, kind: str = "") -> float:
    """The wait that names a fault of ``phase``: the rendezvous's, the heartbeat's, or for a peer
    that beats and never arrives, progress_s."""
    if kind == "hang" and phase == "F":  # timeouts.task_s: 2 x progress_s
        return TASK_S
    if kind == "hang":
        return PROGRESS_S
    return START_S if phase == "start-up" else TIMEOUT_S


ROWS = [
    (API, kind, phase, _outcome(kind, phase))
    for phase in PHASES
    if phase not in ("TP F", "EP F")
    for kind in KINDS
] + [(API, "hang", phase, _outcome("hang", phase)) for phase in HANG_PHASES]
ROWS += [(API, kind, "EP F", _outcome(kind, "EP F")) for kind in ("kill", "stop")]
ROWS += [
    (API, "full", "save", DISK),  # torch's writer on rank 1 past its file size limit
    (API, "flip", "resume", SET_ASIDE),  # a byte of the latest commit record, before a resume
]
LONG = ("pause", "slow", "term")  # rows that wait out their fault: the long tier
