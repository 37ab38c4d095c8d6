"""The environment a rank is started with (RANK, WORLD_SIZE, MASTER_PORT from the
launcher, RRFP_LOG from the user), checked before anything reads it: a value that
is not what torch's ``env://`` rendezvous or ``logging`` takes is one line and exit
2, not a traceback from deep inside either."""

from __future__ import annotations

import logging
import os

from rrfp.app.errors import UsageError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """RRFP_LOG (WARNING when unset), a logging level name; UsageError otherwise."""
    level = os.environ.get("RRFP_LOG", "WARNING").strip().upper() or "WARNING"
    if level not in LEVELS:
        raise UsageError(
            f"RRFP_LOG={os.environ['RRFP_LOG']!r} is not a log level: one of {', '.join(LEVELS)}"
        )
    return level


def configure_logging() -> None:
    logging.basicConfig(level=log_level(), format="%(name)s: %(message)s")


def check_launcher() -> None:
    """RANK, WORLD_SIZE and LOCAL_RANK are integers with 0 <= RANK < WORLD_SIZE, MASTER_PORT is a
    port: what torchrun sets; a rank started by hand may have got them wrong."""
    env = os.environ
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if key not in env:
            continue
        try:
            values[key] = int(env[key])
        except ValueError:
            raise UsageError(
                f"{key}={env[key]!r} is not an integer (set by torchrun; a rank started by hand "
                "needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
            ) from None
    world, rank = values.get("WORLD_SIZE"), values.get("RANK")
    if world is not None and world < 1:
        raise UsageError(f"WORLD_SIZE={world} must be >= 1")
    if world is not None and rank is not None and not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}: ranks are 0 to {world - 1}")
    if values.get("LOCAL_RANK", 0) < 0:
        raise UsageError(f"LOCAL_RANK={values['LOCAL_RANK']} must be >= 0")
    port = values.get("MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT={port} is not a port (1 to 65535)")
