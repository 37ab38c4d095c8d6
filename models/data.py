"""An offline text corpus: the Python standard library's own source, as bytes.

Every machine with Python has it, so runs need no download. Files are read in
sorted path order up to a byte bound, so every process on one machine (same
Python install) sees the same corpus; tokens are bytes (vocab 256).

Microbatches have variable sequence lengths and no padding, which is the runtime
variability rrfp is about. Each is a pure function of (seed, step, microbatch),
so every rank draws the same batch without communicating.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class DataConfig:
    seed: int = 0
    microbatch_size: int = 2
    min_seq_len: int = 16
    max_seq_len: int = 64
    corpus_bytes: int = 4 << 20  # read at most this many bytes of stdlib source

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"DataConfig.seed must be >= 0, got {self.seed}")
        if self.microbatch_size <= 0:
            raise ValueError(
                f"DataConfig.microbatch_size must be positive, got {self.microbatch_size}"
            )
        if not 1 <= self.min_seq_len <= self.max_seq_len:
            raise ValueError(
                "DataConfig needs 1 <= min_seq_len <= max_seq_len, got "
                f"min_seq_len={self.min_seq_len}, max_seq_len={self.max_seq_len}"
            )
        if self.corpus_bytes <= self.max_seq_len + 1:
            raise ValueError(
                f"DataConfig.corpus_bytes ({self.corpus_bytes}) must exceed "
                f"max_seq_len + 1 ({self.max_seq_len + 1})"
            )


def _stdlib_files(root: str):
    """*.py under `root` in sorted path order (deterministic, unlike os.walk's own order)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The first `max_bytes` bytes of the concatenated stdlib sources, uint8 [N] (cached)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total, files = [], 0, 0
    for path in _stdlib_files(root):
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes - total)
        except OSError as e:
            log.warning("corpus: skipping unreadable %s (%s)", path, e)
            continue
        chunks.append(data)
        total += len(data)
        files += 1
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root}")
    log.info("corpus: %d bytes from %d files under %s", total, files, root)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def batches(
    cfg: DataConfig, step: int, num_microbatches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches (idx, targets) of step `step`, each int64 [microbatch_size, T_m].

    T_m is drawn per microbatch in [min_seq_len, max_seq_len]; targets are idx
    shifted by one token. Depends only on (cfg, step, microbatch index).
    """
    if step < 0 or num_microbatches <= 0:
        raise ValueError(f"need step >= 0 and num_microbatches > 0, got {step}, {num_microbatches}")
    data = corpus(cfg.corpus_bytes)
    n = data.numel()
    if n <= cfg.max_seq_len + 1:
        raise RuntimeError(f"corpus has {n} bytes, too few for max_seq_len {cfg.max_seq_len}")
    out = []
    for m in range(num_microbatches):
        rng = np.random.default_rng([cfg.seed, step, m])
        t = int(rng.integers(cfg.min_seq_len, cfg.max_seq_len + 1))
        starts = torch.from_numpy(rng.integers(0, n - t, size=cfg.microbatch_size))
        rows = data[starts[:, None] + torch.arange(t + 1)].long()
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out
