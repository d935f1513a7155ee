"""The fake ``torch_npu.profiler``: the names and signatures recorded from the 2.13.0 wheel, with its schedule and
trace-ready logic (``scheduler.py``, ``_profiler_action_controller.py``) and no device.

Where torch_npu only prints a warning and silently substitutes a default -- an activity other than CPU/NPU
(``torch.profiler.ProfilerActivity.CUDA``), a schedule that is not callable, a negative schedule count -- the
fake raises instead: the substitution would hide a bug in the caller (a profile of different activities or
steps than asked for). Calls are recorded in ``FakeTorchNPU.calls`` as ``profiler.<name>``; each trace the
handler would write is recorded in ``FakeTorchNPU.traces`` with the steps it covers.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from tests.npu_fake.fake import FakeTorchNPU, _StrictModule


def build_profiler_module(fake: "FakeTorchNPU", module_cls: type["_StrictModule"]) -> "_StrictModule":
    from tests.npu_fake.fake import _unmodelled_class, signature_from_params

    api = fake.api["profiler"]
    mod = module_cls("torch_npu.profiler", fake.release)
    activity = enum.Enum("ProfilerActivity", api["ProfilerActivity"]["members"], module="torch_npu._C._profiler")
    action = enum.Enum("ProfilerAction", api["ProfilerAction"]["members"], module="torch_npu.profiler.scheduler")
    mod.ProfilerActivity = activity
    mod.ProfilerAction = action

    def bind(name: str, params: list[dict[str, Any]], args: tuple, kwargs: dict) -> dict[str, Any]:
        sig = signature_from_params(params)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"torch_npu.profiler.{name}{sig}: {err}") from None
        fake.calls.append((f"profiler.{name}", dict(bound.arguments)))
        bound.apply_defaults()
        return dict(bound.arguments)

    class schedule:
        """``torch_npu.profiler.schedule`` (``Schedule``): the step -> ProfilerAction rule of scheduler.py."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = bind("schedule", api["schedule"]["init_params"], args, kwargs)
            for key, value in options.items():
                least = 1 if key == "active" else 0
                if key != "skip_first_wait" and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                    raise ValueError(
                        f"torch_npu.profiler.schedule({key}={value!r}): torch_npu would warn and reset it"
                        f" (to {least}); pass an int >= {least}"
                    )
            self.__dict__.update(options)

        def __call__(self, step: int) -> Any:
            if step < 0:
                raise ValueError("Invalid parameter step, which must be not less than 0.")
            if step < self.skip_first:
                return action.NONE
            step -= self.skip_first
            if self.skip_first_wait != 0:
                step += self.wait
            cycle = self.wait + self.warmup + self.active
            if self.repeat > 0 and step / cycle >= self.repeat:
                return action.NONE
            mod_step = step % cycle
            if mod_step < self.wait:
                return action.NONE
            if mod_step < self.wait + self.warmup:
                return action.WARMUP
            return action.RECORD if mod_step < cycle - 1 else action.RECORD_AND_SAVE

    def tensorboard_trace_handler(*args: Any, **kwargs: Any) -> Callable[[Any], None]:
        options = bind("tensorboard_trace_handler", api["tensorboard_trace_handler"]["params"], args, kwargs)

        def handler_fn(prof: Any) -> None:
            fake.traces.append({"dir_name": options["dir_name"], "worker_name": options["worker_name"],
                                "steps": list(prof._window)})

        return handler_fn

    profile_entry = api["profile"]
    modelled = {"start", "step", "stop"}

    class profile:
        """``torch_npu.profiler.profile``: start/step/stop drive the schedule; a finished window calls on_trace_ready."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = bind("profile", profile_entry["init_params"], args, kwargs)
            activities = options["activities"]
            if activities is not None:
                wrong = [a for a in activities if not isinstance(a, activity)]
                if wrong:
                    raise TypeError(
                        f"torch_npu.profiler.profile(activities=...): {wrong!r} are not torch_npu.profiler.ProfilerActivity"
                        f" members ({', '.join(activity.__members__)}); torch_npu would warn and profile its defaults"
                    )
            sched = options["schedule"]
            if sched is not None and not callable(sched):
                raise TypeError(f"torch_npu.profiler.profile(schedule={sched!r}): not callable; torch_npu would ignore it")
            ready = options["on_trace_ready"]
            if ready is not None and not callable(ready):
                raise TypeError(f"torch_npu.profiler.profile(on_trace_ready={ready!r}): not callable")
            if options["use_cuda"] is not None:
                raise TypeError("torch_npu.profiler.profile(use_cuda=...): deprecated and ignored on NPUs")
            self.activities = set(activities) if activities else set(activity)
            self.schedule = sched if sched is not None else (lambda _step: action.RECORD)
            self.on_trace_ready = ready
            self.step_num = 0
            self.current_action = self._action(0)
            self.stopped = True
            self._window: list[int] = []

        def _action(self, step: int) -> Any:
            result = self.schedule(step)
            if not isinstance(result, action):
                raise TypeError(f"the schedule returned {result!r}, not a torch_npu.profiler.ProfilerAction")
            return result

        def _transit(self, prev: Any, current: Any) -> None:
            # The entries of ProfActionController's action map that call _trace_ready.
            if prev is action.RECORD_AND_SAVE or (prev is action.RECORD and current is None):
                if self.on_trace_ready is not None:
                    self.on_trace_ready(self)
                self._window = []
            if current in (action.RECORD, action.RECORD_AND_SAVE):
                self._window.append(self.step_num)

        def start(self) -> None:
            self.stopped = False
            self._transit(action.NONE, self.current_action)

        def step(self) -> None:
            if self.stopped:
                return  # torch_npu: "Profiler is stopped, step takes no effect!"
            prev = self.current_action
            self.step_num += 1
            self.current_action = self._action(self.step_num)
            self._transit(prev, self.current_action)

        def stop(self) -> None:
            self._transit(self.current_action, None)
            self.stopped = True

        def __enter__(self) -> "profile":
            self.start()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.stop()

    def _refuse(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"the fake torch_npu records profile.{name} but does not model it")

        return method

    for name in profile_entry["methods"]:
        if name not in modelled:
            setattr(profile, name, _refuse(name))
    profile.__module__ = "torch_npu.profiler.profiler"
    schedule.__module__ = "torch_npu.profiler.scheduler"
    mod.profile = profile
    mod.schedule = schedule
    mod.tensorboard_trace_handler = tensorboard_trace_handler

    for name, entry in api.items():
        if name in vars(mod):
            continue
        qualname = f"profiler.{name}"
        if entry["kind"] == "function":
            setattr(mod, name, fake._callable(qualname, signature_from_params(entry["params"]), None))
        else:
            params = entry.get("init_params")
            setattr(mod, name, _unmodelled_class(fake, qualname, signature_from_params(params) if params else None))
    return mod
