"""LoRA adapters on a model of any of the recipe's families: adding them to a built model, their names, merging them.
The configuration (``LoRAConfig``, the target names ``TARGETS``) lives in the torch-free ``lora_config.py``; where each
target sits in a block is the family's (``DecoderFamily.lora_sites``).

``add_lora(model, LoRAConfig(...))`` replaces each targeted projection of every block with a
``LoRALinear`` that keeps the base ``weight`` under its old name (so ``init_from`` and the HF name map see the
base layout unchanged) and adds, per target, ``lora_a.<target>.weight`` [rank, in] and
``lora_b.<target>.weight`` [rows, rank]; in the LLaMA family::

    layers.{i}.attention.wq.lora_a.q.weight              [rank, dim]
    layers.{i}.attention.wq.lora_b.q.weight              [n_heads * head_dim, rank]
    layers.{i}.feed_forward.w_gate.lora_a.gate.weight    [rank, dim]
    layers.{i}.feed_forward.w_gate.lora_b.gate.weight    [ffn_hidden_dim, rank]

Each adapter is exactly PEFT's adapter on the Hugging Face layer it maps to (``lora_export.py`` only renames); a
site may also be one row block of a fused weight (``LoRASite``), with one independent adapter per block. Forward, as PEFT's:
``base(x) + B(A(dropout(x))) * alpha / rank``; B starts at zero (a fresh adapter changes nothing), A as PEFT
initialises it (Kaiming uniform, a=sqrt(5)). Base weights are frozen; the model stays free of parallelism.

With ``base_quantization`` (``int8`` or ``nf4``: QLoRA-style) every projection of every block that the family's
``lora_sites`` name is stored quantized, adapted or not (QLoRA quantizes all of a model's Linear layers; here the
embedding, the norms and the output projection stay as they are): an adapted one's ``LoRALinear`` holds
``weight_codes`` and ``weight_scales`` in place of ``weight``, an unadapted one becomes a
``lightning_npu.quant.QuantizedLinear`` with the same two. ``quantized_base_state`` turns a base state dict
(``init_from``'s) into those entries; ``merged_state_dict`` adds the adapters to the decoded quantized base, the
weights they were trained against.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_npu.kernels import quantized_linear
from lightning_npu.quant import QuantizedLinear, dequantize, quantized_state
from lightning_npu.quant.linear import CODES, SCALES
from lightning_npu.quant.weights import check_quantizable
from recipes import families
from recipes.decoder.family import LoRASite
from recipes.decoder.layers import Linear
from recipes.decoder.lora_config import LoRAConfig

ADAPTER_MARKERS = (".lora_a.", ".lora_b.")


class LoRAA(nn.Linear):
    """An adapter's down projection A [rank, in], initialised as PEFT does (Kaiming uniform, a=sqrt(5))."""

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class LoRAB(nn.Linear):
    """An adapter's up projection B [rows, rank], initialised to zero so a fresh adapter changes nothing."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class LoRALinear(Linear):
    """A frozen projection (with the replaced layer's bias, if any, frozen too) plus a LoRA adapter on some of its
    equal row blocks.

    ``blocks`` is how many equal row blocks the weight has (2 for the fused gate/up) and ``adapted`` maps a target
    name to the row block it adapts. The base parameters are the replaced layer's own (not copies): ``weight`` of a
    ``Linear``, or ``weight_codes`` and ``weight_scales`` of a ``QuantizedLinear`` (``scheme`` then names its format).
    """

    def __init__(self, base: Linear | QuantizedLinear, blocks: int, adapted: Mapping[str, int],
                 config: LoRAConfig) -> None:
        nn.Module.__init__(self)  # not Linear.__init__: that would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scheme = base.scheme if isinstance(base, QuantizedLinear) else None
        if self.scheme is None:
            self.weight = base.weight
            self.weight.requires_grad_(False)
            like = base.weight
        else:
            self.weight_codes, self.weight_scales = base.weight_codes, base.weight_scales
            like = base.weight_scales  # fp32, as the model's other parameters
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rows = base.out_features // blocks
        self.blocks = blocks
        self.scaling = config.scaling
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        factory = {"device": like.device, "dtype": like.dtype}
        self.block_of = dict(adapted)
        self.lora_a = nn.ModuleDict(
            {name: LoRAA(self.in_features, config.rank, bias=False, **factory) for name in adapted}
        )
        self.lora_b = nn.ModuleDict({name: LoRAB(config.rank, self.rows, bias=False, **factory) for name in adapted})

    def reset_parameters(self) -> None:
        if self.scheme is None:
            super().reset_parameters()
        else:  # the codes' values come from init_from (quantized_base_state)
            for param in self.parameters(recurse=False):
                nn.init.zeros_(param)

    def forward(self, x: Tensor) -> Tensor:
        if self.scheme is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = quantized_linear(x, self.weight_codes, self.weight_scales, self.scheme, self.bias)
        by_block = {block: name for name, block in self.block_of.items()}
        pieces = []
        for block in range(self.blocks):
            name = by_block.get(block)
            if name is None:  # a row block without adapter (gate adapted, up not): no update there
                pieces.append(out.new_zeros(*out.shape[:-1], self.rows))
            else:  # dropout per adapter, as PEFT's separate gate_proj / up_proj layers draw their own masks
                pieces.append(self.lora_b[name](self.lora_a[name](self.dropout(x))))
        delta = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return out + delta * self.scaling


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Add ``config``'s adapters to every block of ``model`` (a plain, unwrapped model of one of the recipe's
    families, real or on the meta device) in place and freeze every other parameter. Returns ``model``."""
    models = {name: family.model_class for name, family in families.all_families().items()}
    if not isinstance(model, tuple(models.values())):
        raise TypeError(f"add_lora takes a model of the recipe's families {sorted(models)}, got {type(model).__name__}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters; add_lora applies once, to a model built without them")
    for param in model.parameters():
        param.requires_grad_(False)
    sites: dict[str, tuple[int, dict[str, int]]] = {}
    for name in config.targets:
        path, block, blocks = lora_site(model.config, name)
        sites.setdefault(path, (blocks, {}))[1][name] = block
    for layer in model.layers:
        for path in quantized_paths(model.config, config):
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, leaf)
            check_quantizable(tuple(linear.weight.shape), config.base_quantization, f"{path}.weight")
            setattr(parent, leaf, QuantizedLinear.from_linear(linear, config.base_quantization))
        for path, (blocks, adapted) in sites.items():
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf), blocks, adapted, config))
    return model


def quantized_paths(model_config: Any, config: LoRAConfig) -> list[str]:
    """The block submodules (``attention.wq`` ...) whose weights ``config`` stores quantized: every projection the
    family's ``lora_sites`` name (adapted or not), or none without ``base_quantization``."""
    if config.base_quantization is None:
        return []
    sites = families.of_config(model_config).lora_sites
    return list(dict.fromkeys(path for path, _, _ in sites.values()))


def quantized_base_state(state_dict: Mapping[str, Tensor], model_config: Any, config: LoRAConfig) -> dict[str, Tensor]:
    """A base state dict (recipe names, as ``init_from`` gives it) with each quantized projection's ``weight``
    replaced by its ``weight_codes`` and ``weight_scales`` (unchanged without ``base_quantization``). Deterministic,
    so every start of a run (a resume included) rebuilds the same codes."""
    out = dict(state_dict)
    for layer in range(model_config.n_layers):
        for path in quantized_paths(model_config, config):
            prefix = f"layers.{layer}.{path}."
            for suffix, tensor in quantized_state(out.pop(prefix + "weight"), config.base_quantization).items():
                out[prefix + suffix] = tensor
    return out


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's (any prefix)."""
    return any(marker in name for marker in ADAPTER_MARKERS)


def adapter_shapes(model_config: Any, config: LoRAConfig) -> dict[str, torch.Size]:
    """Adapter parameter name (in the family's model of ``model_config``) -> shape, computed on the meta device."""
    with torch.device("meta"):
        model = add_lora(families.of_config(model_config).model_class(model_config), config)
    return {name: p.shape for name, p in model.named_parameters() if is_adapter_name(name)}


def initial_adapter_state(model_config: Any, config: LoRAConfig, seed: int) -> dict[str, Tensor]:
    """Fresh adapter weights (fp32, CPU) drawn from ``seed`` alone: the same for every strategy, world size and
    device, unlike a shard-by-shard initialisation on each rank."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in adapter_shapes(model_config, config).items():
        tensor = torch.empty(shape)
        if ".lora_a." in name:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        else:
            nn.init.zeros_(tensor)
        out[name] = tensor
    return out


def check_adapter_state(
    state_dict: Mapping[str, Tensor], model_config: Any, config: LoRAConfig, *, source: str
) -> None:
    """Raise ``ValueError`` unless ``state_dict`` holds exactly the adapters of ``config`` with their shapes."""
    shapes = adapter_shapes(model_config, config)
    missing = sorted(set(shapes) - set(state_dict))
    unknown = sorted(set(state_dict) - set(shapes))
    if missing or unknown:
        raise ValueError(
            f"{source} does not hold the adapters of lora={config.to_dict()}: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unknown[:3]}{' ...' if len(unknown) > 3 else ''}."
            " Use the lora settings the checkpoint was trained with."
        )
    for name, shape in shapes.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{source}: adapter {name!r} has shape {tuple(state_dict[name].shape)}, expected "
                             f"{tuple(shape)} for lora.rank={config.rank}")


def lora_site(model_config: Any, target: str) -> LoRASite:
    """Where ``target`` sits in a block of the model of ``model_config`` (its family's ``lora_sites``)."""
    sites = families.of_config(model_config).lora_sites
    if target not in sites:
        raise ValueError(f"lora.targets names {target!r}, which the {families.name_of_config(model_config)!r} family's "
                         f"blocks do not have; choose among {list(sites)}")
    return sites[target]


def adapter_name(model_config: Any, layer: int, target: str, kind: str) -> str:
    """The model parameter name of ``target``'s A (``kind="lora_a"``) or B (``"lora_b"``) in block ``layer``."""
    return f"layers.{layer}.{lora_site(model_config, target)[0]}.{kind}.{target}.weight"


def merged_state_dict(
    base: Mapping[str, Tensor], adapters: Mapping[str, Tensor], model_config: Any, config: LoRAConfig
) -> dict[str, Tensor]:
    """The base weights with ``alpha / rank * B @ A`` added to each adapted row block (PEFT's
    ``merge_and_unload``), in the base's layout and dtype; the sum is taken in fp32. With ``base_quantization`` the
    base is first quantized and decoded (``quantized_paths``): the weights the adapters were trained on."""
    check_adapter_state(adapters, model_config, config, source="The LoRA checkpoint")
    merged = dict(base)
    quantized = quantized_base_state(base, model_config, config)
    for layer in range(model_config.n_layers):
        for path in quantized_paths(model_config, config):
            prefix = f"layers.{layer}.{path}."
            decoded = dequantize(quantized[prefix + CODES], quantized[prefix + SCALES], config.base_quantization)
            merged[prefix + "weight"] = decoded.to(base[prefix + "weight"].dtype)
    for layer in range(model_config.n_layers):
        for target in config.targets:
            path, block, blocks = lora_site(model_config, target)
            name = f"layers.{layer}.{path}.weight"
            weight = merged[name].float().clone()
            rows = weight.shape[0] // blocks
            b = adapters[adapter_name(model_config, layer, target, "lora_b")]
            a = adapters[adapter_name(model_config, layer, target, "lora_a")]
            weight[block * rows : (block + 1) * rows] += (b.float() @ a.float()) * config.scaling
            merged[name] = weight.to(base[name].dtype)
    return merged
