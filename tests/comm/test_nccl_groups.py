"""rrfp/comm/nccl_groups.py: NCCL's environment and watchdog, the start-up refusals (one line
each), and errors on the NCCL path that read like the gloo ones."""

from __future__ import annotations

import types

import pytest
import torch

from rrfp.app.job.failure import SECONDARY, Failure
from rrfp.comm import nccl_groups
from rrfp.comm.channels import PeerError
from rrfp.core.errors import StartupError

DEVICE = torch.device("cuda", 0)


@pytest.fixture
def clean_env(monkeypatch):
    for key in (*nccl_groups.NCCL_ENV, "TORCH_NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_the_watchdog_waits_longer_than_rrfps_deadline(clean_env):
    import os

    timeout = nccl_groups.configure_watchdog(60.0)
    assert timeout > 60.0 and nccl_groups.watchdog_timeout_s(5.0) > 5.0
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", (
        "the watchdog marks Works failed, kills nothing"
    )
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "0", (
        "collectives connect when the communicator is created"
    )


def test_a_users_own_nccl_setting_is_kept_and_named(clean_env, caplog):
    import os

    clean_env.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    nccl_groups.configure_watchdog(60.0)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert any("TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in r.getMessage() for r in caplog.records)


def test_blocking_wait_is_refused_with_one_line(clean_env):
    clean_env.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(
        StartupError,
        match="TORCH_NCCL_BLOCKING_WAIT is set: it makes every NCCL wait block the event loop",
    ):
        nccl_groups.configure_watchdog(60.0)


def test_a_torch_without_eager_groups_is_refused_with_one_line():
    nccl_groups.check_torch()  # this torch's new_group takes device_id
    old = types.SimpleNamespace(
        new_group=lambda ranks=None, timeout=None, backend=None, pg_options=None: None
    )
    with pytest.raises(
        StartupError, match=r"cannot create NCCL groups eagerly .* backend nccl needs torch >= 2\.6"
    ):
        nccl_groups.check_torch(old)


def test_a_group_torch_did_not_initialize_eagerly_is_refused():
    class Group:
        bound_device_id = DEVICE

        def _get_backend(self, device):
            return types.SimpleNamespace(supports_splitting=False)

    with pytest.raises(
        StartupError,
        match="rank 3: DP group of ranks \\[1, 3\\]: this NCCL cannot create "
        "communicators at start-up",
    ):
        nccl_groups.require_eager(Group(), DEVICE, "DP group of ranks [1, 3]", 3)


@pytest.mark.parametrize(
    "nccl_text, reason",
    [
        (
            "NCCL communicator was aborted on rank 1. Original reason for failure was: NCCL error: "
            "remote process exited or there was a network error, NCCL version "
            "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
            "process exiting prematurely.",
            "the peer process probably died",
        ),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
            "OpType=RECV, NumelIn=71, "
            "NumelOut=71, Timeout(ms)=150000) ran for 150011 milliseconds before timing out.",
            "nothing within the process-group timeout",
        ),
    ],
)
def test_nccl_failures_read_like_gloo_ones(nccl_text, reason):
    """One line as for a gloo peer failure (where, what, likely reason); NCCL's text in the log."""
    from rrfp.comm.channels import ChannelEnd

    end = ChannelEnd()
    end.name, end.rank, end.peer = "bwd 2->1 (rank 2 -> rank 1)", 1, 2
    error = end._peer_error(
        "receive of tensor 1/1 of B message (iteration 2, microbatch 3) from rank 2",
        RuntimeError(nccl_text),
    )
    assert isinstance(error, PeerError) and error.peer == 2
    f = Failure.of(error)
    line = f.line(1, 1, "runs/logs/rank-1.log", debug=False)
    assert f.kind == SECONDARY and "\n" not in line
    assert (
        line.startswith("rank 1: stopped: peer rank 2 failed or left first")
        and f"({reason}" in line
    )
    assert (
        "NCCL version" not in line
        and "WorkNCCL" not in line
        and line.endswith("(traceback in runs/logs/rank-1.log)")
    )
