"""A user's own tokens: a pre-tokenized token file, or text files and a local tokenizer.

Token files are nanoGPT's flat ``uint16`` ``.bin`` (read as a memmap) or a 1-D ``.npy`` of
uint16, uint32, int32 or int64. Text is a file, a directory (its ``*.txt``, recursively) or a
glob, tokenized by a ``tokenizer.json`` (the ``tokenizers`` package) or, without one, as UTF-8
bytes. Each text file is a document: the file is the unit the user gave, and a paragraph split
would cut a story or an article into pieces that lose their context; documents inside a file are
told apart by the end-of-text token instead, when the tokenizer produces it.

What costs a pass over the data is done once and cached, keyed by the files' paths, sizes and
modification times (and the tokenizer file's hash): the text's tokens, and every source's document
ends and largest id. A cache entry is written to a temporary name and renamed, so ranks that fill
it at once each see a whole one. Bad data raises ``DataError``, one line naming the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from rrfp.models.documents import Documents, max_token, split_at

log = logging.getLogger(__name__)

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
TOKEN_SUFFIXES = (".bin", ".npy")
CACHE_VERSION = 1


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file and what is wrong."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rrfp" / "tokens"


def open_token_file(path: str) -> np.ndarray:
    """The token ids of a ``.bin`` (flat uint16) or ``.npy`` file, memmapped, 1-D, not empty."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.tokens: no such file {path}")
    if p.suffix not in TOKEN_SUFFIXES:
        raise DataError(
            f"data.tokens: {path} has the extension {p.suffix or '(none)'!r}; expected a flat "
            f"uint16 .bin (nanoGPT's) or a .npy of {', '.join(TOKEN_DTYPES)}"
        )
    size = p.stat().st_size
    if size == 0:
        raise DataError(f"data.tokens: {path} is empty")
    if p.suffix == ".bin":
        if size % 2:
            raise DataError(
                f"data.tokens: {path} has {size} bytes, not a whole number of uint16 tokens"
            )
        return np.memmap(p, dtype=np.uint16, mode="r")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"data.tokens: {path} is not a readable .npy file: {e}") from None
    if arr.dtype.name not in TOKEN_DTYPES:
        raise DataError(
            f"data.tokens: {path} holds {arr.dtype.name}; token ids must be one of "
            f"{', '.join(TOKEN_DTYPES)}"
        )
    if arr.ndim != 1:
        raise DataError(f"data.tokens: {path} has shape {arr.shape}; expected a flat 1-D array")
    if arr.size == 0:
        raise DataError(f"data.tokens: {path} holds no tokens")
    return arr


def read_token_file(path: str, eot: int, cache_dir: str | Path) -> tuple[Documents, int]:
    """The documents of a token file (split after each ``eot``), and its vocab: largest id + 1."""
    tokens = open_token_file(path)
    p = Path(path).resolve()
    st = p.stat()
    key = _key(["tokens", str(p), st.st_size, st.st_mtime_ns, eot])
    cache = _Cache(cache_dir, key)
    meta = cache.meta()
    if meta is None:
        low, high = max_token(tokens)
        if low < 0:
            raise DataError(f"data.tokens: {path} holds the negative token id {low}")
        ends = split_at(tokens, eot)
        cache.write(ends=ends, meta={"max_id": high, "source": str(p)})
        meta = cache.meta()
        assert meta is not None
    else:
        log.info("data: %s: document ends from the cache %s", path, cache.dir)
    ends = cache.array("ends")
    return Documents(tokens, ends, int(meta["max_id"])), int(meta["max_id"]) + 1


def text_files(spec: str) -> list[Path]:
    """The files ``data.text`` names: one file, a directory's ``*.txt`` or a glob's matches, in
    sorted order (the same on every rank)."""
    p = Path(spec)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not found:
            raise DataError(f"data.text: the directory {spec} has no *.txt files")
        return found
    matches = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
    if not matches:
        raise DataError(
            f"data.text: no such file, directory or glob match: {spec}"
            if not glob.has_magic(spec)
            else f"data.text: no file matches {spec}"
        )
    return matches


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            "data.tokenizer needs the tokenizers package: pip install 'rrfp[text]'"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the package's own error type, a Rust panic's message included
        raise DataError(
            f"data.tokenizer: {path} does not load as a tokenizer.json: "
            f"{' '.join(str(e).split())[:200]}"
        ) from None


def read_text(spec: str, tokenizer: str, eot: int, cache_dir: str | Path) -> tuple[Documents, int]:
    """The documents of text files (each file one, also split after each ``eot``), and the vocab:
    the tokenizer's size, or 256 for UTF-8 bytes. Tokenized once; later reads hit the cache
    without loading the tokenizer."""
    files = text_files(spec)
    parts: list = ["text", eot]
    for f in files:
        st = f.stat()
        parts += [str(f.resolve()), st.st_size, st.st_mtime_ns]
    if tokenizer:
        if not Path(tokenizer).is_file():
            raise DataError(f"data.tokenizer: no such file {tokenizer}")
        parts.append(hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest())
    cache = _Cache(cache_dir, _key(parts))
    meta = cache.meta()
    if meta is None:
        tokens, ends, vocab = _tokenize(files, tokenizer, eot)
        high = int(tokens.max())
        cache.write(tokens=tokens, ends=ends, meta={"max_id": high, "vocab": vocab, "source": spec})
        meta = cache.meta()
        assert meta is not None
        log.info(
            "data: tokenized %d file(s) into %d tokens, cached in %s",
            len(files),
            len(tokens),
            cache.dir,
        )
    else:
        log.info("data: %s: tokens from the cache %s", spec, cache.dir)
    docs = Documents(cache.array("tokens"), cache.array("ends"), int(meta["max_id"]))
    return docs, int(meta["vocab"])


def _tokenize(files: list[Path], tokenizer: str, eot: int) -> tuple[np.ndarray, np.ndarray, int]:
    tok = load_tokenizer(tokenizer) if tokenizer else None
    vocab = tok.get_vocab_size() if tok is not None else 256
    if 0 <= vocab <= eot:
        raise DataError(
            f"data.eot = {eot} is not a token of {tokenizer or 'UTF-8 bytes'} ({vocab} tokens)"
        )
    pieces, file_ends, total = [], [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"data.text: {f} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise DataError(f"data.text: cannot read {f}: {e.strerror}") from None
        ids = (
            np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
            if tok is not None
            else np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        )
        if eot >= 0 and len(ids) and ids[-1] != eot:
            ids = np.append(ids, eot)
        pieces.append(ids)
        total += len(ids)
        file_ends.append(total)
    if total == 0:
        names = files[0] if len(files) == 1 else f"{len(files)} files"
        raise DataError(f"data.text: {names}: no tokens (empty text)")
    tokens = np.concatenate(pieces)
    tokens = tokens.astype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    return tokens, split_at(tokens, eot, np.array(file_ends)), vocab


def _key(parts: list) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts]).encode()).hexdigest()[:24]


class _Cache:
    """An entry: KEY.json (written last: there only when the entry is whole) and KEY.NAME.npy."""

    def __init__(self, root: str | Path, key: str) -> None:
        self.dir, self.key = Path(root) if root else default_cache_dir(), key

    def _path(self, name: str) -> Path:
        return self.dir / f"{self.key}.{name}"

    def meta(self) -> dict | None:
        try:
            return json.loads(self._path("json").read_text())
        except (OSError, ValueError):
            return None

    def array(self, name: str) -> np.ndarray:
        return np.load(self._path(f"{name}.npy"), mmap_mode="r")

    def write(self, meta: dict, **arrays: np.ndarray) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for name, arr in arrays.items():
                self._replace(f"{name}.npy", lambda f, a=arr: np.save(f, a))
            self._replace("json", lambda f: f.write(json.dumps(meta).encode()))
        except OSError as e:
            raise DataError(
                f"data.cache_dir: cannot write the token cache in {self.dir}: {e.strerror or e}"
            ) from None

    def _replace(self, name: str, write) -> None:
        final = self._path(name)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, final)
