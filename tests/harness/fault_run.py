"""A job with an injected fault (debug.fault), run under torchrun: its command line and the wait
until the victim injects; the fault-injection, save-fault and commit-failure tests share them."""

from __future__ import annotations

import time
from pathlib import Path

from harness.rank_procs import RankProcs

# run.timeout_s: the peer deadline and the process-group timeout. The first of these tests runs
# while test-long's workers start, the machine's busiest seconds, where a store host can make no
# progress for over 5 s in its first second (no step done, its store unanswered): its peers then
# name it before the fault
TIMEOUT_S = 10
STARTUP_S = 90  # imports and rendezvous of every rank on a loaded 2-core machine


def _args(tmp: Path, world: int, *sets: str) -> list[str]:
    sets = (
        "steps=1000",
        f"timeout_s={TIMEOUT_S}",
        f"log_dir={tmp / 'logs'}",
        "unit_ms=1",
        "n_microbatches=4",
        "model.n_embd=32",
        "model.block_size=64",
        f"model.n_layer={world}",
        "data.min_seq_len=16",
        "data.max_seq_len=64",
        *sets,
    )
    return ["--config", "configs/gpt-tiny.toml", *(a for s in sets for a in ("--set", s))]


def _wait_for_fault(ranks: RankProcs, victim: int, what: str) -> float:
    """Until the victim logged that it injects the fault; the others must still be running."""
    t0 = time.monotonic()
    while "injecting fault" not in ranks.err(victim):
        early = {
            r: p.returncode
            for r, p in enumerate(ranks.procs)
            if r != victim and p.poll() is not None
        }
        assert not early, f"rank(s) ended before the fault: {early}\n{ranks.tails()}"
        assert time.monotonic() - t0 < STARTUP_S, (
            f"no fault injected within {STARTUP_S} s\n{ranks.tails()}"
        )
        time.sleep(0.05)
    assert what in ranks.err(victim), ranks.err(victim)
    return time.monotonic() - t0
