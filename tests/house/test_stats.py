"""The measures ``make stats`` prints (tools/stats.py), held: no folder of rrfp/ holds more than
its share of modules, no setting's default is written outside its one declaration, and no retired
word is written in rrfp/, docs/ or the CLI's help."""

import importlib.util
import re
from pathlib import Path

from harness import ROOT


def _stats():
    """tools/stats.py, loaded by path: it is a tool beside the package, not part of it."""
    spec = importlib.util.spec_from_file_location("rrfp_stats", ROOT / "tools" / "stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATS = _stats()


def tree_with_declarations(tmp_path: Path) -> Path:
    """A scratch rrfp/ holding only the modules that declare the defaults, copied."""
    for path in [*(p for p, _ in STATS.DECLARATIONS.values()), "docs/design.md"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((ROOT / path).read_text())
    return tmp_path


def test_no_folder_holds_more_than_its_share_of_modules(tmp_path):
    """A folder of rrfp/ with more than ``MOST_MODULES`` modules is several ideas in one room."""
    counts = STATS.modules_per_folder()
    assert counts["rrfp/app/cli"] >= 5 and "rrfp/app/bench" in counts, counts
    over = {f: n for f, n in counts.items() if n > STATS.MOST_MODULES}
    assert not over, f"folders over {STATS.MOST_MODULES} modules: {over}"
    crowded = tree_with_declarations(tmp_path) / "rrfp" / "crowded"  # the check can fail
    crowded.mkdir(parents=True)
    for i in range(STATS.MOST_MODULES + 1):
        (crowded / f"m{i}.py").write_text("")
    (crowded / "__init__.py").write_text("")
    lines, ok = STATS.report(tmp_path)
    assert not ok and any("rrfp/crowded  OVER" in line for line in lines), lines


def test_no_literal_stands_in_for_a_declared_default():
    assert {k: v for k, v in STATS.written_defaults().items() if v} == {}


def test_the_declarations_are_read_as_written():
    from rrfp.core.budget import DEFAULT_BUDGET
    from rrfp.core.hints import DEFAULT_HINT
    from rrfp.core.policy import DEFAULT_DISPATCH

    assert STATS.declared_defaults() == {
        "budget": DEFAULT_BUDGET,
        "hint": DEFAULT_HINT,
        "dispatch": DEFAULT_DISPATCH.value,
        "timeout": 60.0,
    }


def test_the_literal_search_can_fail(tmp_path):
    src = (
        "def f(budget='2x', *, timeout_s=60.0): pass\n"
        "class C:\n    hint: str = 'bfw'\n    b: B = field(default_factory=lambda: parse('2x'))\n"
        "x = getattr(p, 'rrfp_dispatch', 'ready')\ny = setting(60.0, 'doc')\n"
    )
    values = [v for _, v in STATS.literal_defaults(src)]
    assert values.count("2x") == 2 and values.count(60.0) == 2
    assert "bfw" in values and "ready" in values
    tree_with_declarations(tmp_path)  # a tree whose one stray default is reported
    (tmp_path / "rrfp" / "stray.py").write_text("def f(hint='bfw'): pass\n")
    assert STATS.written_defaults(tmp_path)["hint"] == ["rrfp/stray.py:1"]
    lines, ok = STATS.report(tmp_path)
    assert not ok and "         rrfp/stray.py:1" in lines


def cli_help() -> str:
    """The help of ``rrfp`` and of each of its commands, as a user reads it."""
    import argparse

    from rrfp.app.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return "\n".join([parser.format_help(), *(p.format_help() for p in sub.choices.values())])


def test_no_retired_word_is_written():
    words = STATS.retired_words()
    assert {"ExecutorSettings", "peer_timeout_s"} <= set(words), words
    help_text = cli_help()
    assert "--dispatch" in help_text and "--budget" in help_text  # every command's help is read
    uses = STATS.retired_uses(extra={"rrfp --help": help_text})
    assert {w: where for w, where in uses.items() if where} == {}


def test_the_retired_word_search_can_fail(tmp_path):
    tree_with_declarations(tmp_path)
    (tmp_path / "rrfp" / "old.py").write_text("from x import ExecutorSettings\n")
    uses = STATS.retired_uses(tmp_path, extra={"help": "--peer_timeout_s S"})
    assert uses["ExecutorSettings"] == ["rrfp/old.py"] and uses["peer_timeout_s"] == ["help"]
    # a bracketed word and a flag are found where they stand alone, not inside longer ones
    assert re.search(STATS._bounded("[runtime]"), "write [runtime] here")
    assert not re.search(STATS._bounded("RuntimeSection"), "OldRuntimeSection")
    assert re.search(STATS._bounded("--mb"), "rrfp sim --mb 8")
    assert not re.search(STATS._bounded("--mb"), "rrfp sim --mb-size 8 ---mb")
    assert not STATS.report(tmp_path)[1]
