"""Activation checkpointing: recompute the activations of the modules a policy names in backward, instead of keeping
them (``activation_checkpointing_policy`` and ``activation_checkpointing_ratio``)."""

from __future__ import annotations

from typing import Sequence

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_npu.facts.options import evenly_spaced  # torch-free: lightning-npu plan picks the same blocks


def apply_activation_checkpointing(parts: Sequence[nn.Module], classes: tuple[type, ...], ratio: float) -> list[str]:
    """Recompute the activations of a ``ratio`` share of the modules of ``classes`` (evenly spaced over the model's
    ``parts``, in their order: ``[model]``, or a rank's pipeline stages) in backward.

    Uses the composable ``checkpoint``, which keeps parameter names (and so checkpoints) unchanged. Modules the
    user's code checkpointed already (see ``checkpointed_by_hand``) are left as they are, and so is every chosen
    module inside or around one: checkpointing it too would recompute those activations twice. That is said in a
    warning, as Lightning's FSDP strategies warn (they then ignore the policy altogether).
    Returns the names of the modules checkpointed here.
    """
    from lightning_npu.compat import composable_checkpoint

    matching = [(name, module) for part in parts for name, module in part.named_modules() if isinstance(module, classes)]
    chosen = [matching[i] for i in evenly_spaced(len(matching), ratio)]
    by_hand = [found for part in parts for found in checkpointed_by_hand(part)]
    if chosen and by_hand:
        covered = {id(sub) for _, module in by_hand for sub in module.modules()}  # checkpointed, or inside one
        around = [(name, module) for name, module in chosen
                  if id(module) in covered or any(id(sub) in covered for sub in module.modules())]
        chosen = [entry for entry in chosen if entry not in around]
        rank_zero_warn(
            f"activation_checkpointing_policy is set, but the model already contains checkpointed layers"
            f" ({', '.join(name for name, _ in by_hand)}; checkpoint_wrapper, apply_activation_checkpointing or"
            f" torch.distributed._composable.checkpoint). They stay as they are, and the {len(around)} modules of"
            f" the policy inside or around them are not checkpointed again"
            f"{': ' + ', '.join(name for name, _ in around) if around else ''}, so nothing is recomputed twice."
        )
    for _, module in chosen:
        composable_checkpoint(module)
    return [name for name, _ in chosen]


def checkpointed_by_hand(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` whose activations are recomputed already: wrapped by torch's ``checkpoint_wrapper``
    (also what ``apply_activation_checkpointing`` does) or given the composable ``checkpoint()``. A
    ``torch.utils.checkpoint.checkpoint`` call inside a ``forward`` cannot be seen from outside."""
    from lightning_npu.compat import CheckpointWrapper, composable_checkpoint

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, CheckpointWrapper) or composable_checkpoint.state(module) is not None]


__all__ = ["apply_activation_checkpointing", "checkpointed_by_hand"]
