"""Run by ``lightning-npu doctor`` as ``python <this file>``: import torch, then print the device facts as JSON.

A script rather than a module, so that ``import torch`` is the first thing this interpreter does: importing the
lightning_npu package would import torch first, and a failed ``import torch`` cannot be retried reliably in the
same process. The result is one stdout line starting with ``MARKER``.
"""

import json
import os
import sys

MARKER = "LIGHTNING_NPU_DOCTOR_FACTS "


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def main() -> None:
    # Python put this script's folder first on sys.path, where doctor.py or plan.py would shadow top-level modules.
    sys.path.pop(0)
    try:
        import torch  # noqa: F401
    except BaseException as error:  # noqa: BLE001 -- whatever `import torch` raises is the diagnosis
        cause = error.__cause__ or error.__context__
        print(MARKER + json.dumps({"torch_error": _describe(error), "torch_error_cause": cause and _describe(cause)}))
        return
    # Appended, not prepended: an installed lightning_npu (or a stand-in on PYTHONPATH) keeps its precedence.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from lightning_npu.cli.doctor import probe_devices

    print(MARKER + json.dumps({"torch_error": None, "facts": probe_devices()}))


if __name__ == "__main__":
    main()
