"""The LLaMA family as the shared recipe sees it (registered as ``"llama"`` in ``recipes/families.py``)."""

from recipes.decoder.family import DecoderFamily, HFFormat
from recipes.models.llama import hf
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA

FAMILY = DecoderFamily(
    config_class=LLaMAConfig,
    model_class=LLaMA,
    hf=HFFormat(
        model_types=hf.MODEL_TYPES,
        config_from_hf=hf.config_from_hf,
        config_dict=hf.hf_config_dict,
        name_map=hf.hf_name_map,
        peft_targets=hf.PEFT_TARGETS,
    ),
    # Gate and up share the fused ``w_gate_up`` (gate rows first), see model.py.
    lora_sites={
        "q": ("attention.wq", 0, 1),
        "k": ("attention.wk", 0, 1),
        "v": ("attention.wv", 0, 1),
        "o": ("attention.wo", 0, 1),
        "gate": ("feed_forward.w_gate_up", 0, 2),
        "up": ("feed_forward.w_gate_up", 1, 2),
        "down": ("feed_forward.w_down", 0, 1),
    },
)
