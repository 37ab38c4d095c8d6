"""Finds a workload by name, so adding a model needs no edit to the app.

``gpt`` is ``models.gpt``'s ``workload``; a dotted module (``mypkg.mymodel``)
or ``module:attribute`` names one outside ``models/``. The import happens at
run time, so rrfp never imports ``models`` statically.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re

from rrfp.app.errors import ConfigError
from rrfp.pipeline.workload import Workload

PACKAGE = "models"


def known() -> list[str]:
    """Workload names under ``models/``."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        return []
    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if getattr(importlib.import_module(f"{PACKAGE}.{m.name}"), "workload", None) is not None
    )


_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?")


@functools.cache
def find_workload(name: str) -> Workload:
    if not _NAME.fullmatch(name):  # a path or a relative import ("../x", ".gpt") is no module name
        raise ConfigError(
            f"run.model {name!r} is not a workload name: a name under models/ (known: "
            f"{', '.join(known())}), a dotted module, or module:attribute"
        )
    module_name, _, attr = name.partition(":")
    if "." not in module_name:
        module_name = f"{PACKAGE}.{module_name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise ConfigError(
                f"run.model {name!r}: no module {module_name} (known: {', '.join(known())})"
            ) from None
        raise ConfigError(f"run.model {name!r}: importing {module_name} failed: {e}") from None
    except Exception as e:  # the workload's own module is the user's code: its error, in one line
        raise ConfigError(
            f"run.model {name!r}: importing {module_name} failed: {type(e).__name__}: "
            f"{' '.join(str(e).split())}"
        ) from None
    found = getattr(module, attr or "workload", None)
    if not isinstance(found, Workload):
        raise ConfigError(
            f"run.model {name!r}: {module_name} has no Workload named {attr or 'workload'!r}"
        )
    return found
