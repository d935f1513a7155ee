"""Stacked experts (``recipes/decoder/moe.py``'s ``Experts``) in Hugging Face models, for every family with MoE
layers: the PEFT targets of the stacked parameters.

transformers 5 holds a layer's experts stacked in memory, as the recipe does (``mlp.experts.gate_up_proj``
[E, 2F, dim], gate rows first, and ``mlp.experts.down_proj`` [E, dim, F]): a family's name map names those. Its
``save_pretrained`` (5.24) still writes one tensor per expert, as transformers 4 did and most downloads are; which
stored tensor fills which expert is the state-dict adapter's (``hf_adapter.py``, ``ExpertLayout``).
"""

from __future__ import annotations

#: Expert LoRA target -> the stacked parameter of transformers 5's experts module PEFT adapts (its
#: ``target_parameters``; gate and up share ``gate_up_proj``).
PEFT_EXPERT_TARGETS = {"expert_gate": "mlp.experts.gate_up_proj", "expert_up": "mlp.experts.gate_up_proj",
                       "expert_down": "mlp.experts.down_proj"}
