"""Evaluation draws from data that training never draws (rrfp/models/data.py): the stdlib bytes
after the training corpus, or the last share of the user's documents."""

import numpy as np
import pytest

from rrfp.models.data import DataConfig, batches, corpus, eval_batches


def _rows(microbatches):
    return [row.tolist() for idx, _ in microbatches for row in idx]


def test_stdlib_evaluation_reads_only_the_bytes_after_the_training_corpus():
    cfg = DataConfig(corpus_bytes=8192, held_out_bytes=4096, max_seq_len=32, min_seq_len=16)
    whole = bytes(corpus(cfg.corpus_bytes + cfg.held_out_bytes).tolist())
    train, held = whole[: cfg.corpus_bytes], whole[cfg.corpus_bytes :]
    for step in range(4):
        for row in _rows(batches(cfg, step, 4)):
            assert bytes(row) in train
        for row in _rows(eval_batches(cfg, step, 4)):
            assert bytes(row) in held and bytes(row) not in train


@pytest.mark.parametrize("docs,held", [(10, 1), (50, 5)])
def test_own_documents_keep_the_last_share_for_evaluation(tmp_path, docs, held):
    eot = 0
    # document d: 40 tokens of id d + 1, then eot: a row's ids tell its document
    tokens = np.concatenate([np.r_[np.full(40, d + 1), eot] for d in range(docs)]).astype(np.uint16)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    cfg = DataConfig(
        tokens=str(path), eot=eot, cache_dir=str(tmp_path / "cache"), held_out_share=0.1
    )
    seen_train, seen_eval = set(), set()
    for step in range(30):
        seen_train |= {t for row in _rows(batches(cfg, step, 2)) for t in row if t != eot}
        seen_eval |= {t for row in _rows(eval_batches(cfg, step, 2)) for t in row if t != eot}
    held_ids = set(range(docs - held + 1, docs + 1))
    assert seen_eval <= held_ids and seen_eval
    assert not seen_train & held_ids and seen_train


def test_a_held_out_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="held_out_share"):
        DataConfig(held_out_share=1.0)
