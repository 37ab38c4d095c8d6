"""Which attempt of a torchrun job this is: the key space every store user of the job shares.

torchrun's agent keeps one store for all attempts of a job (``--max-restarts``), so the
process group, the heartbeat, the failure board, the stop relay and fault injection all key
by this attempt.
"""

from __future__ import annotations

import os


def attempt() -> str:
    """This attempt of a torchrun job ("0" outside one)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
