"""A PlanSpec from what the user gives: a LightningCLI YAML (model / data / trainer sections, read, never run),
explicit decoder shapes, or both (the shapes then replace the config's model), with keyword overrides winning."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning_npu.facts import env
from lightning_npu.facts.chips import DEFAULT_PLAN_CHIP
from lightning_npu.facts.options import FSDPOptions, check_option_names
from lightning_npu.plan.decoder import DecoderProfile
from lightning_npu.plan.posttrain import post_training_from_config
from lightning_npu.plan.profile import class_arguments, class_paths, find_profile, load_profile
from lightning_npu.plan.spec import (
    DEFAULT_HCCL_BUFFSIZE_MB,
    DEFAULT_P2P_BUFFSIZE_MB,
    ModelShape,
    PlanError,
    PlanSpec,
    canonical_precision,
    chip_memory_gib,
)

#: What the planner assumes where a config does not say: one device per node (the count Lightning's "auto" would
#: find is the machine's, so ``--devices`` overrides), Lightning's default precision, no accumulation.
TRAINER_DEFAULTS = {"devices": 1, "num_nodes": 1, "precision": "32-true", "accumulate_grad_batches": 1}
#: Without data.batch_size or --micro-batch the plan is for one sample per device (the table says the largest
#: that fits); without data.seq_len or --seq-len, for the model's longest sequence.
DEFAULT_MICRO_BATCH = 1


def load_spec(
    path: Optional[str | os.PathLike] = None,
    *,
    model_shape: Optional[ModelShape] = None,
    profile: Optional[str] = None,
    devices: Optional[int] = None,
    nodes: Optional[int] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    precision: Optional[str] = None,
    ac_ratio: Optional[float] = None,
    device_memory_gib: Optional[float] = None,
    chip: Optional[str] = None,
    kernels: str = "fused",
    optimizer: Optional[str] = None,
    hccl_buffsize_mb: Optional[float] = None,
    lora_base: Optional[str] = None,
    **strategy: Any,
) -> PlanSpec:
    """A PlanSpec from a recipe YAML at ``path`` and/or the decoder shape ``model_shape``; keyword arguments win.

    The model's memory profile comes from ``model_shape`` if given, else from the config (``profile``, a module,
    or the config's class paths: see ``lightning_npu.plan.profile``). ``optimizer`` defaults to ``adamw8bit`` when the
    config's model section says ``optimizer: adamw8bit``, else to ``fused``. With both a config and ``model_shape``
    the shapes replace the config's model, and a LoRA config's adapters sit on them. ``lora_base`` (``none``,
    ``int8``, ``nf4``) replaces the adapters' ``base_quantization``; it needs a LoRA run. ``strategy``: npu_fsdp options
    (``FSDPOptions``, by their names; ``None``: the config's) that replace the config's
    ``trainer.strategy.init_args``, checked as the strategy checks them; ``zero_stage`` is also the stage the plan
    judges. The P2P buffers are the environment's ``P2P_HCCL_BUFFSIZE`` or torch_npu's default."""
    if path is None and model_shape is None:
        raise PlanError("nothing to plan: give a recipe config (--config) or the model's shapes (--model-shape)")
    document = _read_yaml(Path(path)) if path is not None else {}
    model_section, data, trainer = (_section(document, name) for name in ("model", "data", "trainer"))
    data = class_arguments(data)
    if path is not None:
        where, function = find_profile(Path(path), class_paths(document), profile)
        decoder = load_profile(function, where, model_section)
    if model_shape is not None:
        adapters = decoder.adapters if path is not None else None
        decoder = DecoderProfile(model_shape, name="decoder (--model-shape)", adapters=adapters)
    if lora_base is not None:
        decoder = _with_lora_base(decoder, lora_base)
    init_args = _strategy(trainer) if path is not None else {}
    flags = {key: value for key, value in strategy.items() if value is not None}
    notes = []
    options = _options(init_args, flags, path)
    ac_policy = _class_names(options.activation_checkpointing_policy, "activation_checkpointing_policy", decoder)
    wrap = _class_names(options.auto_wrap_policy, "auto_wrap_policy", decoder)
    ratio = float(options.activation_checkpointing_ratio) if ac_policy else 0.0
    decoder = decoder.with_expert_parallelism(options.expert_parallel_size)
    if ac_ratio is not None:
        ratio = float(ac_ratio)
        if ratio > 0 and not ac_policy and path is not None:
            notes.append(f"--ac-ratio applies activation checkpointing to {_block_name(decoder)}, which the YAML does"
                         " not")
    memory = device_memory_gib if device_memory_gib is not None else chip_memory_gib(chip or DEFAULT_PLAN_CHIP)
    buffsize = hccl_buffsize_mb
    if buffsize is None:
        buffsize = float(os.environ.get(env.HCCL_BUFFSIZE, DEFAULT_HCCL_BUFFSIZE_MB))
    settings = {**TRAINER_DEFAULTS, **trainer}
    post_training = post_training_from_config(class_arguments(model_section), lora=decoder.adapters is not None)
    sequences_per_row = post_training.sequences_per_row if post_training is not None else 1
    try:
        return PlanSpec(
            model=decoder.shape,
            profile=decoder,
            seq_len=int(seq_len if seq_len is not None else data.get("seq_len", decoder.shape.max_seq_len)),
            micro_batch=int(micro_batch if micro_batch is not None
                            else data.get("batch_size", DEFAULT_MICRO_BATCH) * sequences_per_row),
            devices=devices if devices is not None else _devices(settings["devices"]),
            nodes=int(nodes if nodes is not None else settings["num_nodes"]),
            precision=canonical_precision(precision if precision is not None else settings["precision"]),
            accumulate_grad_batches=int(settings["accumulate_grad_batches"]),
            wrap_blocks=bool(wrap) or path is None,  # shapes alone: each block is an FSDP unit, as npu_fsdp advises
            ac_ratio=ratio,
            kernels=kernels,
            optimizer=optimizer or ("adamw8bit" if class_arguments(model_section).get("optimizer") == "adamw8bit"
                                    else "fused"),
            hccl_buffsize_mb=buffsize,
            device_memory_gib=float(memory),
            chip=chip or DEFAULT_PLAN_CHIP,
            options=options,
            p2p_buffsize_mb=float(os.environ.get(env.P2P_HCCL_BUFFSIZE, DEFAULT_P2P_BUFFSIZE_MB)),
            notes=tuple(notes),
            post_training=post_training,
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, PlanError):
            raise
        raise PlanError(f"config {str(path)!r}: {error}") from None


def _with_lora_base(decoder: DecoderProfile, lora_base: str) -> DecoderProfile:
    """``decoder`` with its adapters' base stored as ``lora_base`` says (``none``: unquantized)."""
    if decoder.adapters is None:
        raise PlanError(f"--lora-base {lora_base} sets how a LoRA run stores its frozen base, but {decoder.name} trains"
                        " every weight: give a config whose model has lora: (llama2_7b_lora.yaml, for one)")
    scheme = None if lora_base == "none" else lora_base
    return dataclasses.replace(decoder, adapters=dataclasses.replace(decoder.adapters, base_quantization=scheme))


def _read_yaml(path: Path) -> Mapping[str, Any]:
    import yaml

    if not path.is_file():
        raise PlanError(
            f"config {str(path)!r} does not exist; give a recipe YAML such as recipes/models/llama/configs/tiny.yaml"
        )
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise PlanError(f"config {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(document, Mapping):
        raise PlanError(f"config {str(path)!r} must be a mapping with model:, data: and trainer: sections")
    return document


def _section(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = document.get(name) or {}
    if not isinstance(value, Mapping):
        raise PlanError(f"'{name}:' in the config must be a mapping, not {type(value).__name__} ({value!r})")
    return value


def _devices(value: Any) -> int:
    if isinstance(value, bool):
        raise PlanError(f"trainer.devices={value!r} is not a device count; give a number such as 8")
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value:
        return len(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit() and int(text) >= 1:
            return int(text)
        ids = [part for part in text.rstrip(",").split(",") if part.strip()]
        if "," in text and all(part.strip().isdigit() for part in ids):
            return len(ids)
    raise PlanError(
        f"trainer.devices={value!r} depends on the machine the run starts on; pass --devices N (devices per node)"
    )


def _block_name(profile: DecoderProfile) -> str:
    return (profile.block_class or "the model's blocks").rpartition(".")[2]


def _class_names(policy: Any, option: str, profile: DecoderProfile) -> list[str]:
    """The class names of a policy, each of which must be the profile's block (the only unit the replay models)."""
    if policy is None:
        return []
    entries = [policy] if isinstance(policy, str) else list(policy)
    names = [str(entry).rpartition(".")[2] for entry in entries]
    block = _block_name(profile) if profile.block_class else None
    unknown = [name for name in names if name != block] if block else names[1:]
    if unknown:
        expected = f"[{profile.block_class}]" if profile.block_class else "one block class"
        raise PlanError(
            f"{option}={policy!r}: the planner models {profile.name}'s {block or 'block'} units only, not"
            f" {', '.join(unknown)}; use {expected}"
        )
    return names


def _options(init_args: Mapping[str, Any], flags: Mapping[str, Any], path: Optional[str | os.PathLike]
             ) -> FSDPOptions:
    """npu_fsdp's options from the config's ``init_args`` (its defaults where they are silent) and the flags, checked
    as the strategy checks them: an unknown name with the closest option, a bad value with the fix."""
    where = f"config {str(path)!r}"
    try:
        check_option_names(init_args, f"{where}: trainer.strategy.init_args")
        check_option_names(flags, "load_spec")
        return FSDPOptions(**{**init_args, **flags})
    except TypeError as error:
        raise PlanError(str(error)) from None
    except ValueError as error:
        raise PlanError(f"{where}: {error}" if path is not None else str(error)) from None


def _strategy(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """npu_fsdp init args from ``trainer.strategy`` (a registered name or class_path + init_args)."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, Mapping):
        class_path = str(strategy.get("class_path", ""))
        if class_path.rpartition(".")[2] != "NPUFSDPStrategy":
            raise PlanError(
                f"trainer.strategy.class_path={class_path!r}: the planner models npu_fsdp (FSDP2) only; use"
                " class_path: lightning_npu.NPUFSDPStrategy"
            )
        args = strategy.get("init_args") or {}
        if not isinstance(args, Mapping):
            raise PlanError(f"trainer.strategy.init_args must be a mapping, not {args!r}")
        return dict(args)
    if strategy == "npu_fsdp":
        return {}
    raise PlanError(
        f"trainer.strategy={strategy!r}: the planner models npu_fsdp (FSDP2) only; set trainer.strategy to"
        " npu_fsdp or to class_path: lightning_npu.NPUFSDPStrategy with init_args"
    )
