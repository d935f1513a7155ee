"""The DeepSeek family as the shared recipe sees it (registered as ``"deepseek"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.decoder.moe import EXPERT_LORA_SITES
from recipes.models.deepseek import hf
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.model import DeepSeek

FAMILY = DecoderFamily(
    config_class=DeepSeekConfig,
    model_class=DeepSeek,
    hf=HFFormat.of_module(hf),
    # MLA's projections: the query (wq, or its low rank wq_a and up-projection wq_b, as q_lora_rank says), the
    # key/value latent with the shared rotary key (wkv_a), its up-projection (wkv_b) and the output.
    lora_sites={"q": ("attention.wq", 0, 1), "q_a": ("attention.wq_a", 0, 1), "q_b": ("attention.wq_b", 0, 1),
                "kv_a": ("attention.wkv_a", 0, 1), "kv_b": ("attention.wkv_b", 0, 1), "o": ("attention.wo", 0, 1)},
    expert_lora_sites=EXPERT_LORA_SITES,  # DeepSeekMoE's routed experts are the shared stacked experts
)
