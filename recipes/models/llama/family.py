"""The LLaMA family as the shared recipe sees it (registered as ``"llama"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DENSE_LORA_SITES, DecoderFamily, HFFormat
from recipes.models.llama import hf
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA

FAMILY = DecoderFamily(
    config_class=LLaMAConfig,
    model_class=LLaMA,
    hf=HFFormat.of_module(hf),
    lora_sites=DENSE_LORA_SITES,
)
