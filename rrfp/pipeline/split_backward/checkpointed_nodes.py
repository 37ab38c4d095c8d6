"""Which autograd nodes belong to a non-reentrant checkpoint's region.

torch.utils.checkpoint(use_reentrant=False) leaves ordinary nodes in the graph and packs their saved
tensors with its own hooks. Under one ``GraphExecGroup`` each such saved tensor may be unpacked
once, so the split's W, which runs its calls in one group, must not run such a node twice. A node's
saved tensors show their unpack hook without being unpacked, so this is read without recomputing
anything.
"""

from __future__ import annotations

_SAVED = "_raw_saved_"
_CHECKPOINT_HOOK = (
    "_checkpoint_hook."  # qualname prefix of torch.utils.checkpoint's pack and unpack hooks
)
_fields: dict[
    type, tuple[str, ...]
] = {}  # node class -> its saved-tensor attributes (dir() is slow)


def is_checkpointed(node) -> bool:
    """Whether a non-reentrant checkpoint holds ``node``'s saved tensor (recomputed on unpack)."""
    fields = _fields.get(type(node))
    if fields is None:
        fields = _fields[type(node)] = tuple(a for a in dir(node) if a.startswith(_SAVED))
    for name in fields:
        saved = getattr(node, name)
        for s in saved if isinstance(saved, (tuple, list)) else (saved,):
            hook = getattr(s, "unpack_hook", None)
            if hook is not None and getattr(hook, "__qualname__", "").startswith(_CHECKPOINT_HOOK):
                return True
    return False
