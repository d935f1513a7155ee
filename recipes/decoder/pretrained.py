"""The first weights of a run from ``init_from`` (a Hugging Face directory or a recipe checkpoint), into a model of
any layout: plain (``npu_single``, ``npu_ddp``: the whole model), sharded (``npu_fsdp`` with TP, CP, EP and their
hybrids: DTensor shards), a pipeline stage (the stage's parameters only), a LoRA model (the base, with fresh adapters
or not) and a quantized LoRA base (``weight_codes`` / ``weight_scales`` in place of each projection's ``weight``).

From a Hugging Face directory every rank reads only what it holds (``load_hf_slices``): the headers, checked
against the config on every rank (one error on all before any tensor is read: ``check_hf_source``; the workers
run it when the model is configured, ``recipes/train.py`` does not yet run it before they start), then the slices of the files its own tensors cover, at
most ``hf_checkpoint.READ_BLOCK_BYTES`` of one at a time, straight into those tensors. A quantized base is
quantized per rank from the rows its own codes and scales stand for, in blocks of whole quantization blocks, so its
codes are bit-equal to quantizing the whole weight. A recipe checkpoint is read by rank 0, which sends every rank
its part (``set_model_state_dict(broadcast_from_rank0=True)``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from lightning_npu.quant import quantized_state
from lightning_npu.quant.linear import CODES, SCALES
from lightning_npu.facts import weight_quant
from recipes.decoder.lora import initial_adapter_state, quantized_base_state, quantized_paths
from recipes.decoder.lora_config import LoRAConfig


def load_pretrained(
    model: torch.nn.Module, path: str, config: Any, *, lora: Optional[LoRAConfig] = None, fresh_adapters: bool = False,
) -> None:
    """Copy weights from a Hugging Face directory or a recipe checkpoint into ``model`` (sharded or not, a pipeline
    stage or the whole model).

    With ``lora`` (a model with adapters) only the base weights are loaded (quantized first if
    ``lora.base_quantization`` says so), and with ``fresh_adapters`` the adapters get their first values too
    (``lora.initial_adapter_state`` from rank 0's seed). Either way the checks (names, shapes, config) reach every
    rank before a tensor is read, so all fail together with the same message.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from recipes.decoder.hf_checkpoint import is_hf_directory

    if is_hf_directory(path):
        load_hf_slices(model, path, config, lora=lora, fresh_adapters=fresh_adapters)
        return
    distributed = dist.is_available() and dist.is_initialized()
    state_dict: dict[str, Tensor] = {}
    problem: list[Optional[ValueError]] = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            state_dict = read_pretrained(path, config)
            if lora is not None:  # a quantized base's codes, quantized here (rank 0) and sent as they are
                state_dict = quantized_base_state(state_dict, config, lora)
            if lora is not None and fresh_adapters:
                state_dict.update(initial_adapter_state(config, lora, seed=torch.initial_seed()))
        except ValueError as error:  # CheckpointError included
            problem = [error]
    if distributed:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise problem[0]
    # Strict unless the adapters are left as they are (a resumed LoRA run: they come from its checkpoint); checked
    # over every rank's keys, since a pipeline stage holds only its own.
    if lora is None or fresh_adapters:
        check_keys(model, state_dict, distributed)
    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=distributed)
    set_model_state_dict(model, state_dict, options=options)


def check_hf_source(path: str, config: Any) -> tuple[Any, Any]:
    """The weights and the import plan of the Hugging Face directory ``path``, from its headers alone, after
    checking them against the model ``config`` the run is configured with: ``CheckpointError`` (a ``ValueError``)
    for a missing shard file, an index naming a tensor its file lacks, a tensor the config does not imply (name,
    shape, dtype), FP8 weights without their scales or a tied head that differs from the embedding;
    ``ValueError`` for a config.json of another shape. Nothing but headers (and a tied head) is read."""
    from recipes.decoder.hf_checkpoint import check_tied, open_hf_checkpoint

    source_config, weights, plan = open_hf_checkpoint(path)
    check_config(path, source_config, config)
    check_tied(plan, weights.stored, weights.read)
    return weights, plan


def load_hf_slices(
    model: torch.nn.Module, path: str, config: Any, *, lora: Optional[LoRAConfig] = None, fresh_adapters: bool = False
) -> None:
    """``load_pretrained`` from the Hugging Face directory ``path``, each rank reading only the slices of the files
    its own tensors (its shards of a sharded model, its pipeline stages' parameters) hold: every rank checks the
    headers (``check_hf_source``); a problem on any rank is raised on all before any tensor is read. A quantized
    base is quantized per rank from its own rows (``read_quantized_into``). Fresh adapters are drawn from rank 0's
    seed on every rank, each keeping its part of those it holds."""
    import torch.distributed as dist

    from recipes.decoder.hf_checkpoint import local_region, read_into

    distributed = dist.is_available() and dist.is_initialized()
    problem: Optional[ValueError] = None
    try:
        weights, plan = check_hf_source(path, config)
    except ValueError as error:  # CheckpointError included
        problem = error
    problems = [problem]
    if distributed:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    if any(problems):
        raise next(p for p in problems if p is not None)
    seed = [torch.initial_seed()]
    adapters: dict[str, Tensor] = {}
    if lora is not None and fresh_adapters:
        if distributed:
            dist.broadcast_object_list(seed, src=0)
        adapters = initial_adapter_state(config, lora, seed=seed[0])
    quantized = _quantized_weights(config, lora)
    if lora is None or fresh_adapters:
        expected = [key for name in plan.tensors
                    for key in ((quantized[name] + CODES, quantized[name] + SCALES) if name in quantized else (name,))]
        check_keys(model, {**dict.fromkeys(expected), **adapters}, distributed)
    held = model.state_dict()
    read_into({name: tensor for name, tensor in held.items() if name in plan.tensors}, weights, plan)
    if quantized:
        read_quantized_into({name: (held[prefix + CODES], held[prefix + SCALES])
                             for name, prefix in quantized.items() if prefix + CODES in held},
                            weights, plan, lora.base_quantization)
    with torch.no_grad():
        for name, full in adapters.items():
            if name in held:  # a pipeline stage holds its blocks' adapters only
                local, offset = local_region(held[name])
                local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])


def _quantized_weights(config: Any, lora: Optional[LoRAConfig]) -> dict[str, str]:
    """Base weight name -> the prefix of its codes and scales (``layers.0.attention.wq.``), for every projection a
    quantized LoRA base stores quantized (none without ``lora.base_quantization``)."""
    if lora is None:
        return {}
    return {f"layers.{layer}.{path}.weight": f"layers.{layer}.{path}."
            for layer in range(config.n_layers) for path in quantized_paths(config, lora)}


def read_quantized_into(targets: Mapping[str, tuple[Tensor, Tensor]], weights: Any, plan: Any, scheme: str) -> None:
    """Fill this process's part of each quantized weight's codes and scales (``targets``: base weight name ->
    (codes, scales), plain or DTensors) with the ``scheme`` quantization of the stored weight: only the rows this
    rank's codes and scales stand for are read, in blocks of whole rows that start and end on a quantization block
    (int8: a row; NF4: 64 consecutive elements), so that each block is quantized exactly as in the whole weight."""
    from recipes.decoder.hf_adapter import DEQUANTIZED_DTYPE, read_region
    from recipes.decoder.hf_checkpoint import READ_BLOCK_BYTES, local_region

    with torch.no_grad():
        for name, (codes, scales) in targets.items():
            rows, cols = plan.shapes[name]
            codes_local, codes_at = local_region(codes)
            scales_local, scales_at = local_region(scales)
            # The rows of the weight that this rank's codes rows and its scales cover.
            per_scale = cols if scheme == "int8" else weight_quant.NF4_BLOCK_SIZE  # weight elements per scale
            spans = [(codes_at[0], codes_at[0] + codes_local.shape[0]) if codes_local.numel() else None,
                     (scales_at[0] * per_scale // cols, -(-(scales_at[0] + scales_local.shape[0]) * per_scale // cols))
                     if scales_local.numel() else None]
            spans = [span for span in spans if span is not None]
            if not spans:
                continue
            step = 1 if scheme == "int8" else weight_quant.NF4_BLOCK_SIZE // math.gcd(cols, weight_quant.NF4_BLOCK_SIZE)
            first = min(lo for lo, _ in spans) // step * step
            last = min(rows, -(-max(hi for _, hi in spans) // step) * step)
            stored = weights.stored[plan.tensors[name][0].hf_name].dtype
            dtype = DEQUANTIZED_DTYPE if stored.is_floating_point and stored.itemsize == 1 else stored
            block = max(step, READ_BLOCK_BYTES // max(1, cols * dtype.itemsize) // step * step)
            for start in range(first, last, block):
                stop = min(start + block, last)
                whole_rows = torch.empty((stop - start, cols), dtype=dtype)
                read_region(whole_rows, (start, 0), plan.tensors[name], weights.read)
                state = quantized_state(whole_rows, scheme)
                _copy_overlap(codes_local, codes_at, state[CODES], start)
                _copy_overlap(scales_local, scales_at, state[SCALES], start * cols // per_scale)


def _copy_overlap(local: Tensor, offset: tuple[int, ...], block: Tensor, block_at: int) -> None:
    """Copy into ``local``, the region of a tensor starting at ``offset``, what it shares with ``block``, the whole
    rows of that tensor from row ``block_at``."""
    lo, hi = max(offset[0], block_at), min(offset[0] + local.shape[0], block_at + block.shape[0])
    if lo < hi:
        part = block[(slice(lo - block_at, hi - block_at),) + tuple(slice(o, o + n) for o, n in
                                                                     zip(offset[1:], local.shape[1:]))]
        local[lo - offset[0]:hi - offset[0]].copy_(part)


def check_config(path: str, source_config: Any, config: Any) -> None:
    """``ValueError`` unless the model ``config`` the run is configured with is the one at ``path``."""
    if source_config != config:
        raise ValueError(
            f"init_from={path!r} holds a model of shape {source_config} but the recipe is configured as {config};"
            " set model.preset / model.config to match the weights"
        )


def check_keys(model: torch.nn.Module, state_dict: Mapping[str, Any], distributed: bool) -> None:
    """RuntimeError on every rank if rank 0's ``state_dict`` lacks a key some rank's ``model`` holds, or holds one no
    rank's model does (a collective when ``distributed``)."""
    import torch.distributed as dist

    held = [sorted(model.state_dict())]
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, held[0])
        held = gathered
    problem = [None]
    if not distributed or dist.get_rank() == 0:
        keys = {key for keys in held for key in keys}
        missing, unexpected = sorted(keys - state_dict.keys()), sorted(state_dict.keys() - keys)
        if missing or unexpected:
            problem = [f"Error(s) in loading state_dict for {type(model).__name__}: missing key(s) {missing},"
                       f" unexpected key(s) {unexpected}"]
    if distributed:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise RuntimeError(problem[0])


def read_pretrained(path: str, config: Any) -> dict[str, Tensor]:
    """The weights at ``path`` (a Hugging Face directory or a recipe checkpoint), checked against ``config``."""
    from recipes.decoder.checkpoint_layout import check_state_dict, load_recipe_checkpoint
    from recipes.decoder.hf_checkpoint import is_hf_directory, load_hf_checkpoint

    source_config, state_dict = (load_hf_checkpoint if is_hf_directory(path) else load_recipe_checkpoint)(path)
    check_config(path, source_config, config)
    check_state_dict(state_dict, config, source=path)
    return state_dict
