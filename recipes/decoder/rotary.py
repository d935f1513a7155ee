"""The rotary tables of a config with ``head_dim``, ``rope_theta``, ``max_seq_len`` and ``rope_scaling`` (None, or
LLaMA-3.1's "llama3" rule as ``rope_scaling.py`` stores it): the LLaMA-3 and Qwen families' ``rotary_cos_sin``.
Shared here (``recipes/decoder/``, beside the trunk that applies them) rather than in the LLaMA folder: a family
folder imports no other family's (``tests/test_import_graph.py``)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_npu.kernels import rotary_tables


def rotary_frequencies(config: Any, device: Optional[torch.device] = None) -> Tensor:
    """The rotary inverse frequency of each channel pair [head_dim // 2], fp32: ``rope_theta ** (-2i / head_dim)``,
    then, with ``config.rope_scaling``, LLaMA-3.1's "llama3" rule with L = original_max_position_embeddings:
    wavelengths above L / low_freq_factor are stretched by ``factor``, those below L / high_freq_factor are kept,
    and those between blend the two with weight s = (L / wavelength - low) / (high - low) on the kept one."""
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    length = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((length / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0 above L / low, 1 below L / high
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


def rotary_cos_sin(config: Any, device: Optional[torch.device] = None) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [max_seq_len, head_dim] for positions 0 .. max_seq_len - 1, in the layout ``apply_rotary``
    takes. Unscaled, they are ``lightning_npu.kernels.rotary_tables``'s; that kernel takes a base only, so scaled
    frequencies are turned into tables here, the same way (fp32 angles, both halves)."""
    if config.rope_scaling is None:
        return rotary_tables(config.max_seq_len, config.head_dim, theta=config.rope_theta, device=device)
    positions = torch.arange(config.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, rotary_frequencies(config, device))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()
