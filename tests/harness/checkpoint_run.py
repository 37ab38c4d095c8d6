"""A small `rrfp train` with checkpoints, and the one error line a refused resume prints: shared by
the checkpoint, verify, Ctrl-C and start-up refusal tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from harness.cli_run import rrfp_in_process
from harness.launch import rank_vars

SMALL = [
    "--config",
    "configs/gpt-tiny.toml",
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=64",
    "--set",
    "data.min_seq_len=16",
    "--set",
    "data.max_seq_len=64",
    "--set",
    "n_microbatches=4",
    "--set",
    "model.dropout=0.1",
]  # dropout: the resumed RNG state matters

KEYS = {"checkpoint_dir": "checkpoint.dir", "checkpoint_every": "checkpoint.every"}
KEYS["checkpoint_keep"] = "checkpoint.keep"  # _config's keywords: the config keys they set


def _config(steps: int, dispatch: str, **run):
    from rrfp.app.config.train_config import TrainConfig

    sets = [s for s in SMALL[2:] if s != "--set"] + [
        f"steps={steps}",
        f"schedule.dispatch={dispatch}",
        "timeout_s=60",
        "lr=3e-3",
        "output.dir=",  # no run folder: metrics nobody reads
    ]
    sets += [f"{KEYS.get(k, k)}={json.dumps(v)}" for k, v in run.items()]
    return TrainConfig.load(SMALL[1], sets)


def rrfp_alone(*args: str) -> subprocess.CompletedProcess:
    """`rrfp train` in this process as rank 0 of 2 whose rendezvous nobody serves: exiting 2
    proves the check ran before any group."""
    return rrfp_in_process("train", *SMALL, *args, env=rank_vars(0, 2, port=9))


def one_error_line(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp: error: "), stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    return lines[0]


def resume_error(ckdir: Path, *sets: str) -> str:
    """The ConfigError ``rrfp train`` prints for this run, from its check before any group."""
    import pytest  # here: the ranks that build ``_config`` need no pytest (about 0.1 CPU-s each)

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.errors import ConfigError
    from rrfp.app.train.checkpoints import resume_point

    cfg = TrainConfig.load(
        SMALL[1],
        [s for s in SMALL[2:] if s != "--set"] + [f"checkpoint.dir={ckdir}", *sets],
        world_size=2,
    )
    with pytest.raises(ConfigError) as e:
        resume_point(cfg)
    return str(e.value)
