"""Every rank of a job agrees on what it runs before any process group: each posts its identity
(rrfp/app/config/job_identity.py) and its node on the job's store, reads every rank's, and a
difference is one line naming the keys and the nodes and ranks that hold each value, the same on
every rank (so ``refuse_once`` prints it once and every rank exits 2 at once, none waiting for a
peer that will never come).

The store before any process group is torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE), the
one the rendezvous met on: ranks started without torchrun have none until rank 0 hosts the
process group's, and are not compared. A rank that does not post within the rendezvous's bound
is left to the rendezvous to name (it waits as long), so this adds no wait of its own.

The same store gives the job its id (``job_id``), which names the job in the checkpoint folder
it owns (rrfp/app/train/checkpoint_owner.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket

from rrfp.app.errors import ConfigError
from rrfp.app.job.failure_board import _quiet, connect_store
from rrfp.comm.job_store import attempt

log = logging.getLogger("rrfp.app.job.job_agreement")

PREFIX = "rrfp/identity"
JOB_KEY = "rrfp/job-id"  # not per attempt: a restarted job keeps its id
SHOWN_KEYS = 4  # keys shown with their values; the others are only named
VALUE_CHARS = 60  # a value longer than this is cut short in the line
# said first when they differ: another model explains the rest of its keys
FIRST = ("run.model", "model.source", "world.size")


def node() -> str:
    """This rank's node as torchrun numbers it (GROUP_RANK), and its host name."""
    return f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def agree(identity: dict[str, str], rank: int, world: int, wait_s: float, store=None) -> bool:
    """ConfigError when any rank of the job posted another identity; True when every rank's was
    compared, False when there is no store to compare through or a rank did not post in
    ``wait_s``. ``store``: the job's store (default: torchrun's agent store, if any)."""
    if world <= 1:
        return False
    if store is None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return False
        store = connect_store(wait_s)
        if store is None:
            return False
    prefix = f"{PREFIX}/{attempt()}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    post = json.dumps({"node": node(), "identity": identity}, sort_keys=True)
    try:
        with _quiet():  # torch's C++ store logs a timed-out wait with its frames
            store.set(keys[rank], post)
            store.wait(keys, datetime.timedelta(seconds=wait_s))
            posts = [json.loads(raw) for raw in store.multi_get(keys)]
    except RuntimeError as e:  # a rank that never posts: the rendezvous names it
        log.info("rank %d: the job's identities were not compared: %s", rank, e)
        return False
    line = disagreement(posts)
    if line is not None:
        raise ConfigError(line)
    return True


def disagreement(posts: list[dict]) -> str | None:
    """The line for identities that differ (``posts[r]``: rank r's ``{"node", "identity"}``);
    None when they agree."""
    keys = sorted({k for p in posts for k in p["identity"]})
    differ = sorted(
        (k for k in keys if len({p["identity"].get(k) for p in posts}) > 1),
        key=lambda k: (k not in FIRST, FIRST.index(k) if k in FIRST else 0, k),
    )
    if not differ:
        return None
    shown = "; ".join(_values(k, posts) for k in differ[:SHOWN_KEYS])
    more = (
        f"; and {', '.join(differ[SHOWN_KEYS:])}" if len(differ) > SHOWN_KEYS else ""
    )  # named, not shown: the line stays one line
    return (
        f"the ranks of this job were started with different configs, models or data: {shown}"
        f"{more} (every node must run the same config and files: check each node's command line, "
        "config file and data)"
    )


def _values(key: str, posts: list[dict]) -> str:
    """``KEY: VALUE (node N (HOST): rank R) vs VALUE (...)``, values in the order of their lowest
    rank."""
    where: dict[str, dict[str, list[int]]] = {}
    for r, p in enumerate(posts):
        value = p["identity"].get(key, "(absent)")
        where.setdefault(value, {}).setdefault(p["node"], []).append(r)
    said = " vs ".join(
        f"{_cut(value)} ("
        + "; ".join(
            f"{n}: {'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}"
            for n, rs in nodes.items()
        )
        + ")"
        for value, nodes in where.items()
    )
    return f"{key}: {said}"


def _cut(value: str) -> str:
    return value if len(value) <= VALUE_CHARS else value[: VALUE_CHARS - 3] + "..."


def job_id(wait_s: float) -> int:
    """This job's id, a 48-bit number: under torchrun the first one any of its ranks put on its
    store (the same for every attempt a restart makes: the agent keeps one store), else a fresh
    one. Rank 0 asks; the ranks share it through their process group."""
    fresh = secrets.randbits(48) or 1
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return fresh
    store = connect_store(wait_s)
    if store is None:
        return fresh
    try:
        with _quiet():
            return int(store.compare_set(JOB_KEY, "", str(fresh)).decode())
    except (RuntimeError, ValueError):
        return fresh
