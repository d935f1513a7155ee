"""``NPUProfiler``: a Lightning profiler on torch_npu's profiler, recording NPU and CPU activity on a schedule.

Lightning's ``PyTorchProfiler`` cannot be reused: it builds ``torch.profiler.profile`` and asserts on that class,
checks the schedule's result against ``torch.profiler.ProfilerAction`` (torch_npu's schedule returns its own enum),
builds its summary from ``profile.events()`` (torch_npu analyses into files instead) and picks CUDA activities.
So this is a plain ``Profiler``: the runtime builds the profile (``Runtime.profiler``: ``torch_npu.profiler`` with
CPU + NPU activities and ``tensorboard_trace_handler``; on the simulated runtime ``torch.profiler`` on the CPU,
with a warning), every Lightning action is a labelled range in the trace, and the schedule advances once per
batch of the stage being run (training batches under ``fit``; validation batches during fit fall into whatever
phase the schedule is in).

Traces go to ``dirpath``, by default ``<trainer.log_dir>/profiler`` (the logger's version folder, or
``default_root_dir`` without a logger); torch_npu writes one ``<host>_<pid>_<time>_ascend_pt`` folder per
recorded window, which MindStudio Insight and TensorBoard (torch-tb-profiler) open.

Lightning resolves ``Trainer(profiler="<name>")`` from a dict inside ``trainer/setup.py::_init_profiler``, so no
name can be registered: pass ``Trainer(profiler=NPUProfiler(active=3))``, or in a LightningCLI YAML::

    trainer:
      profiler:
        class_path: lightning_npu.NPUProfiler
        init_args: {wait: 1, warmup: 1, active: 3}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from lightning.pytorch.profilers import Profiler
from torch.autograd.profiler import record_function

from lightning_npu.runtime import get_runtime

#: The Lightning action whose end is one schedule step, per trainer stage (``trainer.state.fn``).
STEP_ACTIONS = {"fit": "training_step", "validate": "validation_step", "test": "test_step", "predict": "predict_step"}
TRACE_FOLDER = "profiler"


class NPUProfiler(Profiler):
    """NPU and CPU activity through torch_npu's profiler: ``active`` batches after ``wait`` + ``warmup``, ``repeat`` times."""

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        """
        Args:
            dirpath: folder for the traces (default: ``<trainer.log_dir>/profiler``).
            wait: batches to skip before each recording window.
            warmup: batches profiled but discarded before each window, so tracing start-up is not in it.
            active: batches recorded in each window.
            repeat: number of windows; 0 records windows until the run ends.
            record_shapes: record operator input shapes.
            profile_memory: record tensor allocations and frees.
            with_stack: record Python call stacks of operators.
        """
        super().__init__(dirpath=dirpath)
        self._session: Any = None
        self._ranges: dict[str, record_function] = {}
        self._step_action: Optional[str] = STEP_ACTIONS["fit"]  # the stage's step action, set by setup()
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(
                    f"NPUProfiler({name}={value!r}): {name} counts batches and must be an int >= {least}"
                    f" (torch_npu would silently reset it); e.g. NPUProfiler(wait=1, warmup=1, active=3)"
                )
        self._schedule = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat}
        self._options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}

    @property
    def trace_dir(self) -> str:
        return str(self.dirpath) if self.dirpath is not None else TRACE_FOLDER

    def setup(self, stage: str, local_rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        """Start profiling a stage (the Trainer calls this once per ``fit`` / ``validate`` / ... run)."""
        super().setup(stage, local_rank, log_dir=os.path.join(log_dir, TRACE_FOLDER) if log_dir else None)
        self._step_action = STEP_ACTIONS.get(stage or "fit")
        self._stop_session()  # a run that ended in an exception never tore down
        # Built here, not at the first action: Lightning profiles actions before setup, when log_dir is unknown.
        self._session = get_runtime().profiler(self.trace_dir, **self._schedule, **self._options)
        self._session.start()

    def start(self, action_name: str) -> None:
        if self._session is not None and action_name not in self._ranges:
            # The same label Lightning's PyTorchProfiler uses, so trace viewers group Lightning's actions alike.
            self._ranges[action_name] = record_function("[pl][profile]" + action_name).__enter__()

    def stop(self, action_name: str) -> None:
        scope = self._ranges.pop(action_name, None)
        if scope is not None:
            scope.__exit__(None, None, None)
        step = self._step_action
        if self._session is not None and step is not None and action_name.endswith(step):
            self._session.step()

    def summary(self) -> str:
        if self._session is None:
            return ""
        return f"NPU profiler traces: {os.path.abspath(self.trace_dir)} (open them in MindStudio Insight or TensorBoard)"

    def teardown(self, stage: Optional[str]) -> None:
        self._stop_session()
        super().teardown(stage)

    def _stop_session(self) -> None:
        for scope in reversed(list(self._ranges.values())):
            scope.__exit__(None, None, None)
        self._ranges = {}
        if self._session is not None:
            session, self._session = self._session, None
            session.stop()  # writes the window being recorded, if any
