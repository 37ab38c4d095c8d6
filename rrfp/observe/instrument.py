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
        executor's ``_detail``: ``decide_s``, ``decided`` (the picking decision's start and end),
        ``returned``, on CPU ``compute``, and ``arrived``, the stamps of the peer's message it
        took as input: ``Message.times``)."""

    def task_sent(self, stage: int, iteration: int, task: Task, times: dict) -> None:
        """The message ``task`` produced has been taken by its peer, after that task's span:
        ``times`` are its stamps (``Message.times``: posted, sent, taken)."""

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
        # a task's span by (stage, iteration, task), for its message's stamps that come after it
        self._task_span: dict[tuple[int, int, str], Span] = {}
        self._sent_early: dict[tuple[int, int, str], dict] = {}  # stamps that came before it

    def task_detail(self, stage, iteration, task, detail) -> None:
        self._detail = detail

    def task(self, stage, iteration, task, start, end) -> None:
        detail, self._detail = self._detail, {}
        if self._task_span and next(iter(self._task_span))[1] != iteration:
            self._task_span.clear()  # an iteration's sends end with it: its spans are complete
        key = (stage, iteration, str(task))
        sent = self._sent_early.pop(key, None)
        span = Span(
            self.process,
            stage,
            str(task),
            start,
            end,
            {"iteration": iteration, **self._where, **detail, **({"sent": sent} if sent else {})},
        )
        self.spans.append(span)
        self._task_span[key] = span

    def task_sent(self, stage, iteration, task, times) -> None:
        key = (stage, iteration, str(task))
        span = self._task_span.get(key)
        if span is None:
            self._sent_early[key] = dict(times)
        else:
            span.args["sent"] = dict(times)

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
