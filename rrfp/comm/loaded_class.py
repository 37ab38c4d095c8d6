"""A torch class to test ``isinstance`` against, without importing the module that defines it.

An object can only be an instance of a class whose module has been imported, so when that module
is not in ``sys.modules`` nothing is an instance of the class, and ``isinstance(x, ())`` says so.
This lets a rank ask "is this a DTensor / an FSDP module / a PipelineStage?" without paying
for ``torch.distributed.tensor``, ``torch.distributed.fsdp`` or ``torch.distributed.pipelining``
(each pulls in DTensor's op registry, and pipelining pulls in dynamo) when it uses none of them.
"""

from __future__ import annotations

import sys

DTENSOR = ("torch.distributed.tensor", "DTensor")
FSDP_MODULE = ("torch.distributed.fsdp", "FSDPModule")
PIPELINE_STAGE = ("torch.distributed.pipelining.stage", "_PipelineStageBase")


def loaded_class(where: tuple[str, str]) -> type | tuple[()]:
    """The class ``where`` = (module, name) names if its module is imported, else ``()``, which
    ``isinstance`` takes as "no class": every object is then not an instance, correctly so. A
    module still being imported may not define the class yet: no instance of it exists either."""
    module = sys.modules.get(where[0])
    return getattr(module, where[1], ()) if module is not None else ()
