"""A strict, CPU-only stand-in for torch_npu, checked against the API recorded from the real wheels.

``install_fake_torch_npu(monkeypatch, release="2.13.0")`` puts a ``torch_npu`` module (with ``torch_npu.npu``,
``torch_npu.npu.amp`` and ``torch_npu.profiler``, the latter built in profiler.py) into ``sys.modules`` and sets ``torch.npu`` to the fake ``npu`` module; monkeypatch
undoes both. Strictness is the point: code under test may only touch names recorded for that release in
``torch_npu_<release>_api.json`` (written by ``tools/extract_torch_npu_api.py``; ``RELEASES`` lists them), else
``AttributeError``; every call is bound against the recorded signature, else ``TypeError``; every call is
recorded in ``FakeTorchNPU.calls`` as ``(name, explicitly_passed_arguments)``. Recorded names whose behaviour
the fake does not model raise ``NotImplementedError`` when called, so a test can never pass on an invented result.
A fused op the wheel registers no autograd node for (the record's ``autograd_node`` is None) returns outputs
without a grad_fn, as the real one trains nothing when called directly.

The runtime functions follow the Python sources (``torch_npu/npu/{__init__,utils,memory,random}.py``, the same
in 2.6.0 .. 2.14.0 for what is modelled): ``device_count`` honours ``ASCEND_RT_VISIBLE_DEVICES``, ``memory_stats``
is empty until the device is initialised, ``set_per_process_memory_fraction`` rejects non-floats, and
``is_bf16_supported`` initialises the device and answers from the chip's SocVersion (settable per test, with the
chip name). Device memory cannot be observed on CPU, so tests drive it with ``FakeTorchNPU.simulate_alloc`` /
``simulate_free``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tests.npu_fake import ops
from tests.npu_fake.hccl import install_hccl_batch_send_recv
from tests.npu_fake.profiler import build_profiler_module

API_DIR = Path(__file__).parent
#: The torch_npu releases whose API is recorded here (tools/extract_torch_npu_api.py), oldest first.
RELEASES = tuple(
    sorted(
        (p.name[len("torch_npu_"):-len("_api.json")].replace("_", ".") for p in API_DIR.glob("torch_npu_*_api.json")),
        key=lambda v: tuple(int(x) for x in v.split(".")),
    )
)
DEFAULT_RELEASE = "2.13.0"
GiB = 1024**3
#: torch_npu's chip names and their ``c10_npu::SocVersion`` numbers (NpuVariables.h / NpuVariables.cpp's name map,
#: 2.13.0 wheel). ``IsBF16Supported()`` is ``GetSocVersion() >= SocVersion::Ascend910B1`` (220).
SOC_VERSIONS = {
    "Ascend910PremiumA": 100, "Ascend910ProA": 101, "Ascend910A": 102, "Ascend910ProB": 103, "Ascend910B": 104,
    "Ascend310P1": 200, "Ascend310P2": 201, "Ascend310P3": 202, "Ascend310P4": 203, "Ascend310P5": 204,
    "Ascend310P7": 205,
    "Ascend910B1": 220, "Ascend910B2": 221, "Ascend910B2C": 222, "Ascend910B3": 223, "Ascend910B4": 224,
    "Ascend910B4-1": 225,
    "Ascend310B1": 240, "Ascend310B2": 241, "Ascend310B3": 242, "Ascend310B4": 243,
    "Ascend910_9391": 250, "Ascend910_9392": 251, "Ascend910_9381": 252, "Ascend910_9382": 253,
    "Ascend910_9372": 254, "Ascend910_9362": 255, "Ascend910_9363": 256,
    "Ascend950": 260,
}
_BF16_FIRST_SOC = SOC_VERSIONS["Ascend910B1"]
# Reservations are rounded up to whole 2 MiB blocks, like the caching allocator's large pool.
_BLOCK = 2 * 1024**2


def api_path(release: str = DEFAULT_RELEASE) -> Path:
    return API_DIR / f"torch_npu_{release.replace('.', '_')}_api.json"


@functools.lru_cache(maxsize=None)
def load_api(release: str = DEFAULT_RELEASE) -> dict[str, Any]:
    """The recorded API of torch_npu ``release`` (see tools/extract_torch_npu_api.py)."""
    path = api_path(release)
    if not path.is_file():
        raise ValueError(f"no recorded API for torch_npu {release}; recorded releases: {', '.join(RELEASES)}")
    return json.loads(path.read_text(encoding="utf-8"))


def soc_bf16_supported(device_name: str) -> bool:
    """``torch.npu.is_bf16_supported()`` on the chip ``device_name``: SocVersion >= Ascend910B1.

    torch_npu refuses to initialise on a name outside its map ("Unsupported soc version"); the fake needs a
    test to say what such a chip supports.
    """
    if device_name not in SOC_VERSIONS:
        raise ValueError(
            f"{device_name!r} is not one of torch_npu's SocVersion names; pass bf16_supported= for it explicitly"
        )
    return SOC_VERSIONS[device_name] >= _BF16_FIRST_SOC


class _SourceDefault:
    """A default that is not a literal (``torch.float16``); shown as its source text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature_from_params(params: list[dict[str, Any]]) -> inspect.Signature:
    """Build an ``inspect.Signature`` from the JSON parameter records."""
    out = []
    for p in params:
        if "default" in p:
            default = p["default"]
        elif "default_expr" in p:
            default = _SourceDefault(p["default_expr"])
        else:
            default = inspect.Parameter.empty
        out.append(inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]), default=default))
    return inspect.Signature(out)


def ensure_npu_device_type() -> None:
    """Make ``torch.device("npu", i)`` constructible by renaming the PrivateUse1 backend to "npu", and register a
    ``torch.npu`` for the name, as ``import torch_npu`` does (``torch._register_device_module``).

    torch allows the rename once per process and never undoes it, so it is done at most once here. From then on
    torch counts "npu" as the process's accelerator: ``torch.accelerator`` (and PEFT, torch.utils.checkpoint through
    it) asks ``torch.npu``, so one must stay registered after a fake test has uninstalled the fake. Between fake tests
    it is ``_NO_TORCH_NPU``, which answers ``torch.accelerator.is_available()`` and ``device_count()`` as a process
    without torch_npu does: no accelerator, no device.
    Do not run it in a process that later uses ``dist.barrier`` or DCP on CPU (gloo): multi-process
    tests run in subprocesses, which never install the fake.
    """
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")
    elif name != "npu":
        raise RuntimeError(f"PrivateUse1 is already renamed to {name!r}; the fake torch_npu needs it as 'npu'")
    if getattr(torch, "npu", None) is None:
        torch._register_device_module("npu", _NO_TORCH_NPU)


class _NoTorchNPU(types.ModuleType):
    """``torch.npu`` while no fake is installed: no device, and nothing else (a call meant for the fake fails)."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            f"torch.npu.{attr}: no torch_npu in this process (the strict fake renamed PrivateUse1 to 'npu' for good;"
            " install_fake_torch_npu installs the fake torch.npu for a test)"
        )

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


_NO_TORCH_NPU = _NoTorchNPU("torch.npu")


class _StrictModule(types.ModuleType):
    """A module whose unknown attributes raise AttributeError naming the recorded API."""

    def __init__(self, name: str, release: str) -> None:
        super().__init__(name)
        self._release = release

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__") or attr == "_release":
            raise AttributeError(attr)
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {attr!r} in torch_npu {self._release} "
            f"(recorded API: {api_path(self._release).name})"
        )


class _StrictSettings:
    """``torch.npu.config`` / ``matmul`` / ``conv``: only the recorded attribute names may be set or read.

    ``config.allow_internal_format`` is write-only in torch_npu (its class defines only ``__setattr__``),
    so reading it raises here as well.
    """

    def __init__(self, fake: "FakeTorchNPU", name: str, settable: list[str], gettable: list[str]) -> None:
        object.__setattr__(self, "_fake", fake)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_settable", set(settable))
        object.__setattr__(self, "_gettable", set(gettable))

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr not in self._settable:
            raise AttributeError(
                f"torch.npu.{self._name}.{attr} cannot be set in torch_npu {self._fake.release}; settable: {sorted(self._settable)}"
            )
        if attr == "allow_hf32" and not isinstance(value, bool):
            raise TypeError(f"allow_hf32 must be a bool, but got {type(value).__name__}")
        self._fake.calls.append((f"npu.{self._name}.{attr}", {"value": value}))
        self._fake.settings[f"{self._name}.{attr}"] = value

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr not in self._gettable:
            raise AttributeError(
                f"torch.npu.{self._name}.{attr} cannot be read in torch_npu {self._fake.release}; readable: {sorted(self._gettable)}"
            )
        return self._fake.settings.get(f"{self._name}.{attr}")


class FakeTorchNPU:
    """State and behaviour of the fake. ``torch_npu`` and ``npu`` are the module objects code sees."""

    def __init__(
        self,
        *,
        device_count: int = 8,
        device_name: str = "Ascend910B2",
        bf16_supported: Optional[bool] = None,
        total_memory: int = 64 * GiB,
        release: str = DEFAULT_RELEASE,
        cann_version: Optional[str] = None,
    ) -> None:
        self.release = release
        #: The CANN the fused ops run on ("8.1.RC1"), for rules that changed with CANN; None: a current one.
        self.cann_version = cann_version
        self.api = load_api(release)
        self.raw_device_count = device_count
        self.device_name = device_name
        # By default the chip's SocVersion decides, as in torch_npu; a test may override it (e.g. an unknown chip).
        self.bf16_supported = soc_bf16_supported(device_name) if bf16_supported is None else bf16_supported
        self.total_memory = total_memory
        self.calls: list[tuple[str, dict[str, Any]]] = []
        #: One entry per trace torch_npu.profiler's tensorboard_trace_handler would write (see profiler.py).
        self.traces: list[dict[str, Any]] = []
        # torch_npu's defaults when the options were never set (npu/npu_config.py).
        self.settings: dict[str, Any] = {"matmul.allow_hf32": False, "matmul.cube_math_type": None, "conv.allow_hf32": True}
        self.initialized = False
        self.current = 0
        self._cached_count: Optional[int] = None
        self._mem: dict[int, dict[str, int]] = collections.defaultdict(_empty_memory)
        self._fraction: dict[int, float] = {}
        self._generators: dict[int, torch.Generator] = {}
        self.runtime = _Runtime(self)
        self.npu = self._build_npu_module()
        self.torch_npu = self._build_torch_npu_module()

    # ---------------------------------------------------------------- what tests use

    def calls_to(self, name: str) -> list[dict[str, Any]]:
        """Arguments of every recorded call to ``name`` (e.g. ``"npu_fusion_attention"``, ``"npu.set_device"``)."""
        return [args for called, args in self.calls if called == name]

    def simulate_alloc(self, nbytes: int, device: Optional[int] = None) -> None:
        """Pretend tensors of ``nbytes`` were allocated on ``device`` (default: current); initialises the device.

        Raises RuntimeError (like the allocator's OOM) if reserved memory would exceed the device's
        total memory times its per-process memory fraction.
        """
        self.initialized = True
        idx = self.current if device is None else device
        mem = self._mem[idx]
        allocated = mem["allocated"] + nbytes
        reserved = max(mem["reserved"], -(-allocated // _BLOCK) * _BLOCK)
        limit = int(self.total_memory * self._fraction.get(idx, 1.0))
        if reserved > limit:
            mem["num_ooms"] += 1
            raise RuntimeError(
                f"NPU out of memory. Tried to allocate {nbytes} bytes on npu:{idx} "
                f"({mem['allocated']} allocated, limit {limit} bytes)"
            )
        mem["allocated"] = allocated
        mem["allocated_total"] += nbytes
        mem["peak_allocated"] = max(mem["peak_allocated"], allocated)
        if reserved > mem["reserved"]:
            mem["reserved_total"] += reserved - mem["reserved"]
        mem["reserved"] = reserved
        mem["peak_reserved"] = max(mem["peak_reserved"], reserved)

    def simulate_free(self, nbytes: int, device: Optional[int] = None) -> None:
        """Pretend ``nbytes`` of tensors were freed; the cache keeps them reserved until empty_cache()."""
        mem = self._mem[self.current if device is None else device]
        if nbytes > mem["allocated"]:
            raise ValueError(f"cannot free {nbytes} bytes: only {mem['allocated']} are allocated")
        mem["allocated"] -= nbytes
        mem["freed_total"] += nbytes

    # ---------------------------------------------------------------- module construction

    def _build_npu_module(self) -> _StrictModule:
        npu = _StrictModule("torch_npu.npu", self.release)
        for name, entry in self.api["npu"].items():
            setattr(npu, name, self._member("npu", name, entry))
        amp = _StrictModule("torch_npu.npu.amp", self.release)
        for name, entry in self.api["npu_amp"].items():
            setattr(amp, name, self._member("npu.amp", name, entry))
        npu.amp = amp
        return npu

    def _build_torch_npu_module(self) -> _StrictModule:
        mod = _StrictModule("torch_npu", self.release)
        mod.__version__ = self.api["torch_npu_version"]
        mod.npu = self.npu
        mod.profiler = build_profiler_module(self, _StrictModule)
        for name, entry in self.api["ops"].items():
            sig = signature_from_params(entry["params"])
            types_ = {p["name"]: p["type"] for p in entry["params"]}
            impl = getattr(ops, name)
            if "release" in inspect.signature(impl).parameters:
                # Rules that differ between releases (npu_fusion_attention's varlen limits) are told the release.
                impl = functools.partial(impl, release=self.release)
            if "cann" in inspect.signature(impl).parameters:
                # ... and rules that differ between CANN releases (npu_fusion_attention's Dv < Dk) the CANN version.
                impl = functools.partial(impl, cann=self.cann_version)
            if entry["autograd_node"] is None:
                impl = _without_autograd(impl)
            setattr(mod, name, self._callable(name, sig, impl, types_))
        return mod

    def _member(self, prefix: str, name: str, entry: dict[str, Any]) -> Any:
        qualname = f"{prefix}.{name}"
        kind = entry["kind"]
        if kind == "function":
            impl = getattr(self.runtime, name, None) if prefix == "npu" else None
            return self._callable(qualname, signature_from_params(entry["params"]), impl)
        if kind == "object" and "settable_attributes" in entry:
            return _StrictSettings(self, name, entry["settable_attributes"], entry["gettable_attributes"])
        if kind == "class" and qualname == "npu.device":
            return _device_class(self, signature_from_params(entry["init_params"]))
        if kind == "class" and qualname == "npu.amp.GradScaler":
            return _grad_scaler_class(self, signature_from_params(entry["init_params"]))
        if kind == "class" and entry.get("init_params") is not None:
            return _unmodelled_class(self, qualname, signature_from_params(entry["init_params"]))
        return _unmodelled_class(self, qualname, None)

    def _callable(
        self,
        qualname: str,
        sig: inspect.Signature,
        impl: Optional[Callable[..., Any]],
        types_: Optional[dict[str, str]] = None,
    ) -> Callable[..., Any]:
        fake = self

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{qualname}{sig}: {err}") from None
            if types_:
                for arg, value in bound.arguments.items():
                    _check_schema_type(qualname, arg, types_[arg], value)
            fake.calls.append((qualname, dict(bound.arguments)))
            if impl is None:
                raise NotImplementedError(f"the fake torch_npu records {qualname}{sig} but does not model its behaviour")
            bound.apply_defaults()
            return impl(*bound.args, **bound.kwargs)

        call.__name__ = qualname.rsplit(".", 1)[-1]
        call.__qualname__ = qualname
        call.__signature__ = sig
        return call

    # ---------------------------------------------------------------- device helpers shared by the runtime

    def visible_device_count(self) -> int:
        """``device_count()``: torch_npu 2.13.0's ASCEND_RT_VISIBLE_DEVICES parsing (npu/__init__.py)."""
        if self._cached_count is not None:
            return self._cached_count
        var = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        if var is None:
            count = self.raw_device_count
        else:
            ids = _parse_visible_devices(var)
            count = len(ids)
            for i, dev in enumerate(ids):
                if i > 0 and dev <= ids[i - 1]:
                    count = 0  # the runtime needs strictly ascending ids
                    break
                if dev >= self.raw_device_count:
                    count = i
                    break
        # Like torch_npu, the count is cached only once the device is initialised.
        if self.initialized:
            self._cached_count = count
        return count

    def device_index(self, device: Any, *, optional: bool) -> int:
        """torch_npu's ``_get_device_index``: int as is, str/torch.device of type npu, None -> current."""
        if isinstance(device, bool):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        if isinstance(device, int):
            return device
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "npu":
                raise ValueError(f"Expected a npu device, but got: {device}")
            if device.index is not None:
                return device.index
        elif isinstance(device, self.npu.device):
            return device.idx
        elif device is not None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        if optional:
            return self.current
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")

    def check_range(self, idx: int) -> None:
        if idx < 0 or idx >= self.visible_device_count():
            raise AssertionError(f"Invalid device id {idx}: {self.visible_device_count()} NPUs are visible")

    def generator(self, idx: int) -> torch.Generator:
        if idx not in self._generators:
            self._generators[idx] = torch.Generator()
        return self._generators[idx]


class _Runtime:
    """Behaviour of the modelled ``torch.npu`` functions; parameter names match the recorded signatures."""

    def __init__(self, fake: FakeTorchNPU) -> None:
        self._f = fake

    def _init(self) -> None:
        self._f.initialized = True

    def is_initialized(self) -> bool:
        return self._f.initialized

    def init(self) -> None:
        self._init()

    def is_available(self) -> bool:
        return self._f.visible_device_count() > 0

    def device_count(self) -> int:
        return self._f.visible_device_count()

    def set_device(self, device) -> None:
        idx = self._f.device_index(device, optional=True)
        if idx < 0:
            return
        if idx >= self._f.visible_device_count():
            raise RuntimeError(f"set_device: invalid device id {idx}; {self._f.visible_device_count()} NPUs are visible")
        self._f.current = idx

    def current_device(self) -> int:
        self._init()
        return self._f.current

    def synchronize(self, device=None) -> None:
        self._init()
        idx = self._f.device_index(device, optional=True)
        if idx >= self._f.visible_device_count():
            raise RuntimeError(f"synchronize: invalid device id {idx}")

    def get_device_name(self, device_name=None) -> str:
        self._f.check_range(self._f.device_index(device_name, optional=True))
        # torch_npu returns the *current* device's name whatever index is passed.
        return self._f.device_name

    def is_bf16_supported(self, including_emulation=False) -> bool:
        self._init()
        return self._f.bf16_supported

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        if self.is_bf16_supported():
            return [torch.float16, torch.bfloat16, torch.float32]
        return [torch.float16, torch.float32]

    def utilization(self, device=None) -> int:
        self._f.check_range(self._f.device_index(device, optional=True))
        self._init()
        return 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        if device is None:
            device = self.current_device()
        idx = self._f.device_index(device, optional=True)
        self._f.check_range(idx)
        self._init()
        return self._f.total_memory - self._f._mem[idx]["reserved"], self._f.total_memory

    def empty_cache(self) -> None:
        if self._f.initialized:
            for mem in self._f._mem.values():
                mem["freed_reserved_total"] += mem["reserved"] - -(-mem["allocated"] // _BLOCK) * _BLOCK
                mem["reserved"] = -(-mem["allocated"] // _BLOCK) * _BLOCK

    def memory_stats(self, device=None) -> "collections.OrderedDict[str, int]":
        if not self._f.initialized:
            return collections.OrderedDict()  # torch_npu: empty until the device is initialised
        mem = self._f._mem[self._f.device_index(device, optional=True)]
        stats = {}
        for pool in ("all", "large_pool", "small_pool"):
            own = pool != "small_pool"  # the fake puts everything in the large pool
            stats.update({
                f"allocated_bytes.{pool}.current": mem["allocated"] if own else 0,
                f"allocated_bytes.{pool}.peak": mem["peak_allocated"] if own else 0,
                f"allocated_bytes.{pool}.allocated": mem["allocated_total"] if own else 0,
                f"allocated_bytes.{pool}.freed": mem["freed_total"] if own else 0,
                f"reserved_bytes.{pool}.current": mem["reserved"] if own else 0,
                f"reserved_bytes.{pool}.peak": mem["peak_reserved"] if own else 0,
                f"reserved_bytes.{pool}.allocated": mem["reserved_total"] if own else 0,
                f"reserved_bytes.{pool}.freed": mem["freed_reserved_total"] if own else 0,
                f"active_bytes.{pool}.current": mem["allocated"] if own else 0,
                f"active_bytes.{pool}.peak": mem["peak_allocated"] if own else 0,
            })
        stats.update({"num_alloc_retries": 0, "num_ooms": mem["num_ooms"], "num_oom_rejections": 0})
        return collections.OrderedDict(sorted(stats.items()))

    def memory_allocated(self, device=None) -> int:
        return self.memory_stats(device).get("allocated_bytes.all.current", 0)

    def max_memory_allocated(self, device=None) -> int:
        return self.memory_stats(device).get("allocated_bytes.all.peak", 0)

    def memory_reserved(self, device=None) -> int:
        return self.memory_stats(device).get("reserved_bytes.all.current", 0)

    def max_memory_reserved(self, device=None) -> int:
        return self.memory_stats(device).get("reserved_bytes.all.peak", 0)

    def reset_peak_memory_stats(self, device=None) -> None:
        mem = self._f._mem[self._f.device_index(device, optional=True)]
        mem["peak_allocated"] = mem["allocated"]
        mem["peak_reserved"] = mem["reserved"]

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        self._init()
        if device is None:
            device = self._f.current
        idx = self._f.device_index(device, optional=False)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self._f._fraction[idx] = fraction

    def get_per_process_memory_fraction(self, device=None) -> float:
        self._init()
        if device is None:
            device = self._f.current
        return self._f._fraction.get(self._f.device_index(device, optional=False), 1.0)

    def manual_seed(self, seed) -> None:
        self._f.generator(self._f.current).manual_seed(int(seed))

    def manual_seed_all(self, seed) -> None:
        for idx in range(self._f.visible_device_count()):
            self._f.generator(idx).manual_seed(int(seed))

    def initial_seed(self) -> int:
        self._init()
        return self._f.generator(self._f.current).initial_seed()

    def get_rng_state(self, device="npu") -> torch.Tensor:
        self._init()
        return self._f.generator(self._f.device_index(device, optional=True)).get_state()

    def set_rng_state(self, new_state, device="npu") -> None:
        self._f.generator(self._f.device_index(device, optional=True)).set_state(new_state)


def _empty_memory() -> dict[str, int]:
    keys = ("allocated", "peak_allocated", "allocated_total", "freed_total", "reserved", "peak_reserved",
            "reserved_total", "freed_reserved_total", "num_ooms")
    return dict.fromkeys(keys, 0)


def _parse_visible_devices(var: str) -> list[int]:
    """ASCEND_RT_VISIBLE_DEVICES: ids are read up to the first character that is not a digit or comma."""
    end = len(var)
    for i, ch in enumerate(var):
        if not (ch.isdigit() or ch == ","):
            end = i
            break
    ids: list[int] = []
    if not var:
        return ids
    for elem in var[:end].split(","):
        if not elem:
            return ids
        ids.append(int(elem))
    return ids


def _device_class(fake: FakeTorchNPU, sig: inspect.Signature) -> type:
    """``torch.npu.device(i)``: a context manager selecting NPU ``i`` (no-op for a negative index)."""

    class device:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"npu.device{sig}: {err}") from None
            fake.calls.append(("npu.device", dict(bound.arguments)))
            self.idx = fake.device_index(bound.arguments["device"], optional=True)
            self.prev_idx = -1

        def __enter__(self) -> None:
            if self.idx < 0:
                return
            self.prev_idx = fake.current
            fake.runtime.set_device(self.idx)
            fake.initialized = True

        def __exit__(self, *exc: Any) -> bool:
            if self.idx >= 0 and self.prev_idx >= 0:
                fake.current = self.prev_idx
            return False

    device.__module__ = "torch_npu.npu"
    device.__signature__ = sig
    return device


def _grad_scaler_class(fake: FakeTorchNPU, sig: inspect.Signature) -> type:
    """``torch.npu.amp.GradScaler``: torch's loss scaler on CPU tensors; ``dynamic=False`` keeps the scale fixed."""

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"npu.amp.GradScaler{sig}: {err}") from None
            fake.calls.append(("npu.amp.GradScaler", dict(bound.arguments)))
            bound.apply_defaults()
            options = dict(bound.arguments)
            self.dynamic = options.pop("dynamic")
            super().__init__("cpu", **options)

        def update(self, new_scale: Any = None) -> None:
            if not self.dynamic and new_scale is None and self._enabled and self._scale is not None:
                new_scale = self.get_scale()  # static loss scale: never grow or back off
            super().update(new_scale)

    GradScaler.__module__ = "torch_npu.npu.amp"
    GradScaler.__signature__ = sig
    return GradScaler


def _sharded_grad_scaler_class(fake: FakeTorchNPU, sig: inspect.Signature) -> type:
    """torch_npu's ``_ShardedGradScaler`` with the recorded release's constructor (2.6.0's has no ``device``):
    torch's ShardedGradScaler on CPU tensors behind it."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

    class _ShardedGradScaler(TorchShardedGradScaler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"torch_npu._ShardedGradScaler{sig}: {err}") from None
            fake.calls.append(("_ShardedGradScaler", dict(bound.arguments)))
            device = bound.arguments.pop("device", "npu")
            if device != "npu":
                raise ValueError(f"torch_npu._ShardedGradScaler(device={device!r}): the fake models the NPU device only")
            super().__init__("cpu", **bound.arguments)

    _ShardedGradScaler.__module__ = "torch_npu.npu.amp.sharded_grad_scaler"
    _ShardedGradScaler.__signature__ = sig
    return _ShardedGradScaler


def _unmodelled_class(fake: FakeTorchNPU, qualname: str, sig: Optional[inspect.Signature]) -> type:
    """A real class (so isinstance checks work) that binds its arguments, records, then refuses to run."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if sig is not None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{qualname}{sig}: {err}") from None
            fake.calls.append((qualname, dict(bound.arguments)))
        raise NotImplementedError(f"the fake torch_npu records {qualname} but does not model it")

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": "torch_npu.npu"})


_SCALAR_CHECKS: dict[str, Callable[[Any], bool]] = {
    "Tensor": lambda v: isinstance(v, torch.Tensor),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def _without_autograd(impl: Callable[..., Any]) -> Callable[..., Any]:
    """An op the wheel registers no autograd node for (npu_grouped_matmul; the MoE permute pair before 2.13): its
    outputs carry no grad_fn, so a loss built on them never reaches the inputs, and nothing says so."""

    @functools.wraps(impl)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return impl(*args, **kwargs)

    return call


def _check_schema_type(qualname: str, arg: str, schema_type: str, value: Any) -> None:
    """Reject values torch.ops would reject for the op schema's type (``Tensor?``, ``int[]?``, ...)."""
    optional = schema_type.endswith("?")
    base = schema_type.rstrip("?")
    if value is None:
        if optional:
            return
        raise TypeError(f"{qualname}(): argument {arg!r} ({schema_type}) must not be None")
    list_of = re.fullmatch(r"(.+)\[\d*\]", base)  # Tensor[], int[], int[2]
    if list_of:
        elem = _SCALAR_CHECKS.get(list_of.group(1).replace("SymInt", "int"))
        ok = isinstance(value, (list, tuple)) and (elem is None or all(elem(v) for v in value))
    else:
        check = _SCALAR_CHECKS.get(base)
        ok = check is None or check(value)
    if not ok:
        raise TypeError(f"{qualname}(): argument {arg!r} must be {schema_type}, not {type(value).__name__}")


def install_fake_torch_npu(
    monkeypatch: Any,
    *,
    device_count: int = 8,
    device_name: str = "Ascend910B2",
    bf16_supported: Optional[bool] = None,
    total_memory: int = 64 * GiB,
    release: str = DEFAULT_RELEASE,
    cann_version: Optional[str] = None,
) -> FakeTorchNPU:
    """Install the fake as ``torch_npu`` / ``torch.npu`` for one test; monkeypatch undoes it afterwards.

    ``total_memory`` is in bytes per device; ``cann_version`` the CANN the fused ops run on (None: a current one;
    the code under test reads the installed CANN from disk, so a test sets that up too). Also renames PrivateUse1 to "npu" (once per process,
    irreversibly) so ``torch.device("npu", i)`` can be built (``ensure_npu_device_type``).
    """
    ensure_npu_device_type()
    fake = FakeTorchNPU(
        device_count=device_count,
        device_name=device_name,
        bf16_supported=bf16_supported,
        total_memory=total_memory,
        release=release,
        cann_version=cann_version,
    )
    monkeypatch.setitem(sys.modules, "torch_npu", fake.torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", fake.npu)
    monkeypatch.setitem(sys.modules, "torch_npu.npu.amp", fake.npu.amp)
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", fake.torch_npu.profiler)
    monkeypatch.setattr(torch, "npu", fake.npu)  # as torch._register_device_module("npu", torch_npu.npu) does
    monkeypatch.setitem(sys.modules, "torch.npu", fake.npu)
    # torch.get_device_module (torch.accelerator's way to torch.npu) caches what it finds for good, which torch_npu's
    # module is; this test's fake is not: looked up afresh while installed, the cache keeps _NO_TORCH_NPU. (A second
    # install in one test finds the uncached function already there.)
    uncached = getattr(torch.get_device_module, "__wrapped__", torch.get_device_module)
    monkeypatch.setattr(torch, "get_device_module", uncached)
    scaler = fake.api.get("sharded_grad_scaler") or {}
    if scaler.get("replaces"):
        # What importing torch_npu does (its distributed patches): FSDP's scaler name becomes torch_npu's class.
        from torch.distributed.fsdp import sharded_grad_scaler

        sharded = _sharded_grad_scaler_class(fake, signature_from_params(scaler["init_params"]))
        monkeypatch.setattr(sharded_grad_scaler, "ShardedGradScaler", sharded)
    install_hccl_batch_send_recv(monkeypatch)  # its distributed patches alias batch_isend_irecv too
    return fake

