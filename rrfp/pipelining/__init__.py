"""A drop-in for torch.distributed.pipelining users: ``ScheduleReady`` takes the
``PipelineStage`` a ``Schedule1F1B`` would and runs rrfp's runtime underneath."""

from rrfp.pipelining.schedule import ScheduleReady
from rrfp.pipelining.torch_csv import read_torch_csv

__all__ = ["ScheduleReady", "read_torch_csv"]
