"""Run by ``lightning-npu doctor`` as ``python <this file>``: import torch, then print the device facts as JSON.

A script rather than a module, so that ``import torch`` is the first thing this interpreter does (a failed
``import torch`` cannot be retried reliably in the process it failed in) and so that a crash kills only this
process. It prints ``STAGE_MARKER <stage>`` before each stage, so the doctor can say which one a crash (a signal,
no Python error) happened in, and lets faulthandler write the crashing Python frame to stderr. The result is
one stdout line starting with ``MARKER``.
"""

import faulthandler
import json
import os
import sys

MARKER = "LIGHTNING_NPU_DOCTOR_FACTS "
STAGE_MARKER = "LIGHTNING_NPU_DOCTOR_STAGE "
#: The stages, in order; the doctor names the one a crash happened in.
IMPORT_TORCH, PROBE_DEVICES = "import torch", "probe devices"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _stage(name: str) -> None:
    print(STAGE_MARKER + name, flush=True)  # flushed: a crash in the stage loses unflushed output


def main() -> None:
    # Python put this script's folder first on sys.path, where the doctor's modules would shadow top-level ones.
    sys.path.pop(0)
    faulthandler.enable()  # on SIGSEGV & co., stderr names the Python frame that crashed
    _stage(IMPORT_TORCH)
    try:
        import torch  # noqa: F401
    except BaseException as error:  # noqa: BLE001 -- whatever `import torch` raises is the diagnosis
        cause = error.__cause__ or error.__context__
        print(MARKER + json.dumps({"torch_error": _describe(error), "torch_error_cause": cause and _describe(cause)}))
        return
    _stage(PROBE_DEVICES)
    # Appended, not prepended: an installed lightning_npu (or a stand-in on PYTHONPATH) keeps its precedence.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from lightning_npu.doctor.device_facts import probe_devices

    print(MARKER + json.dumps({"torch_error": None, "facts": probe_devices()}))


if __name__ == "__main__":
    main()
