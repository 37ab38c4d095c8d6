"""What every rank of a job must agree on before it trains: the resolved config key by key, the
model's source, the files the [model] and [data] keys name, and the world it runs in.

Ranks started with different configs (a node given another ``--set``, another file, other data)
would train pieces of different models on different batches, or wait for messages that never
come. ``identity`` is the plain text of each of those, keyed as the config names it, so that a
difference names the key (rrfp/app/job/job_agreement.py compares them across the job).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os

from rrfp.app.config.file_fingerprint import fingerprints
from rrfp.app.config.train_config import TrainConfig

# keys that name this machine's own resources or places, which may differ from node to node
NODE_LOCAL = frozenset({"compute.threads", "data.cache_dir"})
# sections that say what the run reports and where, not what it trains: rank 0's files and lines
# (output.dir, trace, sizes, log_every, peak_tflops) and each rank's log folder
REPORTING = frozenset({"output"})


def identity(cfg: TrainConfig) -> dict[str, str]:
    """``{key: value text}``: every resolved config key (less ``NODE_LOCAL`` and the ``REPORTING``
    sections), ``model.source``
    (a hash of the file that defines the workload), one ``data.KEY FILE`` / ``model.KEY FILE`` per
    file those keys name (its fingerprint), the cost model's hash (``emulation.cost``: ranks that
    planned from other costs would order the microbatches differently), and ``world.size``."""
    out = {
        f"{section}.{key}": json.dumps(value, sort_keys=True, default=str)
        for section, values in cfg.as_toml().items()
        for key, value in values.items()
    }
    out = {k: v for k, v in out.items() if k not in NODE_LOCAL and k.split(".")[0] not in REPORTING}
    out["model.source"] = model_source(cfg)
    out.update(fingerprints({"model": cfg.model, "data": cfg.data}))
    if cfg.emulation.cost is not None:  # the plan and "auto"'s choice come from it: one per job
        digest = hashlib.sha256(cfg.emulation.cost.to_json().encode()).hexdigest()[:16]
        out["emulation.cost"] = f"a cost model, sha256 {digest}"
    out["world.size"] = os.environ.get("WORLD_SIZE", str(cfg.world_size))
    return out


def model_source(cfg: TrainConfig) -> str:
    """The workload's name and the SHA-256 of the file that defines its stages."""
    wl = cfg.workload
    try:
        path = inspect.getsourcefile(wl.build_stage)
        with open(path or "", "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    except (OSError, TypeError):
        return f"{wl.name} (source not found)"
    return f"{wl.name} ({os.path.basename(path)} sha256 {digest})"
