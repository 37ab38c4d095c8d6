"""The ops that dispatch through the split-aware functions' torch-function mode, counted."""

from __future__ import annotations

from rrfp.nn.split_functions import SplitFunctions


def ops_through_the_mode(monkeypatch) -> list:
    """A list that collects every op ``SplitFunctions.__torch_function__`` sees from now on."""
    seen: list = []
    through = SplitFunctions.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return through(self, func, types, args, kwargs)

    monkeypatch.setattr(SplitFunctions, "__torch_function__", counted)
    return seen
