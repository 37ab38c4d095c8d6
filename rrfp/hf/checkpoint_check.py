"""A HF safetensors checkpoint checked against the model before any stage reads it: every tensor
the model holds is in the checkpoint's files with the model's shape, and each file's header reads.

Only headers are read (safetensors checks that a header covers its file, so a file cut short is
caught too), no tensor's bytes: ``rrfp train`` runs it before any process group, so a broken or
missing checkpoint is one line and exit 2 rather than a failure of a stage being built.
"""

from __future__ import annotations

from pathlib import Path

from rrfp.hf.build import _meta_model, _tied
from rrfp.hf.extra import require
from rrfp.hf.safetensors_load import TIED_SOURCE, _files_of, _has_key


def check_hf_checkpoint(config, checkpoint: str | Path) -> None:
    """ValueError naming the file and the tensor when ``checkpoint`` (a file, or a folder with
    ``model.safetensors`` or a sharded index) cannot start the model ``config`` describes."""
    safetensors = require("safetensors")
    shapes = {k: tuple(v.shape) for k, v in _meta_model(config, None, False).state_dict().items()}
    path = Path(checkpoint)
    reading = path  # the file being read, for the line
    try:
        key_of = {name: name for name in shapes}
        if _tied(config):  # a tied head is saved as the embedding
            for name, source in TIED_SOURCE.items():
                if name in key_of and not _has_key(path, name):
                    key_of[name] = source
        files = _files_of(path, sorted(set(key_of.values())))
        found: dict[str, tuple] = {}
        for reading, keys in files.items():
            if not reading.is_file():
                raise ValueError(f"{reading}, the file it names for {keys[0]}, does not exist")
            with safetensors.safe_open(str(reading), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise ValueError(f"{reading} has no tensor {key}")
                    found[key] = tuple(f.get_slice(key).get_shape())
    except (OSError, safetensors.SafetensorError) as e:
        raise ValueError(f"cannot read safetensors file {reading}: {e}") from None
    for name, shape in shapes.items():
        if found[key_of[name]] != shape:
            raise ValueError(
                f"{key_of[name]} has shape {found[key_of[name]]}, the model's {name} {shape}: "
                "the checkpoint is of another config"
            )
