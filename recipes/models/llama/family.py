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
    lora_sites={
        **ATTENTION_LORA_SITES,
        "gate": ("feed_forward.w_gate", 0, 1),
        "up": ("feed_forward.w_up", 0, 1),
        "down": ("feed_forward.w_down", 0, 1),
    },
)
