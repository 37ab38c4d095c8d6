"""A checkpoint records what its data files held (size and SHA-256): a token file replaced between
the save and the resume is refused in one line naming the file, exit 2, nothing loaded; the same
file resumes. One rank in the test process (its heartbeat's beater forked)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from harness.cli_run import rrfp_in_process
from harness.distributed import free_port
from harness.launch import rank_vars

pytestmark = pytest.mark.multirank

SETS = [
    "model.n_layer=1", "model.n_embd=16", "model.block_size=32", "n_microbatches=2",
    "data.microbatch_size=2", "data.min_seq_len=8", "data.max_seq_len=32",
]  # fmt: skip


def _train(tmp: Path, tokens: Path, steps: int, *extra: str):
    sets = [
        *SETS,
        f"steps={steps}",
        f"data.tokens={tokens}",
        f"data.cache_dir={tmp / 'cache'}",
        f"checkpoint.dir={tmp / 'ck'}",
        f"log_dir={tmp / 'logs'}",
        *extra,
    ]
    argv = ["train", "--config", "configs/gpt-tiny.toml", *(a for s in sets for a in ("--set", s))]
    return rrfp_in_process(*argv, env=rank_vars(0, 1, free_port()))


def _tokens(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rng.integers(0, 255, size=4000).astype(np.uint16).tofile(path)


def test_a_token_file_replaced_after_the_save_is_refused_on_resume(tmp_path):
    tokens = tmp_path / "train.bin"
    _tokens(tokens, 0)
    first = _train(tmp_path, tokens, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    meta = json.loads((tmp_path / "ck" / "step-00000002" / "meta.json").read_text())
    assert list(meta["data_files"]) == [f"data.tokens {tokens}"]

    _tokens(tokens, 1)  # other tokens, the same size and path
    again = _train(tmp_path, tokens, 4, "checkpoint.resume=required")
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [ln for ln in again.stderr.splitlines() if ln.startswith("rrfp: error:")]
    assert len(errors) == 1, again.stderr[-3000:]
    assert "changed since it was saved" in errors[0] and f"data.tokens {tokens}: " in errors[0]
    assert "8000 bytes, sha256 " in errors[0]

    _tokens(tokens, 0)  # the bytes it was saved with: it continues
    resumed = _train(tmp_path, tokens, 4, "checkpoint.resume=required")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: from " in resumed.stdout and "done: 2 steps after step 2" in resumed.stdout
