"""The Qwen dense family as the shared recipe sees it (registered as ``"qwen"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DENSE_LORA_SITES, DecoderFamily, HFFormat
from recipes.models.qwen import hf
from recipes.models.qwen.config import QwenConfig
from recipes.models.qwen.model import Qwen

FAMILY = DecoderFamily(
    config_class=QwenConfig,
    model_class=Qwen,
    hf=HFFormat.of_module(hf),
    lora_sites=DENSE_LORA_SITES,
)
