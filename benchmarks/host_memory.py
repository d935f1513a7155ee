"""Peak host memory (RSS) per rank while a ~1B-parameter LLaMA is set up under ``npu_fsdp`` and loaded from
Hugging Face weights (``init_from``), 2 simulated NPUs (LIGHTNING_NPU_SIMULATE=2, CPU, gloo) under torchrun.

    python benchmarks/host_memory.py                                   # setup cases + init_from (this tree)
    git worktree add --detach /tmp/before b745785~1                    # init_from before "only rank 0 reads"
    python benchmarks/host_memory.py --before-root /tmp/before         # ... adds init_from on that tree
    python benchmarks/host_memory.py --cases configure_model --dim 1024 --layers 4   # a quick small run

Each case is one ``python -m torch.distributed.run --standalone --nproc-per-node 2`` of this file fitting the
recipe's ``DecoderLM`` (``max_steps=0``: setup, ``on_fit_start``, no step) with
``Trainer(accelerator="npu", devices=2, strategy=NPUFSDPStrategy(), precision="32-true")``. Setup cases:

- ``configure_model``: the model is built in ``configure_model`` for real; npu_fsdp builds it for real on rank 0
  only (the other ranks on the meta device) and sends rank 0's values to every rank after sharding;
- ``init``: the model is built in ``__init__``, so every rank holds a full copy before sharding;
- ``meta_reset``: the recipe's own path: the meta device everywhere, then ``reset_parameters`` shard by shard.

``init_from``: the recipe's path (``meta_reset``), then ``DecoderLM.on_fit_start`` loads a bf16 safetensors
``LlamaForCausalLM`` checkpoint (made once with ``transformers`` under ``--hf-dir``) through ``load_pretrained``.
``--before-root`` runs the same case with another checkout's ``lightning_npu`` and ``recipes`` (PYTHONPATH).

Per rank: ``baseline`` is the resident set (``/proc/self/statm``) just before the measured phase starts
(setup cases: after imports and the Trainer, before the LightningModule exists; init_from: in ``on_fit_start``
before ``load_pretrained``, the shards already initialised); ``peak`` is ``getrusage(RUSAGE_SELF).ru_maxrss``
right after it (setup cases: the callbacks' ``on_fit_start``, after the strategy's setup; init_from: after
``load_pretrained``). The table shows peak - baseline, the host memory the phase needed on top of what the
process already held. ``ru_maxrss`` never decreases, so each case is its own pair of processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
GB = 1e9
SETUP_CASES = ("configure_model", "init", "meta_reset")
CASES = (*SETUP_CASES, "init_from")


def _rss_bytes() -> int:
    """The resident set now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    """The largest resident set this process has had (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"vocab_size": args.vocab, "dim": args.dim, "n_layers": args.layers, "n_heads": args.heads,
            "n_kv_heads": args.heads, "ffn_hidden_dim": args.ffn, "max_seq_len": args.max_seq_len,
            "norm_eps": 1e-5, "rope_theta": 10000.0}


# -------------------------------------------------------------------------------------------- the HF checkpoint


def make_checkpoint(args: argparse.Namespace) -> None:
    """A randomly initialised bf16 ``LlamaForCausalLM`` with the benchmark's shape, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of 1B parameters
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.max_seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).save_pretrained(args.hf_dir, safe_serialization=True)


def _checkpoint_matches(args: argparse.Namespace) -> bool:
    config = Path(args.hf_dir) / "config.json"
    if not config.is_file() or not any(Path(args.hf_dir).glob("*.safetensors")):
        return False
    saved = json.loads(config.read_text())
    return (saved.get("hidden_size"), saved.get("num_hidden_layers"), saved.get("intermediate_size"),
            saved.get("vocab_size"), saved.get("num_attention_heads"), saved.get("max_position_embeddings")) == (
        args.dim, args.layers, args.ffn, args.vocab, args.heads, args.max_seq_len)


# ------------------------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    import lightning_npu
    from lightning_npu import NPUFSDPStrategy
    from recipes.models.llama.model import LLaMA
    from recipes.decoder.module import DecoderLM

    torch.set_num_threads(1)
    config = _llama_config(args)
    record: dict[str, Any] = {"case": args.worker, "lightning_npu": str(Path(lightning_npu.__file__).parents[1])}

    class BuiltInConfigureModel(DecoderLM):
        """Builds the model for real in configure_model (the strategy decides which ranks build it on meta)."""

        def configure_model(self) -> None:
            if self.model is None:
                self.model = LLaMA(self.config)

    class BuiltInInit(DecoderLM):
        """Builds the model for real in __init__: every rank holds the full model before sharding."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.model = LLaMA(self.config)

    class MeasuredInitFrom(DecoderLM):
        """The recipe's module; the resident set around its on_fit_start (where init_from is loaded)."""

        def on_fit_start(self) -> None:
            record["baseline"] = _rss_bytes()
            record["peak_before"] = _peak_bytes()
            super().on_fit_start()
            record["peak"] = _peak_bytes()
            record["rss_after"] = _rss_bytes()

    class AfterSetup(Callback):
        def on_fit_start(self, trainer: Trainer, pl_module: DecoderLM) -> None:
            if args.worker in SETUP_CASES:
                record["peak"] = _peak_bytes()
                record["rss_after"] = _rss_bytes()
            record["shard_bytes"] = sum(
                p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in pl_module.model.parameters()
            )
            record["model_bytes"] = sum(p.numel() * p.element_size() for p in pl_module.model.parameters())

    batches = [{"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}]
    trainer = Trainer(
        accelerator="npu", devices=WORLD, strategy=NPUFSDPStrategy(), precision="32-true", max_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[AfterSetup()],
    )
    kwargs: dict[str, Any] = {"config": config, "warmup_steps": 0}
    if args.worker in SETUP_CASES:
        record["baseline"] = _rss_bytes()
        record["peak_before"] = _peak_bytes()
    module_class = {"configure_model": BuiltInConfigureModel, "init": BuiltInInit, "meta_reset": DecoderLM,
                    "init_from": MeasuredInitFrom}[args.worker]
    if args.worker == "init_from":
        kwargs["init_from"] = args.hf_dir
    module = module_class(**kwargs)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    Path(args.result, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    # Left to interpreter exit, gloo's threads once aborted a rank ("terminate called without an active exception").
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------------- driver


def run_case(case: str, code_root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as result:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                   str(Path(__file__).resolve()), "--worker", case, "--result", result, *_shape_args(args)]
        env = {**os.environ, "LIGHTNING_NPU_SIMULATE": str(WORLD), "PYTHONPATH": str(code_root),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        print(f"[{case} @ {code_root}] {' '.join(command[1:6])} ...", flush=True)
        completed = subprocess.run(command, env=env, cwd=code_root, capture_output=True, text=True)
        if completed.returncode != 0:
            raise SystemExit(f"case {case} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}\n"
                             f"{completed.stderr[-6000:]}")
        return [json.loads(Path(result, f"rank{r}.json").read_text()) for r in range(WORLD)]


def _shape_args(args: argparse.Namespace) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--heads", str(args.heads), "--ffn", str(args.ffn),
            "--vocab", str(args.vocab), "--max-seq-len", str(args.max_seq_len), "--hf-dir", args.hf_dir]


def _row(label: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "case": label,
        "model_fp32_gb": ranks[0]["model_bytes"] / GB,
        "peak_sum_gb": sum(d["peak"] for d in ranks) / GB,
        "per_rank": [
            {"rank": r, "baseline_gb": d["baseline"] / GB, "peak_gb": d["peak"] / GB,
             "peak_minus_baseline_gb": (d["peak"] - d["baseline"]) / GB, "rss_after_gb": d["rss_after"] / GB,
             "shard_gb": d["shard_bytes"] / GB, "code": d["lightning_npu"]}
            for r, d in enumerate(ranks)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--before-root", type=Path, help="a checkout of the code before b745785 for init_from")
    parser.add_argument("--hf-dir", default="/tmp/lnpu-hf-llama-1b", help="where the HF checkpoint is (made once)")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "host_memory.json")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--make-checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_checkpoint:
        return make_checkpoint(args)
    if args.worker:
        return worker(args)

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases {unknown} unknown: choose among {', '.join(CASES)}")
    if args.before_root is not None and not (args.before_root / "recipes" / "decoder" / "module.py").is_file():
        parser.error(f"--before-root {args.before_root} holds no recipes/decoder/module.py: give a checkout of this"
                     " repository")
    runs = [(c, REPO, c) for c in cases]
    if "init_from" in cases and args.before_root is not None:
        runs.append(("init_from", args.before_root.resolve(), "init_from (before b745785)"))
    if "init_from" in cases and not _checkpoint_matches(args):
        print(f"making the HF checkpoint in {args.hf_dir} ...", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make-checkpoint", *_shape_args(args)],
                       check=True)

    rows = [_row(label, run_case(case, root, args)) for case, root, label in runs]
    print(f"\n{'case':<28} {'rank':>4} {'model GB':>9} {'shard GB':>9} {'baseline':>9} {'peak':>7} {'peak-base':>10}"
          f" {'peaks sum':>9}")
    for row in rows:
        for rank in row["per_rank"]:
            print(f"{row['case']:<28} {rank['rank']:>4} {row['model_fp32_gb']:>9.2f} {rank['shard_gb']:>9.2f}"
                  f" {rank['baseline_gb']:>9.2f} {rank['peak_gb']:>7.2f} {rank['peak_minus_baseline_gb']:>10.2f}"
                  + (f" {row['peak_sum_gb']:>9.2f}" if rank["rank"] == 0 else ""))
    shape = {"dim": args.dim, "n_layers": args.layers, "n_heads": args.heads, "ffn_hidden_dim": args.ffn,
             "vocab_size": args.vocab, "hf_checkpoint": "bf16 safetensors (LlamaForCausalLM.save_pretrained)"}
    command = "python benchmarks/host_memory.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps({"command": command, "world_size": WORLD, "model": shape, "unit": "GB (1e9 bytes)",
                                    "rows": rows}, indent=1) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
