"""The parameter-holding layers the recipe's models are built from, with the initialisation they share, so LoRA
(``lora.py``) adapts every family's projections the same way."""

from __future__ import annotations

from torch import nn

INIT_STD = 0.02


class Linear(nn.Linear):
    """Linear layer, bias-free unless ``bias``, its weight initialised from normal(0, ``INIT_STD``) (``nn.Linear``
    uses Kaiming) and its bias from zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """Token embedding initialised from normal(0, ``INIT_STD``)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
