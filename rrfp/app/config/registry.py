"""Finds the workload that ``run.model`` names, the same way in every process of a job.

``run.model`` is one of:

- a built-in name, ``gpt``: the ``workload`` of ``rrfp.models.gpt`` (rrfp's own namespace, so a
  user's ``models`` package beside their config is theirs);
- a module importable from the directory the command runs in, ``mypkg.convnet`` (a bare name
  that is no built-in one, ``convnet``, is ``./convnet.py``), with ``:attr`` for a Workload not
  called ``workload``;
- a file, ``mymodel.py`` or ``path/to/mymodel.py:workload``. A relative path is from the directory
  the command runs in, as every other path of a config is (``data.tokens``, ``checkpoint.dir``).

The directory the command runs in goes first on ``sys.path``, where ``python -m`` puts it, so the
``rrfp`` script (the launcher, ``--dry-run``, ``rrfp calibrate``, ``rrfp bench``) and the ranks
that torchrun starts (``python -m rrfp``) import the same module from the same file. A file is
imported under its own name (``mymodel``), as Python imports a module beside a script.

A name that finds nothing is one ConfigError saying where it looked, what is close, and how to
name a model; a module whose import raises is the user's error, one line with their file and
line. The import happens at run time, so no other part of rrfp imports
``rrfp.models`` statically.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

from rrfp.app.errors import ConfigError
from rrfp.pipeline.workload import Workload

PACKAGE = "rrfp.models"
ATTR = "workload"
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_ATTR = re.compile(r"[A-Za-z_]\w*")
_RRFP = Path(__file__).resolve().parents[2]  # rrfp/: frames there are rrfp's, not the user's


def known() -> list[str]:
    """The built-in workload names: the modules of ``rrfp.models`` that hold a ``workload``
    (one whose import fails, e.g. for want of an optional package, is left out)."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        return []
    names = []
    for m in pkgutil.iter_modules(pkg.__path__):
        try:
            module = importlib.import_module(f"{PACKAGE}.{m.name}")
        except Exception:  # noqa: BLE001 - a list of names must not fail on one module
            continue
        if isinstance(getattr(module, ATTR, None), Workload):
            names.append(m.name)
    return sorted(names)


@dataclass(frozen=True)
class _Target:
    """What a ``run.model`` names: a file (absolute) or a module, and the attribute."""

    name: str  # as written
    attr: str
    file: Path | None = None
    module: str = ""
    cwd: str = ""  # a module's: where it was looked for


def find_workload(name: str, config: str | Path | None = None) -> Workload:
    """The Workload ``name`` names (module docstring). ``config``: the file that named it, for a
    message when a relative path is not found from the working directory but is from there."""
    _on_path(os.getcwd())
    return _load(_parse(name, config))


def _parse(name: str, config: str | Path | None) -> _Target:
    head, colon, attr = name.rpartition(":")
    if not colon:
        head, attr = name, ""
    elif not _ATTR.fullmatch(attr):
        raise ConfigError(
            f"run.model {name!r}: after ':' comes the name of the module's Workload "
            f"(path/to/model.py:{ATTR}, mypkg.model:{ATTR})"
        )
    attr = attr or ATTR
    cwd = os.getcwd()
    if head.endswith(".py") or "/" in head or os.sep in head:
        return _Target(name, attr, file=_file(name, head, cwd, config))
    if not _MODULE.fullmatch(head):  # a relative import (".gpt"), an empty name, a stray character
        raise ConfigError(
            f"run.model {name!r} names no workload{_guess(head, cwd)}: {_how_to_name()}"
        )
    if "." not in head and _is_builtin(head):
        head = f"{PACKAGE}.{head}"
    return _Target(name, attr, module=head, cwd=cwd)


def _file(name: str, head: str, cwd: str, config: str | Path | None) -> Path:
    path = Path(cwd, head).resolve()  # an absolute head stays itself
    if path.suffix != ".py":
        also = f" (did you mean {head}.py?)" if path.with_suffix(".py").is_file() else ""
        raise ConfigError(
            f"run.model {name!r}: a path names a Python file, ending in .py{also}; "
            f"a module is named with dots (mypkg.model)"
        )
    if path.is_file():
        return path
    relative = not Path(head).is_absolute()
    where = f"no file {head} in {cwd}, where the command runs" if relative else f"no file {head}"
    near = Path(config).resolve().parent / head if config and relative else None
    if near is not None and near.is_file():
        hint = (
            f"; {near} is beside the config, but a relative run.model is from the directory the "
            f"command runs in: write {os.path.relpath(near, cwd)}"
        )
    else:
        hint = _did_you_mean(path.name, _py_files(path.parent, Path(cwd) if relative else None))
    raise ConfigError(f"run.model {name!r}: {where}{hint}")


def _py_files(folder: Path, cwd: Path | None) -> dict[str, str]:
    """The .py files in ``folder`` and one folder down, by name: how to write each (relative to
    ``cwd`` where given, else absolute)."""
    found: dict[str, str] = {}
    for path in sorted([*folder.glob("*.py"), *folder.glob("*/*.py")]):
        shown = os.path.relpath(path, cwd) if cwd is not None else str(path)
        found.setdefault(path.name, shown)
    return found


def _did_you_mean(word: str, found: dict[str, str]) -> str:
    """`` (did you mean X?)``: ``found`` maps a candidate to how to write it; the candidate that
    is ``word`` itself (a module one folder down) first, else the closest."""
    close = (
        [word] if word in found else difflib.get_close_matches(word, list(found), n=1, cutoff=0.6)
    )
    return f" (did you mean {found[close[0]]}?)" if close else ""


def _is_builtin(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{PACKAGE}.{name}") is not None
    except ImportError:  # no models package
        return False


def _on_path(cwd: str) -> None:
    """The working directory first on sys.path, as ``python -m`` puts it (the ranks')."""
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


@functools.cache
def _load(target: _Target) -> Workload:
    if target.file is not None:
        module = _import_file(target)
        where = str(target.file)
    else:
        module = _import_module(target)
        where = target.module
    found = getattr(module, target.attr, None)
    if not isinstance(found, Workload):
        have = [k for k, v in vars(module).items() if isinstance(v, Workload)]
        raise ConfigError(
            f"run.model {target.name!r}: {where} has no Workload named {target.attr!r}"
            + (
                f" (it has {', '.join(have)}: write {where}:{have[0]})"
                if have
                else f" (define {target.attr} = rrfp.Workload(...) in it)"
            )
        )
    return found


def _import_file(target: _Target):
    path, module_name = target.file, target.file.stem
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        if origin is not None and Path(origin).resolve() == path:
            return loaded
        raise ConfigError(
            f"run.model {target.name!r}: {path} would be imported as {module_name}, but a "
            f"module of that name is imported already ({origin or 'built in'}): rename the file"
        )
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and typing look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise _raised(target.name, str(path), e) from None
    return module


def _import_module(target: _Target):
    name = target.module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(f"{e.name}.")):
            raise ConfigError(_not_found(target)) from None
        raise _raised(target.name, name, e) from None
    except Exception as e:  # the workload's own module is the user's code: its error, one line
        raise _raised(target.name, name, e) from None


def _not_found(target: _Target) -> str:
    written = target.name.rpartition(":")[0] or target.name
    builtin = (
        f"no built-in model {written} and no module {written}"
        if "." not in written
        else f"no module {target.module}"
    )
    return (
        f"run.model {target.name!r}: {builtin} importable from {target.cwd}, where the command "
        f"runs{_guess(written, target.cwd)}; {_how_to_name()}"
    )


def _how_to_name() -> str:
    return (
        f"run.model is a built-in model ({', '.join(known()) or 'none found'}), a module "
        f"importable from where the command runs (mypkg.model, mypkg.model:{ATTR}) or a .py file "
        "(path/to/model.py, from there too)"
    )


def _guess(word: str, cwd: str) -> str:
    """`` (did you mean X?)`` over the built-in names, the modules in ``cwd`` and one folder
    down (``examples.my_model``, found as ``my_model`` too) and the modules of the longest package
    prefix of ``word``."""
    found: dict[str, str] = {}
    for path in sorted(Path(cwd).glob("*/*.py"), reverse=True):
        if path.stem != "__init__" and _MODULE.fullmatch(path.parent.name):
            dotted = f"{path.parent.name}.{path.stem}"
            found.update({path.parent.name: path.parent.name, dotted: dotted, path.stem: dotted})
    found.update({path.stem: path.stem for path in Path(cwd).glob("*.py")})
    found.update({name: name for name in known()})
    parts = word.split(".")
    for n in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:n])
        try:
            pkg = importlib.import_module(parent)
        except Exception:  # noqa: BLE001 - a guess must not fail: no such package, or its error
            continue
        for m in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
            found[f"{parent}.{m.name}"] = f"{parent}.{m.name}"
        break
    return _did_you_mean(word, found)


def _raised(name: str, what: str, e: Exception) -> ConfigError:
    """The import of the user's module raised: their error as one line, at their file and line."""
    text = " ".join(str(e).split())
    return ConfigError(
        f"run.model {name!r}: importing {what} raised {type(e).__name__}"
        + (f": {text}" if text else "")
        + _user_frame(e)
    )


def _user_frame(e: Exception) -> str:
    """`` (FILE, line N)``: where in the user's code ``e`` was raised (the innermost frame outside
    Python's own, installed packages' and rrfp's files)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f" ({_shown(e.filename)}, line {e.lineno})"
    skip = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    skip.add(str(_RRFP))
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = frame.filename
        if path.startswith("<") or any(path.startswith(s + os.sep) for s in skip if s):
            continue
        return f" ({_shown(path)}, line {frame.lineno})"
    return ""


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
