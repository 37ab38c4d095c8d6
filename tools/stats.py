"""The house's measures, read from the source (nothing imported): how many modules each folder of
rrfp/ holds, against the most one may hold, and where a setting's default is written other than
in its one declaration, and where a retired word (docs/design.md's vocabulary) is still written.
``make stats`` prints them; tests/house/test_stats.py holds the code to them.

    python tools/stats.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_MODULES = 20  # a folder with more is several ideas: split it into rooms
# each setting's default: the module that declares it, and the name it declares it under
DECLARATIONS = {
    "budget": ("rrfp/core/budget.py", "DEFAULT_BUDGET"),
    "hint": ("rrfp/core/hints.py", "DEFAULT_HINT"),
    "dispatch": ("rrfp/core/policy.py", "DEFAULT_DISPATCH"),
    "timeout": ("rrfp/pipeline/timeouts.py", "DEFAULT_TIMEOUT_S"),
}


def modules_per_folder(root: Path = ROOT) -> dict[str, int]:
    """Each folder of rrfp/ (and below) -> its modules, ``__init__.py`` not counted."""
    counts = {}
    rrfp = root / "rrfp"
    for folder in [rrfp, *sorted(p for p in rrfp.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        counts[str(folder.relative_to(root))] = sum(
            1 for f in folder.glob("*.py") if f.name != "__init__.py"
        )
    return counts


def declared_defaults(root: Path = ROOT) -> dict[str, object]:
    """Each setting -> its declared default's value, as its module writes it (``Dispatch.READY``
    is read through the enum's member)."""
    values = {}
    for setting, (path, name) in DECLARATIONS.items():
        tree = ast.parse((root / path).read_text())
        node = next(
            n.value
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == name for t in n.targets)
        )
        if isinstance(node, ast.Attribute):  # an enum member: its value in the class body
            node = next(
                a.value
                for c in tree.body
                if isinstance(c, ast.ClassDef) and c.name == node.value.id
                for a in c.body
                if isinstance(a, ast.Assign) and a.targets[0].id == node.attr
            )
        values[setting] = ast.literal_eval(node)
    return values


def literal_defaults(source: str) -> list[tuple[int, object]]:
    """Constants written where a default goes: a parameter's default, a class field's value, a
    ``setting(...)``'s first argument, ``getattr``'s fallback, and a default factory's lambda."""
    found = []

    def add(node):
        for sub in ast.walk(node) if isinstance(node, ast.Lambda) else [node]:
            if isinstance(sub, ast.Constant) and not isinstance(sub.value, bool):
                found.append((sub.lineno, sub.value))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    add(d)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    add(stmt.value)
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name == "setting" and node.args:
                add(node.args[0])
            if name == "getattr" and len(node.args) == 3:
                add(node.args[2])
            for kw in node.keywords:
                if kw.arg in ("default_factory", "factory", "default"):
                    add(kw.value)
    return found


def written_defaults(root: Path = ROOT) -> dict[str, list[str]]:
    """Each setting -> where rrfp/ writes its default's value as a literal default, outside the
    module that declares it."""
    declared = declared_defaults(root)
    where: dict[str, list[str]] = {s: [] for s in declared}
    for path in sorted((root / "rrfp").rglob("*.py")):
        rel = str(path.relative_to(root))
        for line, value in literal_defaults(path.read_text()):
            for setting, v in declared.items():
                if value == v and type(value) is type(v) and DECLARATIONS[setting][0] != rel:
                    where[setting].append(f"{rel}:{line}")
    return where


def retired_words(root: Path = ROOT) -> list[str]:
    """The retired words, as docs/design.md's vocabulary lists them: its table's first column."""
    text = (root / "docs" / "design.md").read_text()
    table = text[text.index("| Retired | Say instead |") :].split("\n\n")[0]
    rows = [line.strip() for line in table.splitlines()[2:]]
    return [row.split("`")[1] for row in rows if row.startswith("| `")]


def _bounded(word: str) -> str:
    """``word`` standing alone: not part of a longer name (``\\b`` fails a word that starts with
    ``-`` or ``[``), and a flag not part of a longer flag. The word comes first and the look
    behind it after: a pattern that starts with a literal is searched for as one (a look-behind
    first is tried at every position of the text, 25 times the CPU over rrfp/ and docs/)."""
    edge = r"[\w-]" if word.startswith("-") else r"\w"
    literal = re.escape(word)
    return rf"{literal}(?<!{edge}{literal})(?!{edge})"


def retired_uses(root: Path = ROOT, extra: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Each retired word -> where it is written: rrfp/, docs/ (design.md's own list aside), the
    README, and ``extra`` (a name -> its text, such as the CLI's help)."""
    words = retired_words(root)
    texts = {str(p.relative_to(root)): p.read_text() for p in sorted((root / "rrfp").rglob("*.py"))}
    for p in [*sorted((root / "docs").rglob("*.md")), root / "README.md"]:
        if p.exists():
            texts[str(p.relative_to(root))] = p.read_text()
    design = "docs/design.md"
    if design in texts:  # the list itself names them
        text = texts[design]
        start = text.index("- **Retired words**")
        texts[design] = text[:start] + text[text.index("\n\n", text.index("| Retired |")) :]
    texts.update(extra or {})
    bounded = {w: re.compile(_bounded(w)) for w in words}
    return {w: [name for name, text in texts.items() if bounded[w].search(text)] for w in words}


def report(root: Path = ROOT) -> tuple[list[str], bool]:
    """The lines ``make stats`` prints, and whether every measure is within its limit."""
    counts = modules_per_folder(root)
    over = {f: n for f, n in counts.items() if n > MOST_MODULES}
    lines = [f"modules per folder of rrfp/ (at most {MOST_MODULES}):"]
    lines += [f"  {n:3d}  {f}{'  OVER' if f in over else ''}" for f, n in counts.items()]
    written = written_defaults(root)
    lines.append("each setting's default, written outside its declaration (none is the aim):")
    for setting, places in written.items():
        path, name = DECLARATIONS[setting]
        lines.append(f"  {len(places):3d}  {setting} ({name}, {path}){': ' if places else ''}")
        lines += [f"         {p}" for p in places]
    uses = retired_uses(root)
    lines.append("retired words (docs/design.md's vocabulary) still written (none is the aim):")
    for word, where in uses.items():
        lines.append(f"  {len(where):3d}  {word}{': ' + ', '.join(where) if where else ''}")
    return lines, not over and not any(written.values()) and not any(uses.values())


def main() -> int:
    lines, ok = report()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
