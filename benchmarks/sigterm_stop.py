"""SIGTERM during a 60 s step: seconds from the signal to every rank's "stopped"
line (the checkpoint is committed before either rank prints it).

A 2-rank torchrun job of a small GPT gets a slow task injected in step 3
(``fault = slow:step=3:stage=0:task=W1:seconds=60``: stage 0 holds its lane 60 s
after its W1, as a long kernel would). 1.5 s into it, SIGTERM goes to torchrun's
agent (what a scheduler stops; the agent forwards it to every worker),
every worker (``--to all``), or one worker (``--to one``: the others learn of it
through the rendezvous store). The target is within 5 s.

    .venv/bin/python benchmarks/sigterm_stop.py [--to agent|all|one] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.block_size=64",
    "data.min_seq_len=16",
    "data.max_seq_len=64",
    "n_microbatches=4",
    "model.dropout=0.1",
    "steps=6",
    "timeout_s=200",
    "fault=slow:step=3:stage=0:task=W1:seconds=60",
]


def workers(agent: int) -> list[int]:
    """The pids of torchrun's worker processes (its children)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == agent:
                kids.append(int(d.name))
    return sorted(kids)


def once(tmp: Path, to: str) -> dict[int, float]:
    """Seconds from SIGTERM to each rank's "stopped" line."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "TORCHELASTIC", "RRFP_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sets = [*SETS, f"checkpoint.dir={tmp / 'ck'}", f"log_dir={tmp / 'logs'}"]
    err = tmp / "err"
    with open(tmp / "out", "w") as out, open(err, "w") as errf:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "rrfp",
                "train",
                "--config",
                "configs/gpt-tiny.toml",
                *[a for s in sets for a in ("--set", s)],
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=errf,
            start_new_session=True,
        )
    try:
        t0 = time.monotonic()
        while "injecting fault slow" not in err.read_text():
            if job.poll() is not None or time.monotonic() - t0 > 120:
                raise SystemExit(f"the slow task never started\n{err.read_text()[-3000:]}")
            time.sleep(0.05)
        time.sleep(1.5)
        ranks = workers(job.pid)
        for pid in {"agent": [job.pid], "all": ranks, "one": ranks[-1:]}[to]:
            os.kill(pid, signal.SIGTERM)
        t_sig = time.monotonic()
        seen: dict[int, float] = {}
        while len(seen) < 2 and time.monotonic() - t_sig < 90:
            for m in re.finditer(r"^rrfp: stopped: rank (\d+)", err.read_text(), re.M):
                seen.setdefault(int(m[1]), time.monotonic() - t_sig)
            time.sleep(0.01)
        job.wait(timeout=60)
        return seen
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--to", choices=("agent", "all", "one"), default="agent")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            seen = once(Path(tmp), args.to)
        times = ", ".join(f"rank {r} {s:.2f} s" for r, s in sorted(seen.items()))
        print(
            f"run {i + 1}: SIGTERM to {args.to}, 'stopped' lines after: "
            f"{times or 'none within 90 s'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
