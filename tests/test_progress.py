"""lightning_npu.progress: plain lines to a log or a pipe, a bar redrawn in place on a terminal, nothing from a rank
other than 0."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading

import pytest

from lightning_npu import progress as progress_module
from lightning_npu.progress import Progress, progress_over
from tests.helpers import REPO


class _Log(io.StringIO):
    """A stream that records what each flush made visible (a reader of a pipe sees no more than that)."""

    def __init__(self, terminal: bool = False) -> None:
        super().__init__()
        self.terminal, self.flushed = terminal, []

    def isatty(self) -> bool:
        return self.terminal

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TERM", raising=False)


def test_a_log_gets_one_flushed_plain_line_at_each_start_and_end():
    """Catches progress that a log shows late (unflushed), garbles with carriage returns, or that omits a step's
    outcome."""
    log = _Log()
    with Progress("selftest", total=2, stream=log) as progress:
        with progress.step("all_reduce") as step:
            assert log.flushed[-1] == "selftest [1/2] all_reduce ...\n"  # shown before the step's work is done
            step.outcome = "pass"
        with progress.step("broadcast"):
            pass
    lines = log.getvalue().splitlines()
    assert lines[0] == "selftest [1/2] all_reduce ..."
    assert lines[1].startswith("selftest [1/2] all_reduce ... pass ") and lines[1].endswith(" s")
    assert lines[2] == "selftest [2/2] broadcast ..."
    assert lines[3].startswith("selftest [2/2] broadcast ... done ")
    assert lines[4].startswith("selftest: 2/2 done in ") and len(lines) == 5
    assert "\r" not in log.getvalue() and log.flushed[-1] == log.getvalue()


def test_a_terminal_gets_a_bar_redrawn_in_place_and_a_line_per_finished_step():
    """Catches a terminal flooded with a line per redraw, a bar without count or current step, and a bar left
    behind on the terminal's last line."""
    tty = _Log(terminal=True)
    with Progress("load", total=4, stream=tty) as progress:
        with progress.step("model-00001.safetensors") as step:
            assert re.search(r"\r\x1b\[Kload \[\.{24}\] 0/4 \d+ s  model-00001\.safetensors$", tty.getvalue())
            step.outcome = "12 tensors"
        assert re.search(r"\r\x1b\[Kload \[#{6}\.{18}\] 1/4 \d+ s$", tty.getvalue())  # between steps: no name
    text = tty.getvalue()
    assert re.search(r"\r\x1b\[Kload \[1/4\] model-00001\.safetensors \.\.\. 12 tensors [\d.]+ s\n", text)
    assert "\n" not in text.partition("12 tensors")[0]  # no line of its own for the step's start
    assert re.search(r"\r\x1b\[Kload: 1/4 done in [\d.]+ s\n$", text)


def test_the_bar_redraws_while_a_long_step_runs(monkeypatch):
    """Catches a terminal whose bar (elapsed time) stands still during a long step, which looks like a hang."""
    monkeypatch.setattr(progress_module, "REDRAW_S", 0.01)
    redrawn = threading.Event()

    class Terminal(_Log):
        def write(self, text: str) -> int:
            written = super().write(text)
            if self.getvalue().count("] 0/1 ") >= 2:  # a second bar for the same running step
                redrawn.set()
            return written

    tty = Terminal(terminal=True)
    with Progress("plan", total=1, stream=tty) as progress:
        with progress.step("replay"):
            assert redrawn.wait(timeout=60), tty.getvalue()


def test_a_step_that_raises_is_shown_failed_and_the_error_propagates():
    log = _Log()
    with pytest.raises(KeyError, match="missing"):
        with Progress("consolidate", total=3, stream=log) as progress:
            with progress.step("optimizer states"):
                raise KeyError("missing")
    lines = log.getvalue().splitlines()
    assert lines[1].startswith("consolidate [1/3] optimizer states ... failed: KeyError ")
    assert lines[2].startswith("consolidate: 1/3 done in ")


def test_progress_over_shows_each_item_until_the_next_is_asked_for_and_an_early_stop():
    log = _Log()
    seen = []
    for name in progress_over(["a.safetensors", "b.safetensors", "c.safetensors"], "load", stream=log):
        seen.append(name)
        assert log.getvalue().splitlines()[-1] == f"load [{len(seen)}/3] {name} ..."
        if name == "b.safetensors":
            break
    lines = log.getvalue().splitlines()
    assert seen == ["a.safetensors", "b.safetensors"]
    assert lines[1].startswith("load [1/3] a.safetensors ... done ")
    assert lines[3].startswith("load [2/3] b.safetensors ... stopped ") and lines[4].startswith("load: 2/3 done")


@pytest.mark.parametrize("rank", ["1", "7"])
def test_a_rank_other_than_zero_prints_nothing(monkeypatch, rank):
    """Catches every rank of a job printing the same progress (8 copies of each line per node)."""
    monkeypatch.setenv("RANK", rank)
    log = _Log(terminal=True)
    with Progress("selftest", total=1, stream=log) as progress:
        with progress.step("all_reduce"):
            pass
    assert log.getvalue() == ""


def test_a_dumb_terminal_gets_plain_lines(monkeypatch):
    monkeypatch.setenv("TERM", "dumb")
    log = _Log(terminal=True)
    with Progress("convert", total=1, stream=log) as progress:
        with progress.step("config.json"):
            pass
    assert "\r" not in log.getvalue() and log.getvalue().startswith("convert [1/1] config.json ...\n")


def test_the_progress_module_imports_neither_torch_nor_lightning():
    """Catches a torch-free command (plan, doctor) made to pay torch's import for its progress lines."""
    code = "import sys, lightning_npu.progress; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]"
