"""Malformed input, of every kind (config, command line, checkpoint, message
header), gives one line that names the problem, with no traceback, and exit 2;
at 4 ranks sharing torchrun's store, one line for the whole job.

docs/malformed-inputs.md is this file's table: ``python tests/app/cli/test_malformed_inputs.py``
prints it, and a test checks that the document says what rrfp prints.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the harness
from harness import ROOT  # noqa: E402
from harness.cli_run import rrfp_in_process  # noqa: E402
from harness.launch import rank_vars  # noqa: E402
from harness.train_rows import TrainJob  # noqa: E402

DOC = ROOT / "docs" / "malformed-inputs.md"
CONFIG = "configs/gpt-tiny.toml"
# a 2-rank run of a small GPT; the world size comes from WORLD_SIZE, as under torchrun
SMALL = [
    "--config",
    CONFIG,
    "--set",
    "model.n_layer=2",
    "--set",
    "n_microbatches=4",
    "--set",
    "steps=4",
]
WORLD = 2


@dataclass(frozen=True)
class Row:
    kind: str  # config, environment, CLI, checkpoint, header, data
    what: str
    make: Callable[[Path], list[str]]  # tmp -> argv of `rrfp` (a header row: -> the header words)
    needle: str  # in the line: what it must name
    code: int = 2  # the exit code (a warning: the run goes on, here a dry run that exits 0)
    env: tuple[
        tuple[str, str], ...
    ] = ()  # set for this row, over the launcher's (a rank started by hand)


def _sets(*sets: str, dry_run: bool = True) -> Callable[[Path], list[str]]:
    return lambda tmp: [
        "train",
        *SMALL,
        *[a for s in sets for a in ("--set", s)],
        *(["--dry-run"] * dry_run),
    ]


def _file(text: bytes, *extra: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "run.toml"
        path.write_bytes(text)
        return ["train", "--config", str(path), *extra, "--dry-run"]

    return make


def _model_file(source: str) -> Callable[[Path], list[str]]:
    """run.model naming a file of ``source`` in the test's folder."""

    def make(tmp: Path) -> list[str]:
        (tmp / "bad_model.py").write_text(source)
        return _sets(f"run.model={tmp / 'bad_model.py'}")(tmp)

    return make


# ---- checkpoints, made in-process: a real DCP checkpoint of placeholder tensors for a 2-rank pp=2
# run ----


def _checkpoint(tmp: Path, step: int = 2, **run) -> Path:
    """DIR/step-N, committed as a run would, with the fingerprint of SMALL's config (``run``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoint_dir import CheckpointDir
    from rrfp.app.train.checkpoints import fingerprint

    sets = [s for s in SMALL[2:] if s != "--set"] + [f"{k}={json.dumps(v)}" for k, v in run.items()]
    cfg = TrainConfig.load(CONFIG, sets, world_size=WORLD)
    store = CheckpointDir(tmp / "ck")
    state = {
        **{f"stage{s}.tp0": {"model": {"w": torch.full((4,), float(s))}} for s in range(2)},
        **{f"rank{r}": {"rng": torch.get_rng_state()} for r in range(WORLD)},
    }
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(store.partial_path(step)), no_dist=True)
    return store.commit(step, {"config": fingerprint(cfg), "world_size": WORLD}).path


def _reseal(ckpt: Path) -> None:
    """Rewrite the commit record for the files as they are now (as if they had been saved so)."""
    from rrfp.app.train import checkpoint_dir as cd

    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": cd._sha256(p)}
        for p in sorted(ckpt.iterdir())
        if p.is_file() and p.name != cd.MARKER
    }
    (ckpt / cd.MARKER).write_text(cd._record_text(int(ckpt.name.split("-")[1]), files))


def _resume(*sets: str, prepare: Callable[[Path], None] = lambda ckpt: None, **run):
    def make(tmp: Path) -> list[str]:
        ckpt = _checkpoint(tmp, **run)
        prepare(ckpt)
        return [
            "train",
            *SMALL,
            "--set",
            f"checkpoint.dir={tmp / 'ck'}",
            *[a for s in sets for a in ("--set", s)],
            "--dry-run",
        ]

    return make


def _meta(doc) -> Callable[[Path], None]:
    def prepare(ckpt: Path) -> None:
        (ckpt / "meta.json").write_text(json.dumps(doc))
        _reseal(ckpt)

    return prepare


def _flip(name: str) -> Callable[[Path], None]:
    def prepare(ckpt: Path) -> None:
        data = bytearray((ckpt / name).read_bytes())
        data[len(data) // 2] ^= 0x40
        (ckpt / name).write_bytes(bytes(data))

    return prepare


def _unwritable(tmp: Path) -> list[str]:
    (tmp / "a-file").write_text("")
    return ["train", *SMALL, "--set", f"checkpoint.dir={tmp / 'a-file' / 'ck'}", "--dry-run"]


def _cost(doc) -> Callable[[Path], list[str]]:
    """An emulation.cost file holding ``doc`` (JSON text when a str), for SMALL's two stages."""

    def make(tmp: Path) -> list[str]:
        (tmp / "cost.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return ["train", *SMALL, "--set", f"cost={tmp / 'cost.json'}", "--dry-run"]

    return make


def _coef(first: list, reference_s=1.0) -> dict:
    """A cost model whose first (stage, kind) has the coefficients ``first``, every other zeros."""
    zeros = [0.0, 0.0, 0.0, 0.0]
    return {
        "features": ["tokens", "attn", "patches"],
        "reference_s": reference_s,
        "coef": [[first, zeros, zeros], [zeros, zeros, zeros]],
    }


def _sealed(body: str) -> Callable[[Path], None]:
    """A commit record whose seal matches ``body`` (so only what the body says can be wrong)."""

    def prepare(ckpt: Path) -> None:
        import hashlib

        (ckpt / "COMMITTED").write_text(
            json.dumps({"record": body, "sha256": hashlib.sha256(body.encode()).hexdigest()})
        )

    return prepare


def _hand() -> Callable[[Path], list[str]]:
    """A real (not dry) run: a rank started by hand, whose environment the row sets."""
    return lambda tmp: ["train", *SMALL]


def _below_a_file(where: str, name: str) -> Callable[[Path], list[str]]:
    """A path below a plain file, for a run key (``trace``) or an ``rrfp sim`` flag (``--json``)."""

    def make(tmp: Path) -> list[str]:
        (tmp / "a-file").write_text("")
        path = tmp / "a-file" / name
        if where.startswith("--"):
            return ["sim", "--pp", "2", "--n-microbatches", "2", "--seeds", "1", where, str(path)]
        return ["train", *SMALL, "--set", f"{where}={path}", "--dry-run"]

    return make


# ---- message headers: the words a broken sender or link delivers (decoded by the receiving rank)
# ----


def _header(change: Callable[[list], None], seal: bool = True) -> Callable[[Path], list]:
    def make(tmp: Path) -> list:
        import torch

        from rrfp.comm.message import Message, checksum, encode_header

        words = encode_header(Message(3, 1, 0, [torch.zeros(2, 5)])).tolist()
        change(words)
        if seal:
            words[-1] = checksum(words[:-1])
        return words

    return make


def _huge(words: list) -> None:
    from rrfp.comm.message import MAX_DIMS, MAX_TENSORS

    words[5] = MAX_TENSORS
    for i in range(
        MAX_TENSORS
    ):  # 8 float64 tensors of 2**40 elements: each within the per-tensor limit
        words[6 + i * (3 + MAX_DIMS) : 6 + (i + 1) * (3 + MAX_DIMS)] = [2, 1, 1 << 40] + [
            0
        ] * MAX_DIMS  # flags 0


def _data(
    name: str, content: bytes | str | None, key: str = "tokens", tokenizer: bytes | None = None
) -> Callable[[Path], list[str]]:
    """A dry run on the file TMP/``name`` as data.``key``: ``content`` its bytes, or the dtype of
    a .npy whose largest id is 300 (model.vocab_size is 256), or None for no file."""

    def make(tmp: Path) -> list[str]:
        path = tmp / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            import numpy as np

            np.save(path, np.arange(301).astype(content))
        sets = [f"data.{key}={path}", f"data.cache_dir={tmp / 'cache'}"]
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_bytes(tokenizer)
            sets.append(f"data.tokenizer={tmp / 'tokenizer.json'}")
        return _sets(*sets)(tmp)

    return make


def _put(index: int, value: int) -> Callable[[list], None]:
    return lambda words: words.__setitem__(index, value)


ROWS = [
    Row("config", "unknown key", _sets("foo=1"), "no section has a key 'foo'"),
    Row("config", "a value of the wrong type", _sets("steps=abc"), "wrong type"),
    Row("config", "`steps = 0`", _sets("steps=0"), "run.steps must be >= 1"),
    Row(
        "config",
        "`n_microbatches = 100000000000`",
        _sets("n_microbatches=100000000000"),
        "[1, 65536]",
    ),
    Row(
        "config",
        "`seed = 99999999999999999999999`",
        _sets("seed=99999999999999999999999"),
        "run.seed",
    ),
    Row(
        "config",
        "`unit_ms = 1e308`",
        _sets("unit_ms=1e308"),
        "emulation.unit_ms = 1e+308 is out of bounds",
    ),
    Row(
        "config",
        "`timeout_s = inf`",
        _sets("timeout_s=inf"),
        "run.timeout_s must be a finite number",
    ),
    Row("config", "`lr = nan`", _sets("lr=nan"), "optim.lr must be a finite number"),
    Row("config", "`weight_decay = -1`", _sets("weight_decay=-1"), "optim.weight_decay"),
    Row(
        "config",
        "`clip_grad_norm = -1`",
        _sets("clip_grad_norm=-1"),
        "optim.clip_grad_norm must be >= 0",
    ),
    Row(
        "config",
        "`clip_grad_norm = inf`",
        _sets("clip_grad_norm=inf"),
        "optim.clip_grad_norm must be a finite",
    ),
    Row("config", "`threads = 100000`", _sets("threads=100000"), "[1, 1024]"),
    Row("config", '`model = ".gpt"`', _sets('model=".gpt"'), "names no workload"),
    Row("config", '`model = "../x"`', _sets('model="../x"'), "a path names a Python file"),
    Row("config", "a model that does not exist", _sets("model=nope"), "no built-in model nope"),
    Row(
        "config",
        "a model file whose import raises",
        _model_file("import torch\nWIDTH = torch.zeros(2)[5]\n"),
        "importing TMP/bad_model.py raised IndexError",
    ),
    Row(
        "config",
        "`model.n_embd = 1.5`",
        _sets("model.n_embd=1.5"),
        "--set model.n_embd = 1.5 has the wrong type (expected int)",
    ),
    Row(
        "config", "`model.n_embd = 99999999999`", _sets("model.n_embd=99999999999"), "model.n_embd"
    ),
    Row("config", "an unknown hint", _sets("hint=nope"), "unknown hint"),
    Row("config", '`budget = "0x"`', _sets("budget=0x"), "schedule.budget"),
    Row(
        "config",
        "a layout that does not fit the world",
        _sets("pp=3"),
        "does not match world size 2",
    ),
    Row(
        "config",
        "data longer than the model's context",
        _sets("data.max_seq_len=200"),
        "model's context",
    ),
    Row(
        "config",
        '`backend = "mpi"`',
        _sets("backend=mpi"),
        "compute.backend must be one of auto, gloo, nccl",
    ),
    Row("config", '`resume = "maybe"`', _sets("resume=maybe"), "checkpoint.resume must be one of"),
    Row(
        "config",
        '`on_corrupt_checkpoint = "ignore"`',
        _sets("checkpoint.on_corrupt=ignore"),
        "checkpoint.on_corrupt",
    ),
    Row(
        "config",
        '`autocast = "fp8"`',
        _sets("autocast=fp8"),
        "compute.autocast must be one of off, bfloat16, float16, got 'fp8'",
    ),
    Row(
        "config",
        "`checkpoint.every` without `checkpoint.dir`",
        _sets("checkpoint.every=5"),
        "needs checkpoint.dir",
    ),
    Row(
        "config",
        "a fault spec of an unknown kind",
        _sets("fault=explode:step=1:stage=0"),
        "debug.fault",
    ),
    Row("config", "`--set` without `=`", _sets("steps"), "is not KEY=VALUE"),
    Row(
        "config",
        "a config file that is not UTF-8",
        _file(b"[run]\nsteps = 4 # \xff\xfe\n"),
        "not UTF-8",
    ),
    Row(
        "config", "a config file that is not TOML", _file(b"[run]\nhint = bfw\n"), "not valid TOML"
    ),
    Row(
        "config",
        "a config file that does not exist",
        lambda tmp: ["train", "--config", str(tmp / "nope.toml"), "--dry-run"],
        "cannot read config",
    ),
    Row("config", "an unknown section", _file(b"[runn]\nsteps = 4\n"), "unknown section [runn]"),
    Row("config", "a section that is not a table", _file(b"run = 5\n"), "[run] must be a table"),
    Row(
        "config",
        "`checkpoint.dir` that cannot be written (below a file)",
        _unwritable,
        "cannot hold checkpoints",
    ),
    Row(
        "config",
        "`trace` that cannot be written (below a file)",
        _below_a_file("trace", "t.json"),
        "cannot be written",
    ),
    Row(
        "config",
        'a hint that does not fit the layout (`hint = "zbv"` at one stage per rank)',
        _sets("hint=zbv", "schedule.dispatch=fixed"),
        "needs virtual = 2 and placement v",
    ),
    # not a dry run (the memory check builds the model on the meta device): refused before any
    # process group
    Row(
        "config",
        "a model too big for this machine's memory (1.6 TB of parameters and AdamW state)",
        _sets("model.n_embd=65536", dry_run=False),
        "lower schedule.n_microbatches, schedule.budget, data.microbatch_size",
    ),
    Row("config", "a cost file of `[]`", _cost([]), "expected a JSON object"),
    Row("config", "a cost file of a string", _cost('"fast"'), "expected a JSON object"),
    Row(
        "config",
        "a cost file with `reference_s = 0`",
        _cost(_coef([0.0] * 4, 0)),
        "reference_s must be",
    ),
    Row(
        "config",
        "a cost file with too few coefficients",
        _cost(_coef([0.0, 0.0])),
        "coef[0][0] must be 4",
    ),
    Row(
        "config",
        "a cost file with a coefficient of 1e308",
        _cost(_coef([1e308, 0, 0, 0])),
        "within +-1e+06",
    ),
    Row(
        "config",
        "a cost file with a NaN coefficient",
        _cost(
            '{"features": ["tokens", "attn", "patches"], '
            '"reference_s": 1, "coef": [[[NaN, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], [[0, 0, 0, '
            "0], [0, 0, 0, 0], "
            "[0, 0, 0, 0]]]}"
        ),
        "finite numbers",
    ),
    Row(
        "config",
        "`timeout_s = 0.001` (too short for a rendezvous)",
        _sets("timeout_s=0.001"),
        "run.timeout_s = 0.001 is out of bounds",
    ),
    Row(
        "environment",
        "`RRFP_LOG=NOTALEVEL`",
        _sets(),
        "is not a log level",
        env=(("RRFP_LOG", "NOTALEVEL"),),
    ),
    Row(
        "environment",
        "a rank started by hand with `WORLD_SIZE=abc`",
        _hand(),
        "WORLD_SIZE='abc' is not an integer",
        env=(("WORLD_SIZE", "abc"),),
    ),
    Row(
        "environment",
        "a rank started by hand with `MASTER_PORT=notaport`",
        _hand(),
        "MASTER_PORT='notaport' is not an integer",
        env=(("MASTER_PORT", "notaport"),),
    ),
    Row(
        "environment",
        "a rank started by hand with `RANK=3 WORLD_SIZE=2`",
        _hand(),
        "RANK=3 is outside WORLD_SIZE=2",
        env=(("RANK", "3"),),
    ),
    Row("CLI", "no `--config`", lambda tmp: ["train"], "--config"),
    Row(
        "CLI",
        "an unknown flag",
        lambda tmp: ["train", *SMALL, "--bogus"],
        "unrecognized arguments: --bogus",
    ),
    Row("CLI", "no command", lambda tmp: [], "the following arguments are required: command"),
    Row("CLI", "`rrfp sim --pp 0`", lambda tmp: ["sim", "--pp", "0"], "--pp must be >= 1"),
    Row("CLI", "`rrfp train` outside torchrun", lambda tmp: ["train", *SMALL], "torchrun"),
    Row(
        "CLI",
        "`rrfp sim --pp 100000 --n-microbatches 100000`",
        lambda tmp: ["sim", "--pp", "100000", "--n-microbatches", "100000"],
        "rrfp sim takes at most",
    ),
    Row(
        "CLI",
        "`rrfp sim --cost` without `--replay`",
        lambda tmp: ["sim", "--cost", "c.json"],
        "goes with --replay",
    ),
    Row(
        "CLI",
        "`rrfp sim --json` below a file",
        _below_a_file("--json", "r.json"),
        "is a file, not a folder",
    ),
    Row(
        "CLI",
        "`rrfp plot` of a file that is not JSON",
        lambda tmp: ["plot", CONFIG],
        "not a Chrome trace",
    ),
    Row(
        "checkpoint",
        "`--resume` with no checkpoint",
        lambda tmp: [
            "train",
            *SMALL,
            "--set",
            f"checkpoint.dir={tmp / 'empty'}",
            "--resume",
            "--dry-run",
        ],
        "no complete checkpoint",
    ),
    Row(
        "checkpoint",
        "a fresh run into a directory with checkpoints",
        _resume(),
        "already holds checkpoints",
    ),
    Row(
        "checkpoint",
        "a checkpoint of another layout",
        _resume("resume=auto", "pp=1", "tp=2"),
        "saved with a different config",
    ),
    Row(
        "checkpoint",
        "a checkpoint already at `run.steps`",
        _resume("resume=auto", "steps=2"),
        "nothing left",
    ),
    Row(
        "checkpoint",
        "`meta.json` is `[]`",
        _resume("resume=auto", prepare=_meta([])),
        "not an rrfp checkpoint",
    ),
    Row(
        "checkpoint",
        '`meta.json` is `{"config": []}`',
        _resume("resume=auto", prepare=_meta({"config": []})),
        "not an rrfp checkpoint",
    ),
    Row(
        "checkpoint",
        'a flipped byte in a shard, `on_corrupt_checkpoint = "stop"`',
        _resume("resume=auto", "checkpoint.on_corrupt=stop", prepare=_flip("__0_0.distcp")),
        "__0_0.distcp does not match its SHA-256",
    ),
    Row(
        "checkpoint",
        "a flipped byte in `.metadata`, nothing older to fall back to",
        _resume("resume=auto", prepare=_flip(".metadata")),
        "no checkpoint in",
    ),
    Row(
        "checkpoint",
        "a commit record without checksums (older rrfp)",
        _resume("resume=auto", prepare=lambda c: (c / "COMMITTED").write_text("step 2\n")),
        "holds no checksums",
    ),
    Row(
        "checkpoint",
        "`COMMITTED` sealed over a body of `[]`",
        _resume("resume=auto", prepare=_sealed("[]")),
        "COMMITTED lists no files",
    ),
    Row(
        "checkpoint",
        "`COMMITTED` sealed over a body without `files`",
        _resume("resume=auto", prepare=_sealed('{"step": 2}')),
        "COMMITTED lists no files",
    ),
    Row(
        "checkpoint",
        "`step-2` copied as `step-3`, nothing older to fall back to",
        _resume("resume=auto", prepare=lambda c: c.rename(c.parent / "step-00000003")),
        "not of step 3 as its folder's name says",
    ),
    Row("header", "bad magic", _header(_put(0, 0x1234)), "bad header magic"),
    Row(
        "header",
        "a flipped dim (checksum not resealed)",
        _header(_put(8, 3), seal=False),
        "checksum mismatch",
    ),
    Row("header", "8 tensors of 2^40 float64 elements each", _header(_huge), "bytes in all"),
    Row("header", "an unknown dtype code", _header(_put(6, 99)), "unknown dtype code 99"),
    Row("header", "more tensors than a header holds", _header(_put(5, 9)), "claims 9 tensors"),
    Row(
        "header", "an unknown flag bit", _header(_put(14, 2)), "has flags 2"
    ),  # tensor 0's flags word
    # ---- one's own data ([data] tokens, text, tokenizer: rrfp/models/token_files.py) ----
    Row("data", "a token file that does not exist", _data("nope.bin", None), "no such file"),
    Row("data", "an empty token file", _data("t.bin", b""), "is empty"),
    Row("data", "a token file of another extension", _data("t.txt", b"\0\1"), "expected a flat"),
    Row("data", "a `.npy` of float32", _data("t.npy", "float32"), "holds float32"),
    Row("data", "a token id over the vocab", _data("t.npy", "int64"), "token id 300 >= model."),
    Row("data", "an empty text file", _data("t.txt", b"", "text"), "no tokens (empty text)"),
    Row(
        "data",
        "a `tokenizer.json` that does not load",
        _data("t.txt", b"some text", "text", tokenizer=b'{"model": 3}'),
        "does not load as a tokenizer.json",
    ),
]


def _launcher_env(row: Row) -> dict[str, str]:
    """A torchrun-like rank 0 of 2 whose rendezvous nobody serves (nothing may join a group),
    with the row's variables over it."""
    env = {} if "outside torchrun" in row.what else rank_vars(0, WORLD, port=9)
    return {**env, **dict(row.env)}


def printed(row: Row, tmp: Path) -> tuple[int, str]:
    """(exit code, what rrfp wrote on stderr, with ``tmp`` written TMP and the directory it ran
    in CWD). A header row: the
    MessageError's text, as the receiving rank's line carries it."""
    if row.kind == "header":
        import torch

        from rrfp.comm.message import MessageError, decode_header

        try:
            decode_header(torch.tensor(row.make(tmp), dtype=torch.int64))
        except MessageError as e:
            return 2, str(e)
        return 0, ""
    res = rrfp_in_process(*row.make(tmp), env=_launcher_env(row))
    code, err = res.returncode, res.stderr
    # the memory this machine has now is no part of the table
    return code, re.sub(
        r"above the \S+ \S+ available",
        "above the N GiB available",
        err.replace(str(tmp), "TMP").replace(os.getcwd(), "CWD"),
    )


def table() -> str:
    lines = ["| kind | malformed input | what rrfp prints (exit 2 unless said) |", "|---|---|---|"]
    for row in ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            code, text = printed(row, Path(tmp))
        exit_note = "" if code == 2 else f" (exit {code})"
        lines.append(f"| {row.kind} | {row.what} | `{text.strip().replace('|', '/')}`{exit_note} |")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.kind}: {r.what}" for r in ROWS])
def test_one_line_no_traceback_exit_2(row, tmp_path):
    code, text = printed(row, tmp_path)
    lines = text.strip().splitlines()
    assert code == row.code, f"exit {code}: {text}"
    assert len(lines) == 1 and "Traceback" not in text, text
    assert row.needle in lines[0], f"{row.needle!r} not in {lines[0]!r}"
    if row.kind != "header":
        assert lines[0].startswith("rrfp: error: " if row.code else "rrfp: warning: "), lines[0]


def test_the_documented_table_is_what_rrfp_prints():
    assert len(ROWS) >= 30
    doc, printed_table = DOC.read_text(), table()  # every row run once
    start = doc.index("| kind |")
    assert doc[start : start + len(printed_table)] == printed_table, (
        "docs/malformed-inputs.md is stale: run "
        "`python tests/app/cli/test_malformed_inputs.py` and paste its table"
    )


# ---- at 4 ranks sharing torchrun's store: one line for the job, every rank exits 2 ----

TORCHRUN_ROWS = [ROWS[3], next(r for r in ROWS if "flipped byte in a shard" in r.what)]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_one_line_per_job_at_four_ranks(tmp_path):
    """The four ranks of one job (pp 2 x dp 2), their store served outside them as torchrun's
    agent serves it: rank 0 prints the one line, every rank exits 2, none with a traceback.
    (Under real torchrun agents: tests/app/job/test_fault_matrix_agents.py's refused rows.)"""
    for i, row in enumerate(TORCHRUN_ROWS):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        argv = [a for a in row.make(tmp) if a != "--dry-run"]
        assert argv[0] == "train"
        job = TrainJob(
            tmp / "job", [*argv[1:], "--set", "pp=2", "--set", "dp=2"], world=4, agent_store=True
        ).finish(150)
        errs = {rank: job.err(rank) for rank in range(4)}
        lines = [ln for text in errs.values() for ln in text.splitlines() if ln.startswith("rrfp:")]
        assert len(lines) == 1 and row.needle in lines[0], (row.what, errs)
        assert lines[0] in errs[0], f"printed by a rank other than 0: {errs}"
        assert not any("Traceback" in text for text in errs.values()), errs
        assert job.codes() == [2, 2, 2, 2], job.tails()


if __name__ == "__main__":
    print(table(), end="")
