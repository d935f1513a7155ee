"""Device ids: which NPUs ``ASCEND_RT_VISIBLE_DEVICES`` shows (torch_npu's parser, and why a value hides
devices), how many simulated NPUs ``LIGHTNING_NPU_SIMULATE`` asks for, and what a Trainer/Fabric ``devices``
value asks for.

Pure Python, so the runtime's probe, the accelerator, ``lightning-npu doctor`` (which must run where
``import torch`` fails) and ``lightning-npu plan`` read them the same way.
"""

from __future__ import annotations

import re
from typing import Optional, Union

from lightning_npu.facts.env import SIMULATE_ENV, VISIBLE_DEVICES_ENV
from lightning_npu.facts.problem import Problem, SettingError

#: The first thing to check when the NPUs do not answer (the runtime's probe and the doctor).
DRIVER_HINT = "check the driver with `npu-smi info`"


def visible_device_ids(value: str) -> list[int]:
    """The device ids torch_npu reads from an ``ASCEND_RT_VISIBLE_DEVICES`` value.

    This is torch_npu's own parser (``_parse_visible_devices`` in ``torch_npu/npu/__init__.py``, the same in
    2.6.0 .. 2.14.0), which follows CANN's rule: ids are separated by commas and read only up to the first
    character that is neither a digit nor a comma, and an empty field ends the list. So ``"0,1,"`` and
    ``"0,1 "`` give [0, 1], ``"0, 1"`` gives [0], ``" 0,1"`` gives []. A character ``str.isdigit`` accepts but
    ``int`` does not (``"²"``) makes torch_npu raise; here it raises ValueError the same way.
    """
    end = next((i for i, char in enumerate(value) if not (char.isdigit() or char == ",")), len(value))
    ids: list[int] = []
    for field in value[:end].split(","):
        if not field:
            break
        ids.append(int(field))
    return ids


def visible_devices_problem(value: Optional[str]) -> Optional[Problem]:
    """Why an ``ASCEND_RT_VISIBLE_DEVICES`` value hides devices, or None if torch_npu reads it as written (or unset).

    torch_npu shows no device when the value yields no id or ids that are not strictly ascending (the runtime
    needs ascending ids; duplicates count as not ascending). It silently drops every id after a space or other
    stray character, so a value it reads only in part is reported too, with the ids it does read.
    """
    if value is None:
        return None
    if value.strip() == "":
        return Problem(f"{VISIBLE_DEVICES_ENV} is set but empty, which hides every NPU",
                       "unset it or list device ids like 0,1")
    written = [int(run) for run in re.findall(r"[0-9]+", value)]
    example = ",".join(str(i) for i in sorted(set(written))) or "0,1,2,3"
    try:
        ids = visible_device_ids(value)
    except ValueError:
        ids = None
    if not ids:
        return Problem(
            f"{VISIBLE_DEVICES_ENV}={value!r} is malformed and hides every NPU (torch_npu reads device ids only up to"
            " the first character that is neither a digit nor a comma)",
            f"use comma-separated device ids without spaces, e.g. {example}",
        )
    if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
        return Problem(
            f"{VISIBLE_DEVICES_ENV}={value!r} is not strictly ascending (CANN then shows no device)",
            f"list each id once in ascending order, e.g. {example}",
        )
    if ids != written:
        return Problem(
            f"{VISIBLE_DEVICES_ENV}={value!r} is malformed: torch_npu reads only device(s) {','.join(map(str, ids))}"
            " from it (it stops at the first empty field or character other than a digit or comma)",
            f"use comma-separated device ids without spaces, e.g. {example}",
        )
    return None


#: What ``devices=`` accepts: a count (-1: all), ``"auto"``, a count or ids as text, or a list of ids.
DEVICES = Union[int, str, list[int], tuple[int, ...]]
#: ``devices_request``'s answer for "every visible device".
ALL_DEVICES = -1


def devices_request(devices: DEVICES) -> Union[int, list[int]]:
    """What a Trainer/Fabric ``devices`` value asks for, before it is compared with the visible devices: a
    positive count, ``ALL_DEVICES`` (-1, ``"auto"``), or a list of distinct ids.

    ``int`` n: the first n devices (-1: all); ``"auto"``/``"-1"``: all; ``"2"``: two devices; ``"0,1"`` or
    ``[0, 1]``: those device ids. TypeError / ValueError name the value and the accepted forms.
    """
    if isinstance(devices, bool):
        raise TypeError(f"devices={devices!r} is not a device count or list of ids; use e.g. devices=2 or devices=[0, 1]")
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            devices = ALL_DEVICES
        elif text.isdigit():
            devices = int(text)
        elif text and all(part.strip().isdigit() for part in text.rstrip(",").split(",")):
            devices = [int(part) for part in text.rstrip(",").split(",")]
        else:
            raise ValueError(f"devices={devices!r} is not understood; use a count like '2', ids like '0,1', or 'auto'")
    if isinstance(devices, int):
        if devices != ALL_DEVICES and devices < 1:
            raise ValueError(f"devices={devices!r} must be a positive number of NPUs, -1 or 'auto' for all")
        return devices
    ids = list(devices)
    if not ids:
        raise ValueError("devices=[] selects no NPU; give at least one id, e.g. devices=[0]")
    if any(not isinstance(index, int) or isinstance(index, bool) for index in ids):
        raise TypeError(f"devices={devices!r} must contain integer device ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices={devices!r} lists a device more than once; list each NPU id once")
    return ids


def simulated_count(value: Optional[str]) -> int:
    """The number of simulated devices a ``LIGHTNING_NPU_SIMULATE`` value asks for (0 = simulation off); a bad
    value raises ``SettingError`` (a ValueError)."""
    if value is None or value.strip() in ("", "0"):
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 1:
        raise SettingError(Problem(
            f"{SIMULATE_ENV}={value!r} is not a number of devices",
            "set it to a positive integer such as 2 to simulate that many NPUs on the CPU, or unset it to use real"
            " NPUs",
        ))
    return count
