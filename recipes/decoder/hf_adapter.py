"""The state-dict adapter of every model family: which stored Hugging Face tensors, at which place, make each recipe
tensor, as a *plan* over names and shapes (no tensor data), so that a process reads only the slices it holds.

A family's ``hf.py`` gives its name map (recipe name -> the transformers 5 names it is made of, concatenated along
dim 0: LLaMA's one-to-one names, a fused gate/up, the stacked experts ``mlp.experts.gate_up_proj`` / ``down_proj``)
and how its checkpoints store experts (``ExpertLayout``); the plan adds what stored checkpoints differ by:

- stacked experts stored one tensor per expert (``save_pretrained``'s layout, transformers 4's): expert ``j``'s
  gate and up projections fill rows ``[0, F)`` and ``[F, 2F)`` of row ``j`` of ``w_gate_up``, its down projection
  row ``j`` of ``w_down``. A read accepts either stored layout; an export writes the per-expert one.
- FP8 block-quantized weights (DeepSeek-V3's release: ``float8_e4m3fn`` codes, one fp32 ``weight_scale_inv`` per
  128 x 128 block): dequantized block by block as a slice is read (``read_region``).
- a tied model's ``lm_head.weight``: absent (Hugging Face saves the matrix once), or equal to the embedding.

``import_plan`` checks the stored names, shapes and dtypes against the config from the headers alone, before any
tensor is read. ``read_region`` fills any region of a recipe tensor (a rank's shard of it: ``hf_load.py``) from
the stored slices that cover it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from recipes import families
from recipes.decoder.checkpoint_layout import CheckpointError, describe_shape, expected_shapes, some_names

#: The token embedding and output head of every HF ``*ForCausalLM`` (the tied-embedding rules use them).
HF_EMBEDDING, HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: The block edge of the official FP8 checkpoints' scales (``weight_scale_inv`` [ceil(rows/128), ceil(cols/128)]).
FP8_BLOCK = 128
#: The stored name of an FP8 weight's block scales: the weight's name plus this.
FP8_SCALE_SUFFIX = "_scale_inv"
#: The dtype FP8 weights are dequantized to (what DeepSeek's own conversion writes).
DEQUANTIZED_DTYPE = torch.bfloat16
# Buffers that old HF checkpoints saved and that the recipe recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_STACKED_GATE_UP, _STACKED_DOWN = ".experts.gate_up_proj", ".experts.down_proj"
# Per-expert projection names any stored checkpoint may use, by kind (transformers 4 Mixtral's w1 / w3 / w2 or the
# others' gate_proj / up_proj / down_proj).
_EXPERT_KINDS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's checkpoints store its MoE layers: the MoE module's name in the layer (``.mlp.``, Mixtral's
    ``.block_sparse_moe.``; the name map's ``.mlp.`` is that) and one expert's projections' names (gate, up,
    down) ``save_pretrained`` writes."""

    module: str = ".mlp."
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class StoredTensor:
    """A stored tensor as its file's header describes it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Piece:
    """One stored HF tensor's place in a recipe tensor: it is the region ``offset[d] : offset[d] + shape[d]`` of
    every dim ``d``, without that region's leading dim when ``squeezed`` (one expert of a stacked tensor).
    ``scale``: the name of its FP8 block scales, if it is stored FP8."""

    hf_name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    squeezed: bool = False
    scale: Optional[str] = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.squeezed else self.shape


@dataclass(frozen=True)
class Plan:
    """Recipe tensor name -> the pieces that tile it (in recipe order); ``tied``: stored names that must hold equal
    tensors (a tied model's stored ``lm_head.weight`` and embedding) and are checked when read."""

    tensors: dict[str, tuple[Piece, ...]]
    shapes: dict[str, tuple[int, ...]]
    tied: tuple[tuple[str, str], ...] = field(default=())

    def hf_names(self) -> list[str]:
        return [piece.hf_name for pieces in self.tensors.values() for piece in pieces]


def _hf_format(config: Any) -> Any:
    return families.of_config(config).hf


def expert_layout(config: Any) -> ExpertLayout:
    """The per-expert layout the family of ``config`` stores (its ``hf.py``'s ``expert_layout``, else the default)."""
    layout = _hf_format(config).expert_layout
    return ExpertLayout() if layout is None else layout(config)


def _split_rows(ours_shape: tuple[int, ...], theirs: Sequence[str]) -> list[Piece]:
    rows = ours_shape[0] // len(theirs)
    rest = tuple(ours_shape[1:])
    return [Piece(hf, (i * rows,) + (0,) * len(rest), (rows,) + rest) for i, hf in enumerate(theirs)]


def _per_expert(stacked: str, shape: tuple[int, ...], names: Mapping[str, str]) -> list[Piece]:
    """The per-expert pieces of the stacked ``stacked`` (transformers 5 name) of ``shape``: ``names`` maps
    (expert, kind) keys ``"{j}.{kind}"`` to the stored (canonical) name."""
    experts, rows, cols = shape
    prefix = stacked.rsplit(".", 1)[0]
    kinds = ("gate", "up") if stacked.endswith(_STACKED_GATE_UP) else ("down",)
    part = rows // len(kinds)
    pieces = []
    for j in range(experts):
        for k, kind in enumerate(kinds):
            pieces.append(Piece(names.get(f"{prefix}.{j}.{kind}", f"{prefix}.{j}.{kind}"), (j, k * part, 0),
                                (1, part, cols), squeezed=True))
    return pieces


def export_plan(config: Any) -> Plan:
    """The HF tensors an export of a model of ``config`` writes (``save_pretrained``'s layout: one tensor per
    expert, under the family's names; no ``lm_head.weight`` for a tied model), as pieces of the recipe tensors."""
    layout = expert_layout(config)
    gate, up, down = layout.projections
    shapes = {name: tuple(shape) for name, shape in expected_shapes(config).items()}
    tensors: dict[str, tuple[Piece, ...]] = {}
    for ours, theirs in _hf_format(config).name_map(config).items():
        if config.tie_embeddings and theirs == (HF_HEAD,):
            continue  # tied: Hugging Face stores the matrix once, as the embedding (and ties lm_head at load)
        if len(theirs) == 1 and theirs[0].endswith((_STACKED_GATE_UP, _STACKED_DOWN)):
            prefix = theirs[0].rsplit(".", 1)[0].replace(".mlp.", layout.module)
            names = {f"{theirs[0].rsplit('.', 1)[0]}.{j}.{kind}": f"{prefix}.{j}.{projection}.weight"
                     for j in range(shapes[ours][0])
                     for kind, projection in (("gate", gate), ("up", up), ("down", down))}
            tensors[ours] = tuple(_per_expert(theirs[0], shapes[ours], names))
        else:
            tensors[ours] = tuple(_split_rows(shapes[ours], [hf.replace(".mlp.", layout.module) for hf in theirs]))
    return Plan(tensors, shapes)


def import_plan(config: Any, stored: Mapping[str, StoredTensor], *, source: str = "The Hugging Face checkpoint") -> Plan:
    """The plan that reads a model of ``config`` from the stored tensors ``stored`` (name -> header entry), after
    checking them against ``config``: every tensor the model needs is there with the shape ``config`` implies, no
    tensor is left over (rotary buffers and what the family drops aside), every FP8 weight has its block scales of
    the right shape, and a stored expert layer holds every expert. Raises ``CheckpointError`` naming the tensor."""
    hf = _hf_format(config)
    layout = expert_layout(config)
    shapes = {name: tuple(shape) for name, shape in expected_shapes(config).items()}
    canonical = {name.replace(layout.module, ".mlp."): name for name in stored}
    dropped = set(hf.dropped_names(config, canonical)) if hf.dropped_names is not None else set()
    per_expert: dict[str, str] = {}  # "{layer prefix}.experts.{j}.{kind}" -> stored name
    expert_names: set[str] = set()
    for name in canonical:
        match = _PER_EXPERT.match(name)
        if match is not None and name not in dropped:
            per_expert[f"{match.group(1)}.{match.group(2)}.{_EXPERT_KINDS[match.group(3)]}"] = canonical[name]
            expert_names.add(name)
    tensors: dict[str, tuple[Piece, ...]] = {}
    tied: list[tuple[str, str]] = []
    for ours, theirs in hf.name_map(config).items():
        shape = shapes[ours]
        if len(theirs) == 1 and theirs[0].endswith((_STACKED_GATE_UP, _STACKED_DOWN)) and theirs[0] not in canonical:
            _check_experts(theirs[0], shape[0], per_expert)
            pieces = _per_expert(theirs[0], shape, per_expert)
        elif config.tie_embeddings and theirs == (HF_HEAD,):
            if HF_HEAD in canonical:
                tied.append((canonical[HF_HEAD], canonical.get(HF_EMBEDDING, HF_EMBEDDING)))
            pieces = [Piece(canonical.get(HF_EMBEDDING, HF_EMBEDDING), (0,) * len(shape), shape)]
        else:
            pieces = [replace(p, hf_name=canonical.get(p.hf_name, p.hf_name))
                      for p in _split_rows(shape, theirs)]
        tensors[ours] = tuple(_checked(piece, ours, stored, config, source) for piece in pieces)
    plan = Plan(tensors, shapes, tuple(tied))
    used = set(plan.hf_names()) | {p.scale for ps in tensors.values() for p in ps if p.scale} | {h for h, _ in tied}
    unknown = [name for canonical_name, name in canonical.items() if name not in used
               and canonical_name not in dropped and not name.endswith(_IGNORED_SUFFIXES)]
    orphan_scales = [name for name in unknown if name.endswith(FP8_SCALE_SUFFIX)]
    if orphan_scales:
        weight = orphan_scales[0].removesuffix(FP8_SCALE_SUFFIX)
        raise CheckpointError(f"{source} has {orphan_scales[0]!r} but not the FP8 weight {weight!r} it scales"
                              " (or that weight is not a tensor of the model).")
    if unknown:
        raise CheckpointError(
            f"{source} has {len(unknown)} tensor(s) that the recipe's model of this config.json "
            f"({type(config).__name__}) does not: {some_names(unknown)}. Only checkpoints of the architecture its"
            " family implements can be converted."
        )
    return plan


# (layer prefix ``model.layers.N.mlp.experts``, expert index, projection) of a per-expert tensor.
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _check_experts(stacked: str, n_experts: int, per_expert: Mapping[str, str]) -> None:
    prefix = stacked.rsplit(".", 1)[0]
    kinds = ("gate", "up") if stacked.endswith(_STACKED_GATE_UP) else ("down",)
    for kind in kinds:
        held = sorted(int(key[len(prefix) + 1:].split(".")[0]) for key in per_expert
                      if key.startswith(prefix + ".") and key.endswith("." + kind))
        if held != list(range(n_experts)):
            raise CheckpointError(
                f"The Hugging Face checkpoint holds the {kind} projection of experts {held} in {prefix}, but"
                f" config.json has {n_experts} experts (0 .. {n_experts - 1}). Is a weight shard missing?"
            )


def _checked(piece: Piece, ours: str, stored: Mapping[str, StoredTensor], config: Any, source: str) -> Piece:
    entry = stored.get(piece.hf_name)
    if entry is None:
        raise CheckpointError(
            f"{source} lacks {piece.hf_name!r} (needed for {ours!r}). Is a weight shard missing, "
            f"or does num_hidden_layers={config.n_layers} in config.json overstate the layers?"
        )
    if tuple(entry.shape) != piece.hf_shape:
        raise CheckpointError(
            f"Hugging Face tensor {piece.hf_name!r} has shape {tuple(entry.shape)} but config.json "
            f"({describe_shape(config)}) implies {piece.hf_shape}. The weights and config.json disagree."
        )
    if not _is_fp8(entry.dtype):
        return piece
    scale = piece.hf_name + FP8_SCALE_SUFFIX
    if scale not in stored:
        raise CheckpointError(
            f"{source} stores {piece.hf_name!r} as {entry.dtype} without its block scales {scale!r}: FP8 weights are"
            f" read only block-quantized (one fp32 scale per {FP8_BLOCK} x {FP8_BLOCK} block, DeepSeek-V3's release)."
            " Is a weight shard missing?"
        )
    rows, cols = entry.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(stored[scale].shape) != blocks:
        raise CheckpointError(
            f"{scale!r} has shape {tuple(stored[scale].shape)}, but {piece.hf_name!r} {tuple(entry.shape)} in"
            f" {FP8_BLOCK} x {FP8_BLOCK} blocks needs {blocks}; only block-quantized FP8 (DeepSeek-V3's) is read."
        )
    return replace(piece, scale=scale)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


# --------------------------------------------------------------------------------------------------
# Reading regions
# --------------------------------------------------------------------------------------------------

#: Reads the slice ``index`` (one slice per stored dim) of the stored tensor ``name``.
ReadSlice = Callable[[str, tuple[slice, ...]], Tensor]


def dequantize_blocks(codes: Tensor, scale_inv: Tensor, start: tuple[int, int]) -> Tensor:
    """The FP8 ``codes`` of a slice starting at ``start`` (row, col) of a block-quantized weight, times the block
    scales ``scale_inv`` of the blocks the slice touches (from block ``start // FP8_BLOCK``), as
    ``DEQUANTIZED_DTYPE``."""
    rows, cols = codes.shape
    r, c = start[0] % FP8_BLOCK, start[1] % FP8_BLOCK
    full = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[r:r + rows, c:c + cols]
    return (codes.float() * full).to(DEQUANTIZED_DTYPE)


def read_piece(piece: Piece, index: tuple[slice, ...], read: ReadSlice) -> Tensor:
    """The slice ``index`` (stored dims) of ``piece``'s stored tensor, dequantized if it is FP8."""
    if piece.scale is None:
        return read(piece.hf_name, index)
    blocks = tuple(slice(s.start // FP8_BLOCK, -(-s.stop // FP8_BLOCK)) for s in index)
    return dequantize_blocks(read(piece.hf_name, index), read(piece.scale, blocks), (index[0].start, index[1].start))


def read_region(target: Tensor, offset: Sequence[int], pieces: Sequence[Piece], read: ReadSlice) -> None:
    """Fill ``target``, the region of a recipe tensor starting at ``offset``, from the stored slices of ``pieces``
    that overlap it (each read once, only its overlap)."""
    for piece in pieces:
        lo = [max(o, p) for o, p in zip(offset, piece.offset)]
        hi = [min(o + n, p + m) for o, n, p, m in zip(offset, target.shape, piece.offset, piece.shape)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        index = tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, piece.offset))
        data = read_piece(piece, index[1:] if piece.squeezed else index, read)
        target[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))].copy_(
            data.unsqueeze(0) if piece.squeezed else data)


def read_whole(name: str, plan: Plan, stored: Mapping[str, StoredTensor], read: ReadSlice) -> Tensor:
    """The whole recipe tensor ``name``, in its stored dtype (FP8 dequantized to ``DEQUANTIZED_DTYPE``)."""
    pieces = plan.tensors[name]
    dtype = stored[pieces[0].hf_name].dtype
    out = torch.empty(plan.shapes[name], dtype=DEQUANTIZED_DTYPE if _is_fp8(dtype) else dtype)
    read_region(out, (0,) * out.dim(), pieces, read)
    return out


def check_tied(plan: Plan, stored: Mapping[str, StoredTensor], read: ReadSlice, *, rows: int = 4096) -> None:
    """Raise ``CheckpointError`` unless every pair of ``plan.tied`` holds equal tensors (compared ``rows`` rows at a
    time, so that the check holds no whole matrix)."""
    for head, embedding in plan.tied:
        a, b = stored[head], stored.get(embedding)
        equal = b is not None and a.shape == b.shape
        for start in range(0, a.shape[0] if equal else 0, rows):
            index = (slice(start, min(start + rows, a.shape[0])),) + tuple(slice(0, n) for n in a.shape[1:])
            if not torch.equal(read(head, index), read(embedding, index)):
                equal = False
                break
        if not equal:
            raise CheckpointError(
                f"config.json sets tie_word_embeddings=true but {HF_HEAD!r} differs from {HF_EMBEDDING!r}; "
                "a tied model has one matrix. Set tie_word_embeddings=false if the checkpoint is untied."
            )
