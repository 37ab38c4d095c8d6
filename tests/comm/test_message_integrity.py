"""A corrupted, truncated or out-of-step message over real gloo channels is an
error that names the channel and its peer, raised at once: it never hangs.

(The header checks on their own, with fuzzing, are in test_comm.py.)
"""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

PG_TIMEOUT_S = 20  # far above what any case may take: an error near it would be a hang
PROMPT_S = 5


def _bad_headers(rank, world):
    import asyncio
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from rrfp.comm.message import HEADER_LEN, Message, MessageError, encode_header
    from rrfp.comm.pipeline_channels import create_pipeline_channels
    from rrfp.core.layout import Layout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    channels = create_pipeline_channels(Layout(world, world), rank, PG_TIMEOUT_S)
    good = encode_header(Message(0, 0, 0, [torch.zeros(2, 3)]))
    corrupt = good.clone()
    corrupt[8] = 3  # tensor 0's first dim, 2 -> 3: still a valid dim, so only the checksum can tell
    truncated = good[
        : HEADER_LEN - 3
    ].clone()  # gloo delivers it into the longer buffer: the tail stays 0

    async def receive(channel):
        start = time.monotonic()
        try:
            msg = await channel.recv()
        except MessageError as e:
            return str(e), time.monotonic() - start
        return f"received {msg.label()}", time.monotonic() - start

    async def main():
        # raw words on the channels' own groups, as a broken sender or a bad link would deliver them
        async with channels:
            if rank == 0:
                await asyncio.to_thread(dist.send, corrupt, 1, group=channels.fwd_out.group)
                return await receive(channels.bwd_in)
            got = await receive(channels.fwd_in)
            await asyncio.to_thread(dist.send, truncated, 0, group=channels.bwd_out.group)
            return got

    out = asyncio.run(main())
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
def test_corrupt_and_truncated_headers_name_the_channel():
    results = run_ranks(_bad_headers, 2, timeout=60)
    corrupt, took = results[1]
    assert corrupt.startswith(
        "rank 1: channel fwd 0->1 (rank 0 -> rank 1): bad header from rank 0 (first "
        "message): header checksum mismatch"
    ), corrupt
    assert took < PROMPT_S
    truncated, took = results[0]
    assert truncated.startswith(
        "rank 0: channel bwd 1->0 (rank 1 -> rank 0): bad header from rank 1"
    ), truncated
    assert "checksum mismatch: corrupted or truncated" in truncated and took < PROMPT_S


def _out_of_step(rank, world):
    import time

    import torch

    from rrfp.app.job.failure import Failure
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    async def main():
        start = time.monotonic()
        try:  # stage 0 sends iteration 1 while stage 1 expects iteration 0
            async with PipelineRuntime.start(pp=world, timeout_s=PG_TIMEOUT_S) as rt:
                torch.manual_seed(0)
                module = torch.nn.Linear(4, 4)
                ex = rt.stage_executor(
                    module,
                    lambda out, y: ((out - y) ** 2).mean(),
                    n_microbatches=2,
                    dispatch="fixed",
                    hint="1f1b",
                )
                batches = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(2)]
                start = time.monotonic()
                await ex.run_iteration(1 if rank == 0 else 0, batches)
        except Exception as e:  # the iteration's TaskGroup wraps the cause
            cause = Failure.of(e).cause
            return type(cause).__name__, str(cause), time.monotonic() - start
        return "finished", "", time.monotonic() - start

    return run(main())


@pytest.mark.timeout(90)
def test_out_of_step_message_names_the_channel_and_ends_both_sides():
    results = run_ranks(_out_of_step, 2, timeout=60)
    kind, text, took = results[1]
    assert kind == "ProtocolError" and took < PROMPT_S, results[1]
    assert text.startswith(
        "rank 1 stage 1: channel fwd 0->1 (rank 0 -> rank 1) (peer rank 0): expected a F "
        "message of iteration 0, got iteration 1"
    ), text
    kind, text, took = results[
        0
    ]  # its peer left: a peer failure, found at once, not at the timeout
    assert kind in ("PeerError", "PeerTimeout") and "rank 1" in text and took < PG_TIMEOUT_S / 2, (
        results[0]
    )
