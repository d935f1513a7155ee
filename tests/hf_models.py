"""Tiny random transformers checkpoints for the families' parity tests: every weight drawn (norm gains around 1,
biases included) so each feature of an architecture moves the logits."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import transformers


def random_hf_model(config_class: type, model_class: type, fields: Mapping[str, Any], *,
                    seed: int = 0) -> transformers.PreTrainedModel:
    """``model_class(config_class(**fields))`` in eval mode with every parameter drawn from N(0, 0.2), plus 1 for
    norm gains, from ``seed``."""
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if "norm" in name:
                param.add_(1.0)
    return model


def saved(model: transformers.PreTrainedModel, path) -> object:
    """``path`` after ``model.save_pretrained(path)``."""
    model.save_pretrained(path)
    return path


def random_tokens(vocab_size: int, *, seed: int = 1, batch: int = 2, seq: int = 12) -> torch.Tensor:
    """[batch, seq] token ids below ``vocab_size`` from ``seed``."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
