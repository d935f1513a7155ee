"""A finished run exits cleanly: its process groups are destroyed before the interpreter tears down.

A gloo worker thread releases a collective's work, and the tensors in it, only after the caller has seen the
collective complete. When the script ends first and that release falls into interpreter finalisation, freeing a
tensor's Python object asks for the GIL, CPython ends the asking thread, and C++ turns that into
``std::terminate``: SIGABRT ("terminate called without an active exception") after the script has finished
(pytorch/pytorch#190489; upstream's atexit fix, #179291, was abandoned). torchrun and SLURM report such a job as
failed. Lightning destroys the groups at exit only for NCCL; on HCCL, torch_npu asks for them to be destroyed
explicitly.

Every NPU distributed strategy (Trainer and Fabric, DDP and FSDP) calls :func:`destroy_at_exit` as it creates or
joins the process group; the selftest calls :func:`destroy_process_groups` when its checks are done. The atexit
hook (registered once per process) destroys every group, the default one last, the async-checkpoint gloo group
too; the device meshes npu_fsdp built drop their references to them (torch's DTensor caches keep a mesh alive to
the end of the process); then the objects that kept them alive are collected. A group nothing else references
(the script's model, Fabric or Trainer are gone: training inside a function) is freed there, which joins its
worker threads while the interpreter is still whole. A group that objects in module-level variables still hold
is freed only in teardown, as before (also under ``lightning-npu run``: multiprocessing and dill keep the
script's module); the abort is then less likely, not impossible.

Order at exit: Python first joins non-daemon threads (the async checkpoint writer's executor, DCP's), so a save in
flight completes on its group before the hook runs; atexit hooks then run last-registered first, so a user's hook
registered after the strategy was set up still has its groups.

No collective, so no waiting for peers: destroying a gloo group talks to nobody, and a rank whose peers died exits
at once with its own status. Only a collective still in flight at exit (this rank raised while a live peer waits
in another collective) makes freeing its group wait, up to the process-group timeout; after
:data:`DESTROY_TIMEOUT_S` the process exits with status 1 instead, which also frees that peer.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import weakref
from typing import Any, Optional

from lightning_npu import compat

#: Seconds the exit hook may take before the process exits without it (a healthy run needs milliseconds).
DESTROY_TIMEOUT_S = 60.0

_registered = False
#: Device meshes the strategies built: torch's DTensor caches keep them, and the groups they hold, to the end.
_meshes: "weakref.WeakSet[Any]" = weakref.WeakSet()


def destroy_at_exit(mesh: Optional[Any] = None) -> None:
    """Make this process destroy its process groups at exit (idempotent: one hook per process); ``mesh``: a
    device mesh whose references to its groups are dropped then too."""
    global _registered
    if mesh is not None:
        _meshes.add(mesh)
    if not _registered:
        _registered = True
        atexit.register(_destroy_within_timeout)


def destroy_process_groups() -> None:
    """Destroy every process group of this process and free the ones nothing else references (their worker
    threads are joined). A no-op without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()  # every group; torch shuts the default one down last
    for mesh in list(_meshes):
        compat.release_mesh_process_groups(mesh)
    gc.collect()


def _destroy_within_timeout() -> None:
    watchdog = threading.Timer(DESTROY_TIMEOUT_S, _exit_without_destroying)
    watchdog.daemon = True
    watchdog.start()
    try:
        destroy_process_groups()
    finally:
        watchdog.cancel()


def _exit_without_destroying() -> None:
    sys.stderr.write(
        f"[lightning-npu] pid {os.getpid()}: the process groups were not destroyed within {DESTROY_TIMEOUT_S:g} s of"
        " exit (a collective is still waiting for a peer); exiting with status 1 instead of waiting for the"
        " process-group timeout\n"
    )
    sys.stderr.flush()
    os._exit(1)
