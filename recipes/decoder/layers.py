"""The parameter-holding layers the recipe's models are built from, with the initialisation they share, so LoRA
(``lora.py``) adapts every family's projections the same way."""

from __future__ import annotations

from torch import nn

INIT_STD = 0.02


class Linear(nn.Linear):
    """Bias-free linear layer initialised from normal(0, ``INIT_STD``) (``nn.Linear`` uses Kaiming)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class Embedding(nn.Embedding):
    """Token embedding initialised from normal(0, ``INIT_STD``)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
