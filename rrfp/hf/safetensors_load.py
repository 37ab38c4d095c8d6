"""Read a stage's tensors, and only those, from a HF safetensors checkpoint.

A checkpoint is one ``.safetensors`` file, or a folder holding ``model.safetensors`` or shards
named by ``model.safetensors.index.json``'s ``weight_map``; shards that hold none of the
stage's tensors are not opened, and of the others only the stage's tensors are read
(safetensors reads a tensor's bytes when it is asked for).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from rrfp.hf.extra import require

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
TIED_SOURCE = {
    "lm_head.weight": "model.embed_tokens.weight"
}  # a tied head is saved as the embedding


def _files_of(path: Path, keys: list[str]) -> dict[Path, list[str]]:
    """Which file holds each key: {file: keys}."""
    if path.is_dir():
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(
                    f"{path / INDEX} is not a safetensors index with a weight_map: {e}"
                ) from None
            out: dict[Path, list[str]] = defaultdict(list)
            for key in keys:
                if key not in weight_map:
                    raise ValueError(f"{path / INDEX} names no file for {key}")
                out[path / weight_map[key]].append(key)
            return dict(out)
        if (path / SINGLE).is_file():
            return {path / SINGLE: keys}
        raise ValueError(f"{path} holds neither {INDEX} nor {SINGLE}")
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    return {path: keys}


def load_stage_tensors(
    module: nn.Module, checkpoint: str | Path, *, tied: bool = False
) -> list[str]:
    """Copy ``module``'s parameters and persistent buffers from the checkpoint, by name (a tied
    ``lm_head.weight`` from the embedding when the checkpoint has no head); returns the keys
    read."""
    safetensors = require("safetensors")
    wanted = module.state_dict(
        keep_vars=True
    )  # parameters and persistent buffers: not rotary inv_freq
    key_of = {name: name for name in wanted}
    path = Path(checkpoint)
    if tied:
        for name, source in TIED_SOURCE.items():
            if name in key_of and not _has_key(path, name):
                key_of[name] = source
    files = _files_of(path, sorted(set(key_of.values())))
    loaded: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        try:
            with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise ValueError(f"{file} has no tensor {key}")
                    loaded[key] = f.get_tensor(key)
        except (OSError, safetensors.SafetensorError) as e:
            raise ValueError(f"cannot read safetensors file {file}: {e}") from None
    with torch.no_grad():
        for name, t in wanted.items():
            src = loaded[key_of[name]]
            if src.shape != t.shape:
                raise ValueError(
                    f"{key_of[name]} in {checkpoint} has shape {tuple(src.shape)}, the stage's "
                    f"{name} {tuple(t.shape)}: the checkpoint is of another config"
                )
            t.copy_(src.to(t.dtype))
    return sorted(loaded)


def _has_key(path: Path, key: str) -> bool:
    if path.is_dir() and (path / INDEX).is_file():
        try:
            return key in json.loads((path / INDEX).read_text()).get("weight_map", {})
        except (OSError, ValueError):
            return False
    file = path / SINGLE if path.is_dir() else path
    if not file.is_file():
        return False
    safetensors = require("safetensors")
    with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
        return key in set(f.keys())
