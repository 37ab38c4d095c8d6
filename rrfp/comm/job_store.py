"""Which attempt of a torchrun job this is: the key space every store user of the job shares.

torchrun's agent keeps one store for all attempts of a job (``--max-restarts``), so the
process group, the heartbeat, the failure board, the stop relay and fault injection all key
by this attempt.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def attempt() -> str:
    """This attempt of a torchrun job ("0" outside one)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client of its own to this job's store (MASTER_ADDR:MASTER_PORT, as torchrun and
    ``env://`` set them), connected within ``timeout_s``. KeyError or ValueError without that
    address, RuntimeError (DistNetworkError) when the store does not accept in time."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# the bound on reaching a store this process hosts and that listens: it cannot be dead, only slow
# to accept on a loaded machine (it has taken over 2 s)
OWN_STORE_CONNECT_S = 5.0


def connect_bound(timeout_s: float) -> float | None:
    """How long to give a new client of this job's store: ``timeout_s``, or, when this process
    hosts the store (``store_in_this_process``), OWN_STORE_CONNECT_S if its port accepts and None
    if it refuses: a failed rendezvous took the store, and TCPStore's client would only retry the
    refused connect until its timeout. Another process's store may have died with its host, and
    the short bound then lets the rank say so sooner."""
    if not store_in_this_process():
        return timeout_s
    return max(timeout_s, OWN_STORE_CONNECT_S) if store_listens() else None


def store_in_this_process() -> bool:
    """Whether this process hosts the job's store: rank 0 under ``env://`` without torchrun's
    agent store (init_process_group makes rank 0's TCPStore the master). Such a store is alive
    while this process runs, however slowly it accepts a client on a loaded machine."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ.get("RANK") == "0"
    )


def store_listens(timeout_s: float = 0.5) -> bool:
    """Whether anything accepts a plain TCP connection at MASTER_ADDR:MASTER_PORT. A port whose
    store is gone refuses at once, while TCPStore's own client retries a refused connect until its
    timeout; the store's server takes the probe's close without a word."""
    try:
        with socket.create_connection(
            (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=timeout_s
        ):
            return True
    except (KeyError, ValueError, OSError):
        return False
