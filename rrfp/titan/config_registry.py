"""torchtitan's config functions, each returning its config with rrfp's schedule: what
``--module rrfp.titan --config NAME`` runs (torchtitan's ConfigManager imports this module and
calls ``getattr(module, NAME)()``).

``NAME`` is a torchtitan config function, e.g. ``llama3_debugmodel``: it is looked up in the
config registry of the model it starts with (``torchtitan.models.<model>.config_registry``), the
longest model name first, so ``qwen3_5_...`` is qwen3_5's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torchtitan.models import _supported_models

from rrfp.titan.config import ReadyTrainerConfig, with_ready_schedule


def _torchtitan_config(name: str) -> Callable | None:
    """torchtitan's config function ``name``, or None."""
    for model in sorted(_supported_models, key=len, reverse=True):
        if name.startswith(f"{model}_"):
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
            fn = getattr(registry, name, None)
            return fn if callable(fn) else None
    return None


def __getattr__(name: str) -> Callable[[], ReadyTrainerConfig]:
    fn = _torchtitan_config(name)
    if fn is None:
        raise AttributeError(
            f"rrfp.titan has no config {name!r}: name one of torchtitan's config functions "
            f"(<model>_<config>, model one of {', '.join(sorted(_supported_models))})"
        )

    def config() -> ReadyTrainerConfig:
        return with_ready_schedule(fn())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name}, stepped by rrfp's ScheduleReady."
    return config
