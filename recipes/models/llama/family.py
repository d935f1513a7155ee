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
)
