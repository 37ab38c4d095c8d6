"""The [data] section: the offline default corpus, or the user's own tokens.

The default is the Python standard library's own source, as bytes: every machine
with Python has it, so runs need no download. Files are read in sorted path order
up to a byte bound, so every process on one machine (same Python install) sees the
same corpus; tokens are bytes (vocab 256).

``data.tokens`` (a token file) or ``data.text`` (text files, with ``data.tokenizer``)
train on one's own data instead (models/token_files.py), drawn by document
(models/documents.py): no microbatch row crosses a document boundary.

Evaluation ([eval]) draws from held-out data: the stdlib bytes that follow the training
corpus (``held_out_bytes`` of them), or the last ``held_out_share`` of the user's documents,
which training never draws.

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

from rrfp.models.documents import Documents
from rrfp.models.token_files import read_text, read_token_file, text_files

log = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class DataConfig:
    seed: int = 0
    microbatch_size: int = 2
    min_seq_len: int = 16
    max_seq_len: int = 64
    corpus_bytes: int = 4 << 20  # read at most this many bytes of stdlib source
    tokens: str = ""  # a token file: nanoGPT's flat uint16 .bin, or a 1-D .npy of token ids
    text: str = ""  # text files: a file, a directory (its *.txt) or a glob; each file a document
    tokenizer: str = ""  # a local tokenizer.json for data.text; "": UTF-8 bytes (vocab 256)
    eot: int = -1  # the end-of-text id that ends a document (GPT-2's: 50256); -1: none
    cache_dir: str = ""  # where tokenized text and document ends are cached; "": ~/.cache/rrfp
    held_out_bytes: int = 256 << 10  # evaluation: the stdlib bytes after the training corpus
    held_out_share: float = 0.01  # evaluation: this share of own documents, the last (at least 1)

    def __post_init__(self) -> None:
        if self.tokens and self.text:
            raise ValueError("data.tokens and data.text are two sources: give one")
        if self.tokenizer and not self.text:
            raise ValueError("data.tokenizer tokenizes data.text, which is not set")
        if self.eot < -1:
            raise ValueError(f"data.eot must be a token id >= 0, or -1 for none, got {self.eot}")
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
        if self.held_out_bytes <= self.max_seq_len + 1:
            raise ValueError(
                f"data.held_out_bytes ({self.held_out_bytes}) must exceed max_seq_len + 1 "
                f"({self.max_seq_len + 1})"
            )
        if not 0 < self.held_out_share < 1:
            raise ValueError(f"data.held_out_share must be in (0, 1), got {self.held_out_share}")
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


def own_data(cfg: DataConfig) -> tuple[Documents, int] | None:
    """The user's documents and their vocab size (read once per process), or None for the stdlib
    corpus. DataError (a ValueError) names bad data."""
    if not cfg.tokens and not cfg.text:
        return None
    try:  # a file rewritten in place is read again
        stamp = os.stat(cfg.tokens or cfg.text).st_mtime_ns
    except OSError:
        stamp = 0
    return _own_data(cfg.tokens, cfg.text, cfg.tokenizer, cfg.eot, cfg.cache_dir, stamp)


@functools.lru_cache(maxsize=4)
def _own_data(
    tokens: str, text: str, tokenizer: str, eot: int, cache_dir: str, stamp: int
) -> tuple[Documents, int]:
    if tokens:
        return read_token_file(tokens, eot, cache_dir)
    return read_text(text, tokenizer, eot, cache_dir)


def own_split(cfg: DataConfig) -> tuple[Documents, Documents] | None:
    """The user's documents as (training, held-out): the last ``held_out_share`` of them (at
    least one) are held out; a single document is not split and evaluation draws from it too."""
    own = own_data(cfg)
    if own is None:
        return None
    return _split(own[0], cfg.held_out_share)


@functools.lru_cache(maxsize=4)
def _split(docs: Documents, share: float) -> tuple[Documents, Documents]:
    if docs.count < 2:
        log.warning("data: one document, so evaluation draws from the training data")
        return docs, docs
    held = max(1, int(docs.count * share))
    cut = int(docs.ends[docs.count - held - 1])
    train = Documents(docs.tokens[:cut], docs.ends[: docs.count - held], docs.max_id)
    rest = Documents(docs.tokens[cut:], docs.ends[docs.count - held :] - cut, docs.max_id)
    return train, rest


def describe(cfg: DataConfig) -> str:
    """What the [data] section found, for the start-up summary: the user's documents and tokens
    (and files, for data.text), or the stdlib corpus's bytes."""
    own = own_data(cfg)
    if own is None:
        data = corpus(cfg.corpus_bytes)
        return (
            f"the Python standard library's source as bytes: {data.numel():,} tokens (vocab 256; "
            "data.tokens or data.text for your own)"
        )
    docs, vocab = own
    source = (
        f"data.tokens = {cfg.tokens}"
        if cfg.tokens
        else f"data.text = {cfg.text} ({len(text_files(cfg.text))} file(s))"
    )
    return f"{source}: {docs.count:,} documents, {len(docs.tokens):,} tokens (vocab {vocab:,})"


def vocab_size(cfg: DataConfig) -> int:
    """How many token ids the data can hold: 256 bytes, the token file's largest id + 1, or the
    tokenizer's size."""
    own = own_data(cfg)
    return 256 if own is None else own[1]


def check_fits(cfg: DataConfig, model_vocab: int) -> None:
    """ValueError, in one line, unless the model can take every token of the data and the data
    can fill a microbatch: a workload's ``check`` calls it, before any process group exists."""
    own = own_data(cfg)
    if own is None:
        if model_vocab < 256:
            raise ValueError(
                f"model.vocab_size={model_vocab} is below the data's 256 byte tokens: set it >= 256"
            )
        return
    vocab = own[1]
    docs = _split(own[0], cfg.held_out_share)[0]
    where = f"data.tokens: {cfg.tokens}" if cfg.tokens else f"data.text: {cfg.text}"
    if docs.max_id >= model_vocab:
        raise ValueError(
            f"{where}: token id {docs.max_id} >= model.vocab_size={model_vocab}: set "
            f"model.vocab_size >= {docs.max_id + 1}"
        )
    if vocab > model_vocab:
        raise ValueError(
            f"data.tokenizer {cfg.tokenizer or '(UTF-8 bytes)'} has {vocab} tokens, above "
            f"model.vocab_size={model_vocab}: set model.vocab_size >= {vocab}"
        )
    if cfg.eot >= model_vocab:
        raise ValueError(f"data.eot = {cfg.eot} >= model.vocab_size={model_vocab}")
    if docs.longest < cfg.min_seq_len + 1:
        raise ValueError(
            f"{where}: the longest of its {docs.count} training documents (the rest held out "
            f"for evaluation) has {docs.longest} tokens, "
            f"fewer than data.min_seq_len + 1 = {cfg.min_seq_len + 1}: lower data.min_seq_len"
        )


def batches(
    cfg: DataConfig, step: int, n_microbatches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Microbatches (idx, targets) of step `step`, each int64 [microbatch_size, T_m].

    The stdlib corpus: T_m is drawn per microbatch in [min_seq_len, max_seq_len], rows start
    anywhere. The user's data: T_m is a random document's length, cut to max_seq_len, and every
    row lies inside one document (models/documents.py). Targets are idx shifted by one token.
    Depends only on (cfg, step, microbatch index).
    """
    return _draw(cfg, step, n_microbatches, held_out=False)


def eval_batches(
    cfg: DataConfig, index: int, n_microbatches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out iteration ``index``'s microbatches, drawn as ``batches`` draws, from data that
    training never sees (the module's docstring says which)."""
    return _draw(cfg, index, n_microbatches, held_out=True)


def _draw(cfg: DataConfig, step: int, n_microbatches: int, held_out: bool):
    if step < 0 or n_microbatches <= 0:
        raise ValueError(f"need step >= 0 and n_microbatches > 0, got {step}, {n_microbatches}")
    split = own_split(cfg)
    if split is not None:
        docs = split[1] if held_out else split[0]
        out = []
        for m in range(n_microbatches):
            rng = np.random.default_rng([cfg.seed, step, m])
            rows = torch.from_numpy(
                docs.draw(rng, cfg.microbatch_size, cfg.min_seq_len, cfg.max_seq_len)
            )
            out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        return out
    if held_out:
        data = corpus(cfg.corpus_bytes + cfg.held_out_bytes)[cfg.corpus_bytes :]
    else:
        data = corpus(cfg.corpus_bytes)
    n = data.numel()
    if n <= cfg.max_seq_len + 1:
        raise RuntimeError(f"corpus has {n} bytes, too few for max_seq_len {cfg.max_seq_len}")
    out = []
    for m in range(n_microbatches):
        rng = np.random.default_rng([cfg.seed, step, m])
        t = int(rng.integers(cfg.min_seq_len, cfg.max_seq_len + 1))
        starts = torch.from_numpy(rng.integers(0, n - t, size=cfg.microbatch_size))
        rows = data[starts[:, None] + torch.arange(t + 1)].long()
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out
