"""The optional ``rrfp[hf]`` extra, imported on first use with one clear error when it is
missing."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'rrfp[hf]'"


def require(name: str) -> ModuleType:
    """``import name`` (transformers, safetensors, or one of their modules), or an ImportError
    that says how to install the extra."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"rrfp.hf needs {name.split('.')[0]} ({e}): {INSTALL}") from None
