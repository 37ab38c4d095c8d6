"""Event loop plumbing: loop start-up, completions as futures, the compute lane."""

from rrfp.loop.completions import BlockingWaiter, CompletionPoller, WaiterClosedError
from rrfp.loop.host_memory import keep_freed_memory
from rrfp.loop.lane import ComputeLane, CudaComputeLane, make_lane
from rrfp.loop.startup import new_event_loop, run

__all__ = [
    "BlockingWaiter",
    "CompletionPoller",
    "ComputeLane",
    "CudaComputeLane",
    "WaiterClosedError",
    "keep_freed_memory",
    "make_lane",
    "new_event_loop",
    "run",
]
