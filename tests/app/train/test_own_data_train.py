"""docs/training.md's commands for one's own data train and write their metrics: in process (one
rank, its heartbeat's beater forked; the commands' own --set keys with smaller shapes), and `rrfp
train` with a token file on 2 ranks; bad data is one line and exit 2 on every rank."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process
from harness.distributed import free_port
from harness.launch import rank_vars
from harness.train_rows import TrainJob

GPT2_EOT = 50256
# smaller shapes, so a step takes a moment on one CPU rank
SMALL = [
    "--set", "steps=2", "--set", "n_microbatches=2", "--set", "model.n_layer=1",
    "--set", "data.microbatch_size=2", "--set", "data.min_seq_len=8",
    "--set", "data.max_seq_len=32",
]  # fmt: skip


def documented_command(key: str) -> list[str]:
    """docs/training.md's `rrfp train` command that sets ``key``, as argv after `rrfp`."""
    text = (ROOT / "docs" / "training.md").read_text()
    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.startswith(".venv/bin/rrfp") and key in ln)
    words = shlex.split(line.split("#")[0])
    assert words[:2] == [".venv/bin/rrfp", "train"], words
    i = words.index("--nproc-per-node")
    return words[1:i] + words[i + 2 :]  # one rank here, in process


def gpt2_token_file(path: Path, docs: int = 40, eot: int = GPT2_EOT) -> np.ndarray:
    """nanoGPT's layout: documents of GPT-2 ids, each followed by 50256 (``eot``, the largest id),
    as flat uint16."""
    rng = np.random.default_rng(0)
    parts = [np.append(rng.integers(0, eot, size=n), eot) for n in rng.integers(4, 80, docs)]
    arr = np.concatenate(parts).astype(np.uint16)
    arr.tofile(path)
    return arr


def _train_in_process(argv: list[str], tmp: Path) -> list[dict]:
    out = tmp / "runs" / "r"
    sets = ["--set", f"data.cache_dir={tmp / 'cache'}", "--set", f"output.dir={out}"]
    res = rrfp_in_process(*argv, *SMALL, *sets, env=rank_vars(0, 1, free_port()))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"metrics: {out / 'metrics.jsonl'}" in res.stdout, res.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sub(argv: list[str], old: str, new: Path) -> list[str]:
    return [re.sub(rf"=\s*{re.escape(old)}$", f"={new}", a) for a in argv]


@pytest.mark.multirank  # one gloo rank in this process, and its heartbeat's forked beater
def test_readme_token_file_command_trains(tmp_path):
    argv = documented_command("data.tokens=")
    assert "--set" in argv and "data.eot=50256" in argv and "model.vocab_size=50304" in argv
    gpt2_token_file(tmp_path / "train.bin")
    rows = _train_in_process(_sub(argv, "train.bin", tmp_path / "train.bin"), tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    # an untrained model over 50304 ids starts near ln(50304): the token file's vocab is in use
    assert abs(rows[0]["loss"] - math.log(50304)) < 0.5, rows[0]
    assert all(r["tokens"] > 0 and r["mfu"] > 0 and 0 <= r["bubble"] < 1 for r in rows)


@pytest.mark.multirank
def test_readme_text_command_trains(tmp_path):
    tk = pytest.importorskip("tokenizers")  # the hf extra installs it, as the text extra does
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, word in enumerate(["alpha", "beta", "gamma"]):
        (texts / f"{i}.txt").write_text(f"{word} one two three four {word} five six. " * 20)
    tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.train(
        [str(p) for p in texts.iterdir()], tk.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = documented_command("data.text=")
    argv = _sub(_sub(argv, "texts/", texts), "tokenizer.json", tmp_path / "tokenizer.json")
    rows = _train_in_process(argv, tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_rrfp_train_on_a_token_file_writes_each_step(tmp_path):
    """Two ranks (pp 2) on a token file: rank 0's metrics.jsonl has every step; then the same file
    against a too-small vocab: each rank refuses it in one line, no traceback, exit 2. The ranks
    are plain processes (tests/harness/train_rows.py): what they do with the file is the point
    here. The launcher has tests of its own (tests/app/cli/test_train_cli.py), and so has the one
    line per job that torchrun's agent store allows (tests/app/cli/test_malformed_inputs.py)."""
    arr = gpt2_token_file(tmp_path / "train.bin", eot=511)  # a small vocab: a quick step
    common = [
        "--config", "configs/gpt-tiny.toml", *SMALL, "--set", "steps=3", "--set", "model.n_layer=2",
        "--set", f"data.tokens={tmp_path / 'train.bin'}", "--set", "data.eot=511",
        "--set", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    out = tmp_path / "run"
    job = TrainJob(
        tmp_path / "job", [*common, "--set", "model.vocab_size=512", "--set", f"output.dir={out}"]
    ).finish(200)
    assert job.codes() == [0, 0], job.tails()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert set(rows[0]) >= {"loss", "lr", "tokens_per_s", "mfu", "bubble", "wall_s"}
    about = json.loads((out / "run.json").read_text())
    assert about["config"]["data"]["tokens"] == str(tmp_path / "train.bin")
    assert about["peak_source"].startswith("cpu") and about["model_flops"]["layers"] == 2
    bad = TrainJob(tmp_path / "bad", [*common, "--set", "model.vocab_size=500"]).finish(120)
    want = f"token id {int(arr.max())} >= model.vocab_size=500"
    lines = [bad.lines(r) for r in (0, 1)]  # no agent store to agree through: each rank says it
    assert [len(ln) for ln in lines] == [1, 1] and all(want in ln[0] for ln in lines), bad.tails()
    assert not any("Traceback" in bad.err(r) for r in (0, 1)), bad.tails()
    assert bad.codes() == [2, 2], bad.tails()
