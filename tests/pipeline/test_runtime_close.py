"""A closed runtime leaves nothing running in its process: its heartbeat's thread and beating
process end at ``aclose`` (or at the end of ``async with``), so a process that builds runtime after
runtime (a notebook, a driver) does not collect them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _start_and_close(rank, world, how):
    import threading

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        rt = PipelineRuntime.start(pp=world, timeout_s=60)
        assert rt.heartbeat is not None and rt.heartbeat._beater is not None
        beating = rt.heartbeat._beater.pid
        if how == "aclose":
            await rt.aclose()
        else:
            async with rt:
                pass
        return beating

    beating = run(main())
    threads = [t.name for t in threading.enumerate() if t.name.startswith("rrfp-heartbeat")]
    return threads, beating, _children()


def _children() -> list[int]:
    """This process's children, live or not yet reaped."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone since the listing
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == me:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["aclose", "async with"])
def test_a_closed_runtime_leaves_no_heartbeat_thread_or_process(how):
    for rank, (threads, beating, children) in run_ranks(
        _start_and_close, 2, how, timeout=90
    ).items():
        assert not threads, f"rank {rank}: {threads} still running after the runtime closed"
        assert not children, (
            f"rank {rank}: child processes {children} left (the beating process was {beating})"
        )
