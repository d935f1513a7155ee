"""The DeepSeek family as the shared recipe sees it (registered as ``"deepseek"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.models.deepseek import hf
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.model import DeepSeek

FAMILY = DecoderFamily(
    config_class=DeepSeekConfig,
    model_class=DeepSeek,
    hf=HFFormat.of_module(hf),
    # MLA's output projection; its latent and up-projections are not LoRA targets of the recipe yet.
    lora_sites={"o": ("attention.wo", 0, 1)},
    context_parallel=False,  # MLAttention takes no context-parallel attention yet (Dv != Dk, the shared rotary key)
)
