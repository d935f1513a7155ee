"""Will a model fit in NPU memory? Per-device peak memory of one training step under npu_fsdp, itemised, for
ZeRO-2 and ZeRO-3, with the verdict against the device memory and the largest micro-batch that fits.

    lightning-npu plan --config recipes/models/llama/configs/llama2_7b.yaml --devices 8 --device-memory 64
    lightning-npu plan --model-shape hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256,max_seq_len=8192 \\
        --devices 8 --precision bf16-mixed --seq-len 4096 --micro-batch 1
    lightning-npu plan --config recipes/models/llama/configs/llama3_8b_128k.yaml --nodes 2 --cp 16

The model comes from what it is given. A recipe config: the YAML is read, never run (no data, tokenizer or weights
are touched; placeholder paths are fine), and the model's memory profile is the ``memory_profile`` module next to
the model classes the config names (``recipes/models/llama/memory_profile.py``; the protocol is in
``lightning_npu.plan.profile``). Or a decoder given by its shapes (``--model-shape``; keys hidden, layers, heads,
kv_heads, ffn, vocab, max_seq_len), planned as a LLaMA-style decoder (RMSNorm, grouped-query attention with
rotary, SwiGLU MLP, untied embeddings, fp32 logits), each block an FSDP unit. Flags override the YAML; every npu_fsdp
option is a flag generated from its declaration (``--tensor-parallel-size``, ``--pipeline-schedule``, ...; ``--tp``,
``--cp``, ``--cp-algo``, ``--pp``, ``--pp-schedule`` and ``--microbatches`` are aliases: ``ALIASES``): tensor and
context parallelism plan one device's share of the split weights and of its part of each sequence, with Ulysses' or
ring attention's tensors.

The estimate replays one training step as the allocations and frees FSDP2, autograd and AdamW make
(``lightning_npu.plan.replay``). ``benchmarks/plan_accuracy.py`` checks it against the measured peak of real
training steps on the CPU (PyTorch reference kernels, 1 to 8 simulated devices, ZeRO-2/3, checkpointing,
fp32/bf16, tensor and context parallelism): within 5%, except gradient accumulation (6.7% low; probably the
unsharded gradients npu_fsdp keeps between non-stepping micro-batches). The ``fused`` activation counts (the NPU default) follow from which tensors
each torch_npu backward takes (``npu_*_backward`` signatures, checked in tests/plan/test_plan.py) and have not been
measured on an NPU. Nothing here imports torch.

Exit status: 0 when the configured zero_stage fits, 1 when it does not, 2 for a configuration it cannot plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any, Callable

from lightning_npu.plan import ModelShape, PlanError, load_spec, render, report
from lightning_npu.facts import weight_quant
from lightning_npu.facts.chips import DEFAULT_PLAN_CHIP
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.plan.spec import KERNELS, OPTIMIZERS

PROG = "lightning-npu plan"
#: Short flags of npu_fsdp options (``option_flag`` gives each option's full one).
ALIASES = {
    "tensor_parallel_size": ("--tp",),
    "context_parallel_size": ("--cp",),
    "context_parallel_algo": ("--cp-algo",),
    "pipeline_parallel_size": ("--pp",),
    "pipeline_schedule": ("--pp-schedule",),
    "pipeline_microbatches": ("--microbatches",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (one of them, or both: the shapes then replace the config's model)")
    model.add_argument("--config", help="recipe YAML (model / data / trainer sections)")
    model.add_argument("--model-shape", metavar="K=N,...",
                       help="decoder shapes: hidden=H,layers=L,heads=A,kv_heads=G,ffn=F,vocab=V,max_seq_len=S"
                       " (kv_heads defaults to heads)")
    model.add_argument("--profile", metavar="MODULE",
                       help="module or .py file defining lightning_npu_memory_profile(model), for a config that names"
                       " no model class by import path")
    parser.add_argument("--devices", type=int, help="devices per node (overrides trainer.devices)")
    parser.add_argument("--nodes", type=int, help="number of nodes (overrides trainer.num_nodes)")
    parser.add_argument("--micro-batch", type=int, help="samples per device per step (overrides data.batch_size;"
                        " default 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (overrides data.seq_len; default: the model's"
                        " max_seq_len)")
    parser.add_argument("--precision", help="overrides trainer.precision, e.g. bf16-mixed (default 32-true)")
    parser.add_argument("--ac-ratio", type=float, help="share of blocks that recompute activations (0..1)")
    parser.add_argument("--device-memory", type=float, help="GiB per device (default: the chip's)")
    parser.add_argument("--chip", default=DEFAULT_PLAN_CHIP,
                        help=f"chip name for the default memory and, on first-generation 910 chips, HCCL's"
                        f" 1/2/4/8 devices-per-node rule (default {DEFAULT_PLAN_CHIP})")
    parser.add_argument("--kernels", choices=KERNELS, default="fused",
                        help="fused: torch_npu kernels (default); reference: PyTorch paths; eager: S x S attention")
    parser.add_argument("--optimizer", choices=OPTIMIZERS,
                        help="AdamW's implementation: fused (default; the recipe's on NPUs), foreach (torch's default on"
                        " other accelerators), per-tensor (torch's on CPU tensors), adamw8bit (lightning_npu.optim."
                        "AdamW8bit, 8-bit moments; the default when the config's model says optimizer: adamw8bit)")
    parser.add_argument("--lora-base", choices=("none", *weight_quant.SCHEMES),
                        help="how a LoRA config's frozen base is stored (overrides model.lora.base_quantization): none"
                        " (the master dtype), int8 (per channel) or nf4 (blocks of 64)")
    parser.add_argument("--hccl-buffsize", type=float, help="HCCL_BUFFSIZE in MB (default: the environment's, or 200)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_option_arguments(parser)


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per npu_fsdp option, generated from its declaration (``FSDPOptions``: the name with dashes, its
    help), plus the short ``ALIASES``; a value replaces the config's ``trainer.strategy.init_args`` and is checked
    as the strategy checks it."""
    group = parser.add_argument_group(
        "npu_fsdp's options (each overrides the config's trainer.strategy.init_args; values as in YAML)")
    types = typing.get_type_hints(FSDPOptions)
    for spec in dataclasses.fields(FSDPOptions):
        flags = (option_flag(spec.name), *ALIASES.get(spec.name, ()))
        group.add_argument(*flags, dest=spec.name, metavar="VALUE", type=_parser_of(types[spec.name]),
                           help=f"{spec.metadata['help']} (default {spec.default!r})".replace("%", "%%"))


def option_flag(name: str) -> str:
    """The command-line flag of the npu_fsdp option ``name``."""
    return "--" + name.replace("_", "-")


def _parser_of(annotation: Any) -> Callable[[str], Any]:
    """How a flag's text becomes the option's value: as it is for a string option, else read as YAML (``2``,
    ``0.5``, ``true``, ``[1, 3, 3, 1]``), as in a config."""
    kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)] or [annotation]
    if all(kind is str or (typing.get_origin(kind) is typing.Literal
                           and all(isinstance(value, str) for value in typing.get_args(kind))) for kind in kinds):
        return str
    return _yaml_value


def _yaml_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a YAML value ({error})") from None


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(
            args.config, model_shape=ModelShape.parse(args.model_shape) if args.model_shape else None,
            profile=args.profile, devices=args.devices, nodes=args.nodes, micro_batch=args.micro_batch,
            seq_len=args.seq_len, precision=args.precision, ac_ratio=args.ac_ratio,
            device_memory_gib=args.device_memory, chip=args.chip, kernels=args.kernels, optimizer=args.optimizer,
            hccl_buffsize_mb=args.hccl_buffsize, lora_base=args.lora_base,
            **{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(FSDPOptions)},
        )
        plan = report(spec)
    except PlanError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render(spec, plan))
    return 0 if plan["stages"][str(spec.zero_stage)]["fits"] else 1
