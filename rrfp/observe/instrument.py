"""Observability hooks. The executor reports task spans and waits to an
``Instrument``; nothing is recorded unless one is attached."""

from __future__ import annotations

from rrfp.core.tasks import Task
from rrfp.observe.trace import Span


class Instrument:
    """No-op base: override what you need. Times are ``time.time()`` seconds,
    so spans from ranks on one machine line up."""

    def task(self, stage: int, iteration: int, task: Task, start: float, end: float) -> None:
        pass

    def task_detail(self, stage: int, iteration: int, task: Task, detail: dict) -> None:
        """Called just before ``task`` for the same task: where its host time went (the
        executor's ``_detail``: ``decide_s``, ``returned`` and, on CPU, ``compute``)."""

    def wait(self, stage: int, iteration: int, start: float, end: float, waiting_for: str) -> None:
        pass


class TraceRecorder(Instrument):
    """Keeps every span, for a Chrome trace of real per-rank timings. ``rank`` (virtual stages: a
    rank runs several stages) goes into every span, so each stage's row names its rank."""

    def __init__(self, process: str, rank: int | None = None) -> None:
        self.process = process
        self.spans: list[Span] = []
        self._where = {} if rank is None else {"rank": rank}
        self._detail: dict = {}  # the next task span's extra args

    def task_detail(self, stage, iteration, task, detail) -> None:
        self._detail = detail

    def task(self, stage, iteration, task, start, end) -> None:
        detail, self._detail = self._detail, {}
        self.spans.append(
            Span(
                self.process,
                stage,
                str(task),
                start,
                end,
                {"iteration": iteration, **self._where, **detail},
            )
        )

    def wait(self, stage, iteration, start, end, waiting_for) -> None:
        if end - start > 1e-4:
            self.spans.append(
                Span(
                    self.process,
                    stage,
                    "wait",
                    start,
                    end,
                    {"iteration": iteration, "for": waiting_for, **self._where},
                )
            )
