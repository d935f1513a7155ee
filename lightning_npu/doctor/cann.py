"""Find the CANN toolkit on disk and read its version, the ways Ascend's installer lays it out."""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Mapping, Optional

from lightning_npu.doctor.report import CannInstall
from lightning_npu.facts.env import CANN_HOME_ENVS

#: Where the installer puts CANN, searched after the homes the environment names (CANN_HOME_ENVS).
DEFAULT_CANN_HOMES = (
    "/usr/local/Ascend/ascend-toolkit/latest",  # CANN <= 8.3 (root install)
    "/usr/local/Ascend/cann",  # CANN >= 8.5 (root install)
    "~/Ascend/ascend-toolkit/latest",  # non-root installs
    "~/Ascend/cann",
)


def cann_candidates(env: Mapping[str, str]) -> list[Path]:
    """Directories that may hold a CANN toolkit, in search order, without duplicates."""
    seen: list[Path] = []
    for raw in [env.get(name) for name in CANN_HOME_ENVS] + list(DEFAULT_CANN_HOMES):
        if raw:
            path = Path(raw).expanduser()
            if path not in seen:
                seen.append(path)
    return seen


def find_cann(env: Mapping[str, str]) -> Optional[CannInstall]:
    """The first candidate directory that holds a CANN toolkit with a readable version, or None."""
    for home in cann_candidates(env):
        version, source = read_cann_version(home)
        if version is not None:
            set_env = next((p for p in (home / "set_env.sh", home.parent / "set_env.sh") if p.is_file()), None)
            return CannInstall(str(home), version, str(source), str(set_env) if set_env else None)
    return None


def read_cann_version(home: Path) -> tuple[Optional[str], Optional[Path]]:
    """CANN's version and the file it came from, read the ways Ascend documents.

    ``<home>/<arch>-linux/ascend_toolkit_install.info`` holds ``version=8.0.RC2``; ``<home>/version.cfg`` holds
    ``toolkit_running_version=[7.3.0.1.231:8.0.RC2]`` (inner version, then the release after the colon).
    """
    infos = [home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info"]
    if home.is_dir():
        infos += sorted(home.glob("*-linux/ascend_toolkit_install.info"))
    for info in infos:
        if info.is_file():
            version = _key_values(info).get("version")
            if version:
                return version, info
    cfg = home / "version.cfg"
    if cfg.is_file():
        values = _key_values(cfg)
        for key in ("toolkit_running_version", "runtime_running_version"):
            match = re.fullmatch(r"\[([^:\]]*):([^\]]+)\]", values.get(key, ""))
            if match:
                return match.group(2), cfg
    return None, None


def _key_values(path: Path) -> dict[str, str]:
    values = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return values
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            values[key.strip()] = value.strip()
    return values
