"""The frozen reference policy of the post-training objectives (DPO's log-ratios, GRPO's KL term), one implementation
for both: ``ReferencedLM`` is the ``DecoderLM`` that DPO and GRPO subclass.

The reference (``reference``; ``auto`` picks the first that applies):
  * ``adapters_off`` (LoRA): the policy itself with its adapters switched off, which is the frozen base: no second
    model, no second copy of the weights;
  * ``copy``: a frozen second model of the same family, built beside the policy in ``configure_model`` (so
    ``npu_fsdp`` shards it by the same policy, over the same mesh, and no optimizer ever sees it), given the policy's
    first weights when the fit starts (``init_from``'s, or the seed's) and saved in checkpoints (a resume restores it
    as it was). It costs one more model's weights (sharded) and one forward per use. Under LoRA it is refused: the
    base with the adapters off is that model already, at no memory.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch
from torch import nn

from recipes.decoder.lora import LoRALinear, StackedLoRA
from recipes.decoder.module import DecoderLM, _shards_parameters

#: ``reference`` choices (see the module docstring).
REFERENCES = ("auto", "adapters_off", "copy")


def choose_reference(reference: str, lora: bool) -> str:
    """The reference kind ``reference`` names (``auto`` resolved) for a policy with or without LoRA adapters;
    ValueError naming the choice and the fix where that reference cannot be built."""
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not one of {', '.join(REFERENCES)}")
    if reference == "adapters_off" and not lora:
        raise ValueError("reference='adapters_off' needs model.lora: without adapters the policy is not its own"
                         " reference; use reference='copy' (or 'auto')")
    if reference == "copy" and lora:
        raise ValueError("reference='copy' under model.lora would hold a second copy of the frozen base, which the"
                         " policy with its adapters off already is; use reference='adapters_off' (or 'auto')")
    if reference == "auto":
        return "adapters_off" if lora else "copy"
    return reference


class ReferencedLM(DecoderLM):
    """A ``DecoderLM`` with a frozen reference (see the module docstring), or none (``reference_kind`` None: an
    objective that needs no reference, GRPO with beta 0). A subclass calls ``use_reference`` in its ``__init__``."""

    def use_reference(self, reference: Optional[str]) -> None:
        """Build the reference ``reference`` names (``REFERENCES``) when the model is configured; None: none."""
        self.reference_kind = None if reference is None else choose_reference(reference, self.lora is not None)
        self.reference: Optional[nn.Module] = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.reference_kind == "copy" and self.reference is None:
            # Built here, beside the policy, so the strategy shards and places it as it does the policy.
            with torch.device("meta") if _shards_parameters(self) else nullcontext():
                self.reference = self.family.model_class(self.config)
            self.reference.requires_grad_(False)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        fresh = self.trainer.ckpt_path is None and not self._state_restored
        if self.reference is not None and fresh:  # a resumed run restores the reference from its checkpoint
            with torch.no_grad():
                for ref, policy in zip(self.reference.parameters(), self.model.parameters(), strict=True):
                    ref.copy_(policy)
        if self.reference is not None:
            self.reference.eval()

    @contextmanager
    def reference_model(self) -> Iterator[nn.Module]:
        """The reference, as a model to call inside the block (the frozen copy, or the policy with its adapters
        off); callers run it under ``torch.no_grad``."""
        if self.reference_kind is None:
            raise RuntimeError(f"{type(self).__name__} was built without a reference")
        if self.reference is not None:
            yield self.reference
            return
        with adapters_off(self.model):
            yield self.model


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """``model``'s LoRA adapters switched off (their scaling 0: each adapted layer gives its base's output exactly)
    inside the block, on again after it."""
    adapted = [module for module in model.modules() if isinstance(module, (LoRALinear, StackedLoRA))]
    scalings = [module.scaling for module in adapted]
    for module in adapted:
        module.scaling = 0.0
    try:
        yield
    finally:
        for module, scaling in zip(adapted, scalings):
            module.scaling = scaling
