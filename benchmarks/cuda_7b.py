"""Throughput and MFU of a LLaMA-2-7B-shaped model trained through NPUFSDPStrategy on ONE CUDA GPU.

    python benchmarks/cuda_7b.py                         # H100/H200: 7B shape, 4 layers, bf16-mixed, AC on and off
    python benchmarks/cuda_7b.py --layers 8 --micro-batch 2 --out /tmp/cuda_7b.json
    python benchmarks/cuda_7b.py --device cpu            # dry run: a tiny model on the CPU, same code path

The plugin's strategy is device-agnostic: here it runs on ``accelerator="cuda"`` with one device, so the FSDP2 wrapping,
activation checkpointing, bf16 mixed precision and the recipe's LightningModule are the ones NPU runs use (the kernels
take their PyTorch reference paths: SDPA flash attention, RMSNorm/rotary/SwiGLU in PyTorch). Each variant (with and
without activation checkpointing of every TransformerBlock) runs in its own process so memory does not carry over.

Reported per variant: tokens/s (timed steps x micro-batch x sequence / the wall time of the timed steps, the device
synchronised at both ends), model TFLOP/s = tokens/s x ``LLaMAConfig.flops_per_token(seq)`` (6 N + 12 L S D, the
PaLM accounting), MFU = TFLOP/s / ``--peak-tflops`` (989, the H100/H200 dense bf16 peak), the allocator's peak
(``max_memory_allocated``) and the planner's estimate of that peak for the same run
(``lightning-npu plan``'s model with reference kernels, no HCCL buffers and no allowance).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 1024**3
H100_H200_BF16_DENSE_TFLOPS = 989.0
VARIANTS = {"no_ac": 0.0, "ac": 1.0}


def _model_fields(args: argparse.Namespace) -> tuple[str, dict[str, int]]:
    """(preset, overrides): the 7B shape with fewer layers on an accelerator; the tiny preset on the CPU."""
    if args.device == "cpu":
        return "tiny", {"max_seq_len": max(args.seq, 256)}
    return "7b", {"n_layers": args.layers, "max_seq_len": max(args.seq, 4096)}


def _planned_peak(args: argparse.Namespace, config: Any, ac_ratio: float) -> float:
    from lightning_npu.plan import ModelShape, PlanSpec, estimate

    spec = PlanSpec(
        model=ModelShape.of(config), seq_len=args.seq, micro_batch=args.micro_batch, devices=1,
        precision="bf16-mixed", wrap_blocks=True, ac_ratio=ac_ratio, kernels="reference",
        optimizer="foreach" if args.device != "cpu" else "per-tensor", hccl_buffsize_mb=0.0, workspace_gib=0.0, fragmentation=0.0,
        device_memory_gib=1024.0,
    )
    return estimate(spec).total


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, Dataset

    from lightning_npu import NPUFSDPStrategy
    from recipes.models.llama.model import TransformerBlock
    from recipes.decoder.module import DecoderLM

    torch.manual_seed(0)
    ac_ratio = VARIANTS[args.worker]
    preset, fields = _model_fields(args)
    module = DecoderLM(preset=preset, config=fields, warmup_steps=args.warmup)
    total = args.warmup + args.steps
    accelerated = args.device != "cpu"

    class Tokens(Dataset):
        def __len__(self) -> int:
            return total * args.micro_batch

        def __getitem__(self, index: int) -> dict[str, Any]:
            block = torch.randint(0, module.config.vocab_size, (args.seq + 1,),
                                  generator=torch.Generator().manual_seed(index))
            return {"input_ids": block[:-1].clone(), "labels": block[1:].clone()}

    # torch.<device type> (found through torch.accelerator, so nothing here names the device) has the same
    # synchronize / peak-memory functions on every torch since 2.0.
    device_module = getattr(torch, torch.accelerator.current_accelerator().type) if accelerated else None

    def sync() -> None:
        if device_module is not None:
            device_module.synchronize()

    class Clock(Callback):
        """Times the steps after warm-up; resets the allocator's peak when they start."""

        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == args.warmup:
                sync()
                if device_module is not None:
                    device_module.reset_peak_memory_stats()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == total - 1:
                sync()
                self.end = time.perf_counter()

    clock = Clock()
    strategy = NPUFSDPStrategy(
        auto_wrap_policy=[TransformerBlock],
        zero_stage=3,
        activation_checkpointing_policy=[TransformerBlock] if ac_ratio else None,
        activation_checkpointing_ratio=ac_ratio or 1.0,
    )
    trainer = Trainer(
        accelerator=args.device, devices=1, strategy=strategy, precision="bf16-mixed", max_steps=total,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, callbacks=[clock],
    )
    loader = DataLoader(Tokens(), batch_size=args.micro_batch)
    measured_peak = None
    if accelerated:
        trainer.fit(module, train_dataloaders=loader)
        measured_peak = device_module.max_memory_allocated()
    else:
        from benchmarks._memory import peak_bytes

        measured_peak = peak_bytes(lambda: trainer.fit(module, train_dataloaders=loader))
    seconds = clock.end - clock.start
    tokens_per_s = args.steps * args.micro_batch * args.seq / seconds
    flops_per_token = module.config.flops_per_token(args.seq)
    tflops = tokens_per_s * flops_per_token / 1e12
    result = {
        "variant": args.worker,
        "activation_checkpointing_ratio": ac_ratio,
        "device": args.device,
        "device_name": device_module.get_device_name() if device_module is not None else "cpu",
        "model": module.config.to_dict(),
        "params": module.config.num_params(),
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "timed_steps": args.steps,
        "seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "model_tflops": tflops,
        "mfu": tflops / args.peak_tflops if accelerated else None,
        "peak_memory_gib": measured_peak / GIB,
        "planned_peak_gib": _planned_peak(args, module.config, ac_ratio) / GIB,
    }
    Path(args.result).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="Lightning accelerator: cuda (default) or cpu for a dry run")
    parser.add_argument("--dry-run", action="store_true", help="the same as --device cpu")
    parser.add_argument("--layers", type=int, default=4, help="TransformerBlocks of the 7B shape (7B has 32)")
    parser.add_argument("--seq", type=int, help="tokens per sample (default 4096; 128 on the CPU)")
    parser.add_argument("--micro-batch", type=int, help="samples per step (default 4; 2 on the CPU)")
    parser.add_argument("--steps", type=int, help="timed steps (default 20; 4 on the CPU)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5; 2 on the CPU)")
    parser.add_argument("--peak-tflops", type=float, default=H100_H200_BF16_DENSE_TFLOPS,
                        help="the device's dense bf16 peak for MFU (default 989: H100/H200 SXM)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--worker", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    cpu = args.device == "cpu"
    for name, accelerated, dry in (("seq", 4096, 128), ("micro_batch", 4, 2), ("steps", 20, 4), ("warmup", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, dry if cpu else accelerated)
    if args.worker:
        worker(args)
        return 0

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for variant in variants:
            result = Path(workdir) / f"{variant}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--result", str(result),
                       "--device", args.device, "--layers", str(args.layers), "--seq", str(args.seq),
                       "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--peak-tflops", str(args.peak_tflops)]
            env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
                raise SystemExit(f"variant {variant} failed with exit status {proc.returncode}")
            results.append(json.loads(result.read_text()))
    first = results[0]
    print(f"{first['device_name']}: {first['params'] / 1e6:,.1f} M parameters ({first['model']['n_layers']} layers,"
          f" dim {first['model']['dim']}), seq {args.seq} x micro-batch {args.micro_batch}, bf16-mixed, ZeRO-3,"
          f" {args.steps} timed steps")
    print(f"{'variant':<8}{'tokens/s':>11}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}{'plan GiB':>10}")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['variant']:<8}{r['tokens_per_s']:>11.0f}{r['model_tflops']:>10.3g}{mfu:>8}"
              f"{r['peak_memory_gib']:>10.2f}{r['planned_peak_gib']:>10.2f}")
    Path(args.out).write_text(json.dumps({"peak_tflops": args.peak_tflops, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
