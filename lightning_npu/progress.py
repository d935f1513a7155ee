"""Progress of a long command for the person waiting on it: each step as it starts and ends, on global rank 0 only.

    with Progress("selftest", total=len(checks)) as progress:
        for check in checks:
            with progress.step(check.name) as step:
                step.outcome = check.run()          # shown at the step's end: "pass", "fail", "12 tensors" ...

    for path in progress_over(files, "load", name=lambda path: path.name):
        load(path)

On a terminal (the stream is a TTY) each finished step stays as one line, and a bar below them redraws in place
(carriage returns) with the count, the elapsed time and the step running now, once a second while a step runs. In
a log or a pipe every start and every end is one plain line, flushed at once::

    selftest [3/31] collectives/all_reduce ...
    selftest [3/31] collectives/all_reduce ... pass 1.2 s

It writes to stderr (the command's results keep stdout), never from a rank other than global rank 0 (of the
process group when there is one, else of ``RANK`` as torchrun sets it), and imports nothing heavy: a command that
shows no progress pays nothing, one that does pays a write per step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional, TextIO, TypeVar

from lightning_npu.facts import env as names

T = TypeVar("T")
#: Seconds between redraws of a terminal's bar while a step runs.
REDRAW_S = 1.0
_BAR_WIDTH = 24
_CLEAR_LINE = "\r\x1b[K"


class Step:
    """One running step; set ``outcome`` (a verdict or a count, in words) to show it at the step's end."""

    def __init__(self, index: int, name: str) -> None:
        self.index, self.name, self.outcome = index, name, "done"
        self.started = time.monotonic()


class Progress:
    """The steps of one command (``total`` of them, None when unknown), titled ``title``; a context manager."""

    def __init__(self, title: str, total: Optional[int] = None, *, stream: Optional[TextIO] = None) -> None:
        self.title, self.total, self.done = title, total, 0
        self.stream = sys.stderr if stream is None else stream
        self.shown = _global_rank() == 0
        self.bar = self.shown and _is_terminal(self.stream)
        self._started = time.monotonic()
        self._current: Optional[Step] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    def __enter__(self) -> "Progress":
        if self.bar:
            self._ticker = threading.Thread(target=self._tick, name="lightning-npu progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        self._write(f"{self.title}: {count} done in {time.monotonic() - self._started:.1f} s", then_bar=False)

    @contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """Show ``name`` as running while the block runs, then its outcome and time ("failed: <error>" if it
        raised)."""
        step = Step(self.done + 1, name)
        self._current = step
        if self.bar:
            self._draw()
        else:
            self._write(f"{self._label(step)} ...")
        try:
            yield step
        except BaseException as error:  # GeneratorExit: a loop over progress_over() that stopped early
            step.outcome = "stopped" if isinstance(error, GeneratorExit) else f"failed: {type(error).__name__}"
            raise
        finally:
            self._current = None
            self.done += 1
            self._write(f"{self._label(step)} ... {step.outcome} {time.monotonic() - step.started:.1f} s")

    def _label(self, step: Step) -> str:
        return f"{self.title} [{step.index}/{self.total if self.total is not None else '?'}] {step.name}"

    def _write(self, line: str, then_bar: bool = True) -> None:
        """``line`` as a line of its own; on a terminal over the bar, redrawn below it unless ``then_bar`` is off."""
        if not self.shown:
            return
        with self._lock:
            self.stream.write(f"{_CLEAR_LINE}{line}\n" if self.bar else f"{line}\n")
            if self.bar and then_bar:
                self.stream.write(self._bar_line())
            self.stream.flush()

    def _draw(self) -> None:
        with self._lock:
            self.stream.write(self._bar_line())
            self.stream.flush()

    def _bar_line(self) -> str:
        current = self._current
        elapsed = f"{time.monotonic() - self._started:.0f} s"
        if self.total:
            filled = _BAR_WIDTH * self.done // self.total
            meter = f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {self.done}/{self.total}"
        else:
            meter = f"{self.done} done"
        return f"{_CLEAR_LINE}{self.title} {meter} {elapsed}" + (f"  {current.name}" if current else "")

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S):
            if self._current is not None:
                self._draw()


def progress_over(items: Iterable[T], title: str, *, name: Callable[[T], str] = str,
                  stream: Optional[TextIO] = None) -> Iterator[T]:
    """Yield each of ``items``, shown as one step from when it is yielded to when the next one is asked for."""
    items = list(items)
    with Progress(title, total=len(items), stream=stream) as progress:
        for item in items:
            with progress.step(name(item)):
                yield item


def _global_rank() -> int:
    # Only a process that imported torch.distributed can be in a process group: no import here for the others.
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return int(os.environ.get(names.RANK, "0"))


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get(names.TERM) != "dumb"
