"""Run a callback once a module has been imported, without importing it: a post-import hook.

``import lightning_npu`` must not import Lightning (and so torch), yet it promises to register ``"npu"`` with
Lightning. ``call_after_import("lightning.pytorch", register)`` calls ``register`` at once when Lightning is
already loaded, and otherwise right after its import finishes, from a finder on ``sys.meta_path`` that wraps the
loader's ``exec_module`` and leaves ``sys.meta_path`` when it has fired.

The callback must not run while one of the ``package``'s own modules is still executing: ``import
lightning_npu.accelerator`` imports Lightning half-way through that module, and registering then would import the
half-initialised module and fail. So the finder also wraps the execution of the package's modules and fires only
when the target is loaded and none of them is on the stack.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable, Optional, Sequence


def call_after_import(target: str, callback: Callable[[], None], package: str) -> None:
    """Call ``callback()`` now if ``target`` is imported, else once ``target`` is imported and no module of
    ``package`` is mid-execution (see the module docstring). A second call for the same target replaces the first
    hook instead of adding one."""
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport) and f.target == target]:
        sys.meta_path.remove(finder)
    if target in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(target, callback, package))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the target and the package's modules, it returns the spec the other finders
    find, with ``exec_module`` wrapped to count running package modules and fire the callback."""

    def __init__(self, target: str, callback: Callable[[], None], package: str) -> None:
        self.target = target
        self.callback = callback
        self.package = package
        self.running = 0  # modules of ``package`` being executed now (imports nest)
        self.target_loaded = False

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        watched = fullname == self.target or fullname.startswith(self.package + ".")
        if not watched or self not in sys.meta_path:
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        own = "exec_module" in getattr(loader, "__dict__", {})

        def exec_then_fire(module: Any) -> None:
            # Put the loader back first: some loaders (zipimport) serve many modules with one instance.
            if own:
                loader.exec_module = exec_module
            else:
                del loader.exec_module
            if fullname == self.target:
                exec_module(module)
                self.target_loaded = True
            else:
                self.running += 1
                try:
                    exec_module(module)
                finally:
                    self.running -= 1
            self._fire_if_ready()

        try:
            loader.exec_module = exec_then_fire
        except AttributeError:  # a loader with __slots__: left as it is (never seen for Lightning or this package)
            pass
        return spec

    def _fire_if_ready(self) -> None:
        if self.running or not self.target_loaded or self not in sys.meta_path:
            return
        sys.meta_path.remove(self)  # before the callback, whose own imports must not come back here
        self.callback()


def _spec_from_other_finders(skip: Any, fullname: str, path: Optional[Sequence[str]], target: Any) -> Any:
    for finder in list(sys.meta_path):
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None
