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

An expert target (``expert_gate``, ``expert_up``, ``expert_down``: ``DecoderFamily.expert_lora_sites``) gives every
expert of an MoE layer its own adapter, stacked on dim 0 as the experts' weights are (``StackedLoRA``, held in the
experts module's ``adapters`` by the adapted weight's name and applied inside its grouped matmuls); in the MoE
family::

    layers.{i}.feed_forward.experts.adapters.w_gate_up.lora_a.expert_gate.weight   [n_experts, rank, dim]
    layers.{i}.feed_forward.experts.adapters.w_gate_up.lora_b.expert_gate.weight   [n_experts, expert_hidden_dim, rank]
    layers.{i}.feed_forward.experts.adapters.w_down.lora_a.expert_down.weight      [n_experts, rank, expert_hidden_dim]
    layers.{i}.feed_forward.experts.adapters.w_down.lora_b.expert_down.weight      [n_experts, dim, rank]

With ``base_quantization`` (``int8`` or ``nf4``: QLoRA-style) every projection of every block that the family's
``lora_sites`` name is stored quantized, adapted or not (QLoRA quantizes all of a model's Linear layers; here the
embedding, the norms, the output projection and whatever ``lora_sites`` does not name stay as they are: an MoE
layer's router, stacked experts and shared expert, and its dense layers' MLP): an adapted one's ``LoRALinear`` holds
``weight_codes`` and ``weight_scales`` in place of ``weight``, an unadapted one becomes a
``lightning_npu.quant.QuantizedLinear`` with the same two. ``quantized_base_state`` turns a base state dict
(``init_from``'s) into those entries; ``merged_state_dict`` adds the adapters to the decoded quantized base, the
weights they were trained against.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Collection, Mapping, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_npu.kernels import grouped_matmul, quantized_linear
from lightning_npu.quant import QuantizedLinear, dequantize, quantized_state
from lightning_npu.quant.linear import CODES, SCALES
from lightning_npu.quant.weights import check_quantizable
from lightning_npu.parallel.expert import local_experts
from recipes import families
from recipes.decoder.layers import Linear
from recipes.decoder.lora_config import EXPERT_TARGETS, LoRAConfig

ADAPTER_MARKERS = (".lora_a.", ".lora_b.")


def init_lora_a(weight: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """PEFT's initialisation of an A [rank, in], in place: Kaiming uniform (a=sqrt(5), bound 1/sqrt(in)); a stacked
    [n_experts, rank, in] expert by expert, each with its own fan-in (PEFT's per-expert A). A sharded A (a DTensor:
    npu_fsdp initialises a model built on the meta device shard by shard) is drawn on this rank's shard, whose rows
    keep the fan-in ``in``."""
    from torch.distributed.tensor import DTensor

    local = weight.to_local() if isinstance(weight, DTensor) else weight
    with torch.no_grad():
        for matrix in local.view(-1, *local.shape[-2:]):
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5), generator=generator)
    return weight


class LoRAA(nn.Linear):
    """An adapter's down projection A [rank, in], initialised as PEFT does (Kaiming uniform, a=sqrt(5))."""

    def reset_parameters(self) -> None:
        init_lora_a(self.weight)


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
        # Dropout per adapter, as PEFT's separate gate_proj / up_proj layers draw their own masks.
        delta = row_block_update(out, self.blocks, self.rows, self.block_of,
                                 lambda name: self.lora_b[name](self.lora_a[name](self.dropout(x))))
        return out + delta * self.scaling


def row_block_update(like: Tensor, blocks: int, rows: int, block_of: Mapping[str, int],
                     update: Callable[[str], Tensor]) -> Tensor:
    """The adapters' update of a weight of ``blocks`` equal row blocks of ``rows``: ``update(name)`` for the block
    adapter ``name`` adapts (``block_of``), zeros (``like``'s leading shape and dtype) for a block without one (gate
    adapted, up not), side by side along the last dimension."""
    by_block = {block: name for name, block in block_of.items()}
    pieces = [like.new_zeros(*like.shape[:-1], rows) if by_block.get(block) is None else update(by_block[block])
              for block in range(blocks)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


class _StackedProjection(nn.Module):
    """A per-expert projection ``weight`` [n_experts, out, in] over rows sorted by expert (``counts[e]`` rows of
    expert e): each row times its expert's matrix, one grouped matmul (``lightning_npu.kernels.grouped_matmul``).
    Under expert parallelism the weight is this rank's block of experts (``local_experts``)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features, **factory))
        self.reset_parameters()

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        return grouped_matmul(rows, local_experts(self.weight).transpose(1, 2), counts)


class StackedLoRAA(_StackedProjection):
    """The experts' down projections A [n_experts, rank, in], each initialised as PEFT's (``init_lora_a``)."""

    def reset_parameters(self) -> None:
        init_lora_a(self.weight)


class StackedLoRAB(_StackedProjection):
    """The experts' up projections B [n_experts, rows, rank], zero so that fresh adapters change nothing."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class StackedLoRA(nn.Module):
    """Per-expert LoRA adapters on some equal row blocks of a stacked expert weight [n_experts, out, in] (its
    experts module adds this module's output to the weight's, see ``DecoderFamily.expert_lora_sites``).

    For the rows of expert e, adapter ``name`` adds ``B_e(A_e(dropout(x))) * alpha / rank`` to its row block: exactly
    a LoRA on each expert's own Linear, run as two grouped matmuls over the rows sorted by expert, like the base
    weight's. A is [n_experts, rank, in] and B [n_experts, rows, rank]: stacked on dim 0 as the experts are, so
    FSDP2 shards a few large tensors and expert parallelism gives each rank its experts' adapters."""

    def __init__(self, weight: Tensor, blocks: int, adapted: Mapping[str, int], config: LoRAConfig) -> None:
        super().__init__()
        n_experts, out_features, in_features = weight.shape
        self.rows, self.blocks, self.block_of = out_features // blocks, blocks, dict(adapted)
        self.scaling = config.scaling
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_a = nn.ModuleDict(
            {name: StackedLoRAA(n_experts, in_features, config.rank, **factory) for name in adapted})
        self.lora_b = nn.ModuleDict(
            {name: StackedLoRAB(n_experts, config.rank, self.rows, **factory) for name in adapted})

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The update [R, out] of rows [R, in] sorted by expert (``counts[e]`` of expert e)."""
        delta = row_block_update(rows, self.blocks, self.rows, self.block_of,
                                 lambda name: self.lora_b[name](self.lora_a[name](self.dropout(rows), counts), counts))
        return delta * self.scaling


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Add ``config``'s adapters to every block of ``model`` (a plain, unwrapped model of one of the recipe's
    families, real or on the meta device) in place and freeze every other parameter; an expert target adapts the
    blocks that have experts (not an MoE model's dense layers). Returns ``model``."""
    models = {name: family.model_class for name, family in families.all_families().items()}
    if not isinstance(model, tuple(models.values())):
        raise TypeError(f"add_lora takes a model of the recipe's families {sorted(models)}, got {type(model).__name__}")
    if any(isinstance(m, (LoRALinear, StackedLoRA)) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters; add_lora applies once, to a model built without them")
    for param in model.parameters():
        param.requires_grad_(False)
    # adapters' module path -> (the adapted weight's path, its row blocks, target -> block, experts' path or None)
    placed: dict[str, tuple[str, int, dict[str, int], Optional[str]]] = {}
    for name, (adapters, weight, block, blocks, experts) in _placements(model.config, config.targets).items():
        placed.setdefault(adapters, (weight, blocks, {}, experts))[2][name] = block
        if experts is not None and not any(_has_module(layer, experts) for layer in model.layers):
            raise ValueError(f"lora.targets names {name!r}, but no block of this model has experts ({experts}); adapt"
                             " its projections instead")
    quantized = quantized_paths(model.config, config)
    for layer in model.layers:
        for path in quantized:
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            linear = getattr(parent, leaf)
            check_quantizable(tuple(linear.weight.shape), config.base_quantization, f"{path}.weight")
            setattr(parent, leaf, QuantizedLinear.from_linear(linear, config.base_quantization))
        for adapters, (weight, blocks, adapted, experts) in placed.items():
            if experts is None:
                parent_path, _, leaf = adapters.rpartition(".")
                parent = layer.get_submodule(parent_path)
                setattr(parent, leaf, LoRALinear(getattr(parent, leaf), blocks, adapted, config))
            elif _has_module(layer, experts):
                module = layer.get_submodule(experts)
                if not isinstance(getattr(module, "adapters", None), nn.ModuleDict):
                    raise TypeError(f"{type(module).__name__} at {experts} has no `adapters` ModuleDict for the"
                                    " updates of its stacked weights (see DecoderFamily.expert_lora_sites)")
                leaf = weight.rpartition(".")[2]
                module.adapters[leaf] = StackedLoRA(getattr(module, leaf), blocks, adapted, config)
    return model


def quantized_paths(model_config: Any, config: LoRAConfig) -> list[str]:
    """The block submodules (``attention.wq`` ...) whose weights ``config`` stores quantized: every projection the
    family's ``lora_sites`` name (adapted or not), or none without ``base_quantization``."""
    if config.base_quantization is None:
        return []
    return list(dict.fromkeys(path for path, _, _ in lora_sites(model_config).values()))


def lora_sites(model_config: Any) -> dict[str, tuple[str, int, int]]:
    """The family's ``lora_sites`` that the blocks of the model of ``model_config`` have (found on the meta device):
    all of them but where the config leaves a projection out (DeepSeek's query is ``wq``, or ``wq_a`` and ``wq_b``
    with a ``q_lora_rank``)."""
    family = families.of_config(model_config)
    with torch.device("meta"):
        block = family.model_class(model_config).layers[0]
    return {target: site for target, site in family.lora_sites.items() if _has_module(block, site[0])}


def quantized_base_state(state_dict: Mapping[str, Tensor], model_config: Any, config: LoRAConfig) -> dict[str, Tensor]:
    """A base state dict (recipe names, as ``init_from`` gives it) with each quantized projection's ``weight``
    replaced by its ``weight_codes`` and ``weight_scales`` (unchanged without ``base_quantization``). Deterministic,
    so every start of a run (a resume included) rebuilds the same codes."""
    out = dict(state_dict)
    paths = quantized_paths(model_config, config)
    for layer in range(model_config.n_layers):
        for path in paths:
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
            init_lora_a(tensor, generator)
        else:
            nn.init.zeros_(tensor)
        out[name] = tensor
    return out


def active_adapter_params(model_config: Any, config: LoRAConfig) -> int:
    """The adapter parameters one token runs through (for FLOPs): every projection's adapters, and of an expert
    target's only those of the ``model_config.top_k`` experts the token is routed to."""
    shapes = adapter_shapes(model_config, config)
    total = 0
    for site in adapter_sites(model_config, config):
        for kind in ("lora_a", "lora_b"):
            shape = shapes[site.name(kind)]
            total += shape[1:].numel() * model_config.top_k if site.target in EXPERT_TARGETS else shape.numel()
    return total


def check_adapter_state(
    state_dict: Mapping[str, Tensor], model_config: Any, config: LoRAConfig, *, source: str,
    held: Optional[Collection[str]] = None,
) -> None:
    """Raise ``ValueError`` unless ``state_dict`` holds exactly the adapters of ``config`` with their shapes; with
    ``held``, exactly those of them a model holds (a pipeline stage holds its blocks' only)."""
    shapes = adapter_shapes(model_config, config)
    if held is not None:
        shapes = {name: shape for name, shape in shapes.items() if name in held}
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


class AdapterSite(NamedTuple):
    """One adapter a LoRA config adds to a model: block ``layer``'s ``target``, an update of row block ``block``
    (of ``blocks`` equal ones; rows are a weight's second-last dimension) of the base weight named ``weight`` (a
    state-dict name), its A and B held by the module named ``adapters``."""

    layer: int
    target: str
    weight: str
    block: int
    blocks: int
    adapters: str

    def name(self, kind: str) -> str:
        """The parameter name of its A (``kind="lora_a"``) or B (``"lora_b"``)."""
        return f"{self.adapters}.{kind}.{self.target}.weight"


def adapter_sites(model_config: Any, config: LoRAConfig) -> list[AdapterSite]:
    """Every adapter ``config`` adds to the model of ``model_config``, block by block (found on the meta device:
    an expert target only in the blocks with experts)."""
    with torch.device("meta"):
        blocks = families.of_config(model_config).model_class(model_config).layers
    placements = _placements(model_config, config.targets)
    sites = []
    for i, block in enumerate(blocks):
        for target in config.targets:
            adapters, weight, row_block, n_blocks, experts = placements[target]
            if experts is None or _has_module(block, experts):
                sites.append(AdapterSite(i, target, f"layers.{i}.{weight}", row_block, n_blocks,
                                         f"layers.{i}.{adapters}"))
    return sites


def _placements(model_config: Any, targets: tuple[str, ...]) -> dict[str, tuple[str, str, int, int, Optional[str]]]:
    """Where each of ``targets`` sits in a block of the model of ``model_config`` (``lora_sites`` or its family's
    ``expert_lora_sites``): (the path of the module holding its adapters, the adapted weight's path, its row block,
    the weight's row blocks, the experts module's path or None for a projection)."""
    family = families.of_config(model_config)
    sites = lora_sites(model_config)
    out = {}
    for target in targets:
        if target in sites:
            path, block, blocks = sites[target]
            out[target] = (path, f"{path}.weight", block, blocks, None)
        elif target in family.expert_lora_sites:
            experts, weight, block, blocks = family.expert_lora_sites[target]
            out[target] = (f"{experts}.adapters.{weight}", f"{experts}.{weight}", block, blocks, experts)
        elif target in family.lora_sites:
            raise ValueError(f"lora.targets names {target!r}, but this model's blocks have no "
                             f"{family.lora_sites[target][0]} (its config leaves it out); choose among "
                             f"{[*sites, *family.expert_lora_sites]}")
        else:
            raise ValueError(f"lora.targets names {target!r}, which the {families.name_of_config(model_config)!r} "
                             f"family's blocks do not have; choose among {[*family.lora_sites, *family.expert_lora_sites]}")
    return out


def _has_module(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def merged_state_dict(
    base: Mapping[str, Tensor], adapters: Mapping[str, Tensor], model_config: Any, config: LoRAConfig
) -> dict[str, Tensor]:
    """The base weights with ``alpha / rank * B @ A`` added to each adapted row block (PEFT's
    ``merge_and_unload``; expert by expert for a stacked expert weight), in the base's layout and dtype; the sum is
    taken in fp32. With ``base_quantization`` the base is first quantized and decoded (``quantized_paths``): the
    weights the adapters were trained on."""
    check_adapter_state(adapters, model_config, config, source="The LoRA checkpoint")
    merged = dict(base)
    quantized = quantized_base_state(base, model_config, config)
    paths = quantized_paths(model_config, config)
    for layer in range(model_config.n_layers):
        for path in paths:
            prefix = f"layers.{layer}.{path}."
            decoded = dequantize(quantized[prefix + CODES], quantized[prefix + SCALES], config.base_quantization)
            merged[prefix + "weight"] = decoded.to(base[prefix + "weight"].dtype)
    for site in adapter_sites(model_config, config):
        weight = merged[site.weight].float().clone()
        rows = weight.shape[-2] // site.blocks
        b, a = adapters[site.name("lora_b")].float(), adapters[site.name("lora_a")].float()
        weight[..., site.block * rows : (site.block + 1) * rows, :] += (b @ a) * config.scaling
        merged[site.weight] = weight.to(base[site.weight].dtype)
    return merged
