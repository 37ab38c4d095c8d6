"""Finds a workload by name, so adding a model needs no edit to the app.

``gpt`` is ``models.gpt``'s ``workload``; a dotted module (``mypkg.mymodel``)
or ``module:attribute`` names one outside ``models/``. The import happens at
run time, so rrfp never imports ``models`` statically.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from rrfp.app.errors import ConfigError
from rrfp.pipeline.workload import Workload

PACKAGE = "models"


def known() -> list[str]:
    """Workload names under ``models/``."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                  if getattr(importlib.import_module(f"{PACKAGE}.{m.name}"), "workload", None) is not None)


@functools.lru_cache(maxsize=None)
def find_workload(name: str) -> Workload:
    module_name, _, attr = name.partition(":")
    if "." not in module_name:
        module_name = f"{PACKAGE}.{module_name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise ConfigError(f"run.model {name!r}: no module {module_name} (known: {', '.join(known())})") from None
        raise
    found = getattr(module, attr or "workload", None)
    if not isinstance(found, Workload):
        raise ConfigError(f"run.model {name!r}: {module_name} has no Workload named {attr or 'workload'!r}")
    return found
