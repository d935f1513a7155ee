"""Hugging Face checkpoints in and out of the recipe, from the command line, for every model family of the recipe
(``recipes/families.py``: a recipe checkpoint records its family, an HF directory's ``model_type`` names it).

    python recipes/convert.py from-hf HF_DIR OUT.ckpt     # HF directory -> recipe checkpoint file
    python recipes/convert.py to-hf CKPT OUT_DIR          # recipe checkpoint (file or DCP dir) -> HF directory
    python recipes/convert.py to-hf CKPT OUT_DIR --merge-lora  # LoRA checkpoint + its base -> merged HF dir
    python recipes/convert.py to-peft CKPT OUT_DIR        # LoRA checkpoint -> PEFT adapter directory

The recipe's checkpoint layout is defined in ``decoder/checkpoint_layout.py``; the conversions in
``decoder/hf_checkpoint.py``, by each family's name map and ``config.json`` rules (``models/<family>/hf.py``); the
LoRA exports in ``decoder/lora_export.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, Optional

if __package__ in (None, ""):
    import script_path  # noqa: F401  (run as a file: makes `recipes` importable, see script_path.py)

from recipes.decoder.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, convert_hf_to_recipe, convert_recipe_to_hf
from recipes.decoder.lora_export import export_merged_hf, export_peft, is_lora_checkpoint


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    from_hf = commands.add_parser("from-hf", help="HF directory -> recipe checkpoint file")
    from_hf.add_argument("hf_dir", type=Path, help="local HF model directory (config.json + weights)")
    from_hf.add_argument("out", type=Path, help="recipe checkpoint file to write")
    to_hf = commands.add_parser("to-hf", help="recipe checkpoint (file or sharded dir) -> HF directory")
    to_hf.add_argument("checkpoint", type=Path, help="recipe .ckpt file or sharded checkpoint dir")
    to_hf.add_argument("out_dir", type=Path, help="HF directory to write")
    to_hf.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer dir to save alongside (default: the checkpoint's)"
    )
    to_hf.add_argument("--max-shard-gib", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3)
    to_hf.add_argument("--merge-lora", action="store_true", help="CKPT is a LoRA checkpoint: write base + adapters")
    to_hf.add_argument("--base", type=Path, default=None, help="with --merge-lora: the base (default: its init_from)")
    to_peft = commands.add_parser("to-peft", help="LoRA recipe checkpoint -> PEFT adapter directory")
    to_peft.add_argument("checkpoint", type=Path, help="LoRA recipe .ckpt file or sharded checkpoint dir")
    to_peft.add_argument("out_dir", type=Path, help="adapter directory to write")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.command == "to-hf" and args.base is not None and not args.merge_lora:
        parser.error(f"--base {args.base} only applies with --merge-lora (the base a LoRA checkpoint is merged into)")
    try:
        if args.command == "from-hf":
            out = convert_hf_to_recipe(args.hf_dir, args.out)
        elif args.command == "to-peft":
            out = export_peft(args.checkpoint, args.out_dir)
        elif args.merge_lora:
            out = export_merged_hf(args.checkpoint, args.out_dir, base=args.base, tokenizer_path=args.tokenizer,
                                   max_shard_bytes=int(args.max_shard_gib * 1024**3))
        elif is_lora_checkpoint(args.checkpoint):
            raise ValueError(
                f"{args.checkpoint} is a LoRA checkpoint: it holds adapters, not the full model. Add --merge-lora "
                "to write base + adapters as one model, or use `to-peft` to write the adapter for PEFT."
            )
        else:
            out = convert_recipe_to_hf(
                args.checkpoint,
                args.out_dir,
                tokenizer_path=args.tokenizer,
                max_shard_bytes=int(args.max_shard_gib * 1024**3),
            )
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
