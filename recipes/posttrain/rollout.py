"""GRPO's rollouts: an engine interface and the built-in engine, the policy's own KV-cache generation.

``RolloutEngine`` is the seam for an external engine (vLLM-Ascend, colocated, the policy's weights synced into it
before each rollout phase): it gets the policy and the prompts, and returns the completions as token ids. The
built-in ``PolicyRolloutEngine`` runs ``recipes.generate.decode`` on the policy itself; under ``npu_fsdp`` (FSDP2) it
gathers the parameters once for the whole rollout phase (every ``FSDPModule`` unsharded and kept so across the
decode steps), not once per token, and shards them again afterwards.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
from torch import Tensor

from lightning_npu import compat
from recipes.generate import decode


@dataclass(frozen=True)
class SamplingOptions:
    """How completions are drawn (TRL's names): ``temperature`` 0 decodes greedily; ``top_p`` 1.0 keeps every token;
    ``max_completion_length`` new tokens at most; ``num_generations`` completions per prompt."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"num_generations={self.num_generations} must be >= 1 (completions per prompt; GRPO's"
                             " advantages compare them, so use 2 or more)")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be >= 1 (new tokens)")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1] (1.0 = no nucleus filter)")


@dataclass
class Rollouts:
    """One rollout phase's completions: for prompt ``i`` (``prompt_ids[i]``, 1-D), its ``num_generations``
    completions are rows ``i * G ... i * G + G - 1`` of ``completion_ids`` [n * G, length] (right-padded), with
    ``completion_mask`` 1 on each completion's tokens up to and including its first EOS."""

    prompt_ids: list[Tensor]
    completion_ids: Tensor
    completion_mask: Tensor
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        """Completion tokens generated (the rollout tokens/s numerator)."""
        return int(self.completion_mask.sum())


class RolloutEngine(Protocol):
    """Draws ``options.num_generations`` completions for each prompt with the current policy ``model``."""

    def generate(self, model: torch.nn.Module, prompt_ids: list[Tensor], options: SamplingOptions,
                 eos_id: Optional[int], generator: Optional[torch.Generator] = None) -> Rollouts: ...


class PolicyRolloutEngine:
    """The built-in engine: the policy's own KV-cache decoding (``recipes.generate.decode``), each prompt's group of
    completions as one batch, the parameters gathered once per call. ``owner`` is the module that holds the policy
    (the LightningModule under ``npu_fsdp``: its root unit holds what the blocks do not), whose own unit is gathered
    with the policy's."""

    def __init__(self, owner: Optional[torch.nn.Module] = None) -> None:
        self.owner = owner

    def generate(self, model: torch.nn.Module, prompt_ids: list[Tensor], options: SamplingOptions,
                 eos_id: Optional[int], generator: Optional[torch.Generator] = None) -> Rollouts:
        start = time.perf_counter()
        groups = []
        with torch.no_grad(), gathered_parameters(model, root=self.owner):
            for prompt in prompt_ids:
                batch = prompt.reshape(1, -1).expand(options.num_generations, -1)
                out = decode(model, batch, options.max_completion_length, temperature=options.temperature,
                             top_p=None if options.top_p == 1.0 else options.top_p, generator=generator,
                             eos_id=eos_id)
                groups.append(out[:, prompt.numel():])
        completion_ids, completion_mask = _pad_completions(groups, eos_id)
        return Rollouts(list(prompt_ids), completion_ids, completion_mask, seconds=time.perf_counter() - start)


def _pad_completions(groups: list[Tensor], eos_id: Optional[int]) -> tuple[Tensor, Tensor]:
    """The groups' completions right-padded to one length (with EOS, or 0 without one), and their masks: 1 up to
    and including each row's first EOS."""
    length = max(group.shape[1] for group in groups)
    pad = 0 if eos_id is None else eos_id
    ids = torch.cat([torch.nn.functional.pad(g, (0, length - g.shape[1]), value=pad) for g in groups])
    if eos_id is None:
        return ids, torch.ones_like(ids)
    is_eos = ids == eos_id
    after_first_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return ids, (~after_first_eos).long()


@contextmanager
def gathered_parameters(model: torch.nn.Module, root: Optional[torch.nn.Module] = None) -> Iterator[None]:
    """Every FSDP2 unit of ``model``, and ``root``'s own (the module that holds ``model``: its other units, a frozen
    reference's blocks, stay sharded), unsharded for the whole block and kept so by their forwards (one all-gather per unit, not one per forward); afterwards the units that were sharded before
    are sharded again, and each unit's own ``reshard_after_forward`` is restored. A no-op for a module FSDP2 does
    not shard."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if isinstance(root, FSDPModule) and root is not model:
        modules.append(root)
    units = [(m, *compat.fsdp_reshard_flags(m)) for m in modules]
    for unit, _, _ in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshards, was_unsharded in units:
            if not was_unsharded:
                unit.reshard()
            unit.set_reshard_after_forward(reshards, recurse=False)
