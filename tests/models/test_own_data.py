"""A user's own data: token files and text with a local tokenizer. Rows stay inside one document,
lengths follow the documents, text is tokenized once, and bad data is one ValueError line."""

from __future__ import annotations

import numpy as np
import pytest

from rrfp.models import token_files
from rrfp.models.data import DataConfig, batches, check_fits, vocab_size
from rrfp.models.documents import Documents
from rrfp.models.token_files import DataError, read_text, read_token_file

EOT = 0


def _docs_file(tmp_path, lengths, dtype=np.uint16, suffix=".bin"):
    """Document i is ``len_i`` copies of token i + 1, then EOT: a row holding two different
    non-EOT tokens spans two documents."""
    parts = [np.append(np.full(n, i + 1), EOT) for i, n in enumerate(lengths)]
    arr = np.concatenate(parts).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".bin":
        arr.tofile(path)
    else:
        np.save(path, arr)
    return path, arr


def _rows_in_one_document(x, y):
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        window = [*xr, yr[-1]]
        body = [t for t in window if t != EOT]
        assert len(set(body)) <= 1, f"a row spans documents: {window}"
        assert EOT not in window[:-1], f"a row goes past a document's end: {window}"


def test_token_file_rows_stay_in_one_document_and_lengths_vary(tmp_path):
    lengths = [3, 40, 7, 90, 25, 64, 12, 150, 33, 5] * 5
    path, _ = _docs_file(tmp_path, lengths)
    cfg = DataConfig(tokens=str(path), eot=EOT, cache_dir=str(tmp_path / "c"), max_seq_len=64)
    check_fits(cfg, 256)
    seen = set()
    for step in range(8):
        for x, y in batches(cfg, step, 4):
            assert x.shape == y.shape and x.shape[0] == cfg.microbatch_size
            assert (x[:, 1:] == y[:, :-1]).all()
            _rows_in_one_document(x, y)
            seen.add(x.shape[1])
    # a length is a drawn document's (with its EOT: len + 1 tokens, len inputs), cut to 64; the
    # documents shorter than min_seq_len + 1 = 17 tokens are never drawn
    allowed = {min(n, 64) for n in lengths if n + 1 >= 17}
    assert seen <= allowed and len(seen) >= 3, seen
    assert batches(cfg, 3, 4)[2][0].tolist() == batches(cfg, 3, 4)[2][0].tolist()


def test_windows_cover_every_start_uniformly():
    """Every window of the drawn length inside a document is reachable, long documents holding
    more of them: with documents of 5 and 8 tokens and windows of 5, 1 + 4 starts."""
    tokens = np.arange(13)
    docs = Documents(tokens, np.array([5, 13]), 12)
    rng = np.random.default_rng(0)
    starts = docs._window_starts(rng, 5000, 5)
    counts = np.bincount(starts, minlength=13)
    assert set(np.flatnonzero(counts)) == {0, 5, 6, 7, 8}
    assert counts[[0, 5, 6, 7, 8]].min() > 800  # about 1000 each


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_npy_dtypes(tmp_path, dtype):
    path, arr = _docs_file(tmp_path, [30, 50], dtype=np.dtype(dtype), suffix=".npy")
    docs, vocab = read_token_file(str(path), EOT, tmp_path / "c")
    assert vocab == int(arr.max()) + 1 == 3
    assert docs.ends.tolist() == [31, 82]


def test_token_file_document_ends_are_cached(tmp_path, monkeypatch):
    path, _ = _docs_file(tmp_path, [30, 50])
    read_token_file(str(path), EOT, tmp_path / "c")
    monkeypatch.setattr(token_files, "split_at", _never)
    monkeypatch.setattr(token_files, "max_token", _never)
    docs, vocab = read_token_file(str(path), EOT, tmp_path / "c")
    assert docs.ends.tolist() == [31, 82] and vocab == 3


def _never(*args, **kwargs):
    raise AssertionError("the cache was not used")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A small BPE tokenizer.json, trained here (the tokenizers package, no download)."""
    tk = pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "train.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    tok = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.train([str(corpus)], tk.trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<e>"]))
    path = d / "tokenizer.json"
    tok.save(str(path))
    return path


def _vocab(path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size()


def _texts(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("the quick brown fox " * 30)
    (d / "b.txt").write_text("jumps over the lazy dog " * 12)
    (d / "c.txt").write_text("the dog " * 40)
    (d / "skip.md").write_text("not text of the corpus")
    return d


def test_text_is_tokenized_once_then_read_from_the_cache(tmp_path, tokenizer_json, monkeypatch):
    d = _texts(tmp_path)
    calls = []
    real = token_files.load_tokenizer
    monkeypatch.setattr(token_files, "load_tokenizer", lambda p: calls.append(p) or real(p))
    docs, vocab = read_text(str(d), str(tokenizer_json), 1, tmp_path / "c")
    assert len(calls) == 1 and vocab == _vocab(tokenizer_json)
    assert docs.count == 3  # a document per *.txt file; skip.md is not one
    again, vocab2 = read_text(str(d), str(tokenizer_json), 1, tmp_path / "c")
    assert len(calls) == 1, "the tokenizer ran again: the cache was not used"
    assert np.array_equal(np.asarray(again.tokens), np.asarray(docs.tokens)) and vocab2 == vocab
    (d / "c.txt").write_text("the fox " * 41)  # a changed file is tokenized again
    read_text(str(d), str(tokenizer_json), 1, tmp_path / "c")
    assert len(calls) == 2


def test_text_documents_are_files(tmp_path, tokenizer_json):
    d = _texts(tmp_path)
    cfg = DataConfig(
        text=str(d / "*.txt"),
        tokenizer=str(tokenizer_json),
        cache_dir=str(tmp_path / "c"),
        max_seq_len=48,
    )
    docs, _ = read_text(cfg.text, cfg.tokenizer, -1, cfg.cache_dir)
    assert docs.ends[-1] == len(docs.tokens)
    bounds = set(docs.ends.tolist())
    vocab = _vocab(tokenizer_json)
    check_fits(cfg, vocab)
    assert vocab_size(cfg) == vocab
    lengths = set()
    for step in range(6):
        for x, _ in batches(cfg, step, 3):
            lengths.add(x.shape[1])
            assert x.max() < vocab
    # every draw is one document's length (cut to 48): the documents' lengths are below
    allowed = {min(int(n) - 1, 48) for n in docs.lengths()}
    assert lengths <= allowed and len(bounds) == 3


def test_text_as_bytes_without_a_tokenizer(tmp_path):
    (tmp_path / "one.txt").write_text("abc" * 20)
    docs, vocab = read_text(str(tmp_path / "one.txt"), "", -1, tmp_path / "c")
    assert vocab == 256 and np.asarray(docs.tokens).tolist() == list(b"abc" * 20)


def _bad(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda t: str(t / "missing.bin"), "no such file"),
        (lambda t: _bad(t, "e.bin", b""), "is empty"),
        (lambda t: _bad(t, "odd.bin", b"\x01\x00\x02"), "not a whole number of uint16"),
        (lambda t: _bad(t, "x.txt", b"\x01\x00"), "expected a flat uint16 .bin"),
        (lambda t: _bad(t, "bad.npy", b"not numpy"), "not a readable .npy"),
    ],
)
def test_bad_token_files(tmp_path, make, needle):
    with pytest.raises(DataError, match=needle) as e:
        read_token_file(make(tmp_path), EOT, tmp_path / "c")
    assert "\n" not in str(e.value)


def test_bad_npy_contents(tmp_path):
    for arr, needle in [
        (np.ones(4, dtype=np.float32), "holds float32"),
        (np.ones((2, 2), dtype=np.int32), "flat 1-D"),
        (np.array([1, -3], dtype=np.int64), "negative token id -3"),
        (np.array([], dtype=np.int64), "no tokens"),
    ]:
        np.save(tmp_path / "a.npy", arr)
        with pytest.raises(DataError, match=needle):
            read_token_file(str(tmp_path / "a.npy"), -1, tmp_path / "c")


def test_bad_text_and_tokenizer(tmp_path, tokenizer_json):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "t.txt").write_text("the fox " * 20)
    broken = _bad(tmp_path, "tokenizer.json", b'{"version": "1.0", "model": 3}')
    cases = [
        (str(tmp_path / "empty.txt"), "", -1, "no tokens"),
        (str(tmp_path / "nope" / "*.txt"), "", -1, "no file matches"),
        (str(tmp_path / "t.txt"), broken, -1, "does not load as a tokenizer.json"),
        (str(tmp_path / "t.txt"), str(tmp_path / "no.json"), -1, "no such file"),
        (str(tmp_path / "t.txt"), str(tokenizer_json), 500, "data.eot = 500 is not a token"),
    ]
    for text, tok, eot, needle in cases:
        with pytest.raises(DataError, match=needle) as e:
            read_text(text, tok, eot, tmp_path / "c")
        assert "\n" not in str(e.value)


def test_vocab_and_length_checks(tmp_path, tokenizer_json):
    path, _ = _docs_file(tmp_path, [30, 300])
    cfg = DataConfig(tokens=str(path), eot=EOT, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"token id 2 >= model.vocab_size=2: set model"):
        check_fits(cfg, 2)
    (tmp_path / "short").mkdir()
    short, _ = _docs_file(tmp_path / "short", [4, 5])
    few = DataConfig(tokens=str(short), eot=EOT, cache_dir=str(tmp_path / "c"), min_seq_len=16)
    with pytest.raises(
        ValueError,
        match=r"longest of its 1 training documents \(the rest held out for evaluation\) "
        r"has 5 tokens",
    ):
        check_fits(few, 256)
    (tmp_path / "t.txt").write_text("the fox " * 20)
    text = DataConfig(
        text=str(tmp_path / "t.txt"),
        tokenizer=str(tokenizer_json),
        min_seq_len=2,
        cache_dir=str(tmp_path / "c"),
    )
    vocab = _vocab(tokenizer_json)
    with pytest.raises(ValueError, match=f"has {vocab} tokens, above model.vocab_size={vocab - 1}"):
        check_fits(text, vocab - 1)
    with pytest.raises(ValueError, match="two sources"):
        DataConfig(tokens="a.bin", text="b.txt")


def test_a_checkpoint_saved_before_the_data_keys_still_matches():
    """A checkpoint's fingerprint from before [data] had tokens, text, tokenizer, eot and cache_dir
    matches a run that leaves them at their defaults, and not one that trains on a token file."""
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoints import (
        _comparable,
        _new_keys_at_default,
        differences,
        fingerprint,
    )

    new = {"tokens", "text", "tokenizer", "eot", "cache_dir"}
    cfg = TrainConfig.load("configs/gpt-tiny.toml", world_size=4)
    saved = fingerprint(cfg)
    saved["data"] = {k: v for k, v in saved["data"].items() if k not in new}

    def diffs(run: TrainConfig) -> list[str]:
        return differences(*_comparable(saved, _new_keys_at_default(saved, fingerprint(run), run)))

    assert diffs(cfg) == []
    own = TrainConfig.load("configs/gpt-tiny.toml", ["data.eot=7"], world_size=4)
    assert diffs(own) == ["data.eot: checkpoint '(absent)', this run 7"]
