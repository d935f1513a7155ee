"""The LLaMA family as the shared recipe sees it (registered as ``"llama"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.decoder.transformer import ATTENTION_LORA_SITES
from recipes.models.llama import hf
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA

FAMILY = DecoderFamily(
    config_class=LLaMAConfig,
    model_class=LLaMA,
    hf=HFFormat.of_module(hf),
    # Gate and up share the fused ``w_gate_up`` (gate rows first), see model.py.
    lora_sites={
        **ATTENTION_LORA_SITES,
        "gate": ("feed_forward.w_gate_up", 0, 2),
        "up": ("feed_forward.w_gate_up", 1, 2),
        "down": ("feed_forward.w_down", 0, 1),
    },
)
