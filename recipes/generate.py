"""Text generation from a recipe checkpoint (file or sharded directory) or a Hugging Face directory, of any model
family the recipe knows (``recipes/families.py``: the checkpoint's ``family``, the directory's ``model_type``).

    python recipes/generate.py CHECKPOINT --prompt "Once upon a time" --max-new-tokens 64 \
        [--temperature 0.8 --top-k 50 --top-p 0.95 --seed 1234 --tokenizer DIR --device auto --dtype auto]

``CHECKPOINT`` is a recipe checkpoint file, a sharded checkpoint directory or a Hugging Face directory. A LoRA
run's checkpoint (adapters only) is merged onto the base it records (its ``init_from``).

``--temperature 0`` decodes greedily. The tokenizer defaults to the one recorded in a recipe
checkpoint's hyper-parameters, or to the directory itself for a Hugging Face model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

if __package__ in (None, ""):
    import script_path  # noqa: F401  (run as a file: makes `recipes` importable, see script_path.py)

import torch
from torch import Tensor

from recipes import families
from recipes.decoder.checkpoint_layout import load_recipe_checkpoint, read_recipe_metadata, tokenizer_from_metadata
from recipes.decoder.hf_checkpoint import is_hf_directory, load_hf_checkpoint
from recipes.decoder.lora_export import is_lora_checkpoint, read_merged
from recipes.decoder.tokenizer import has_tokenizer, load_tokenizer


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Next token ids [batch] from last-position logits [batch, vocab].

    ``temperature == 0`` takes the argmax (top_k/top_p are then irrelevant). Otherwise the logits are
    divided by ``temperature``, restricted to the ``top_k`` most likely tokens, then to the smallest set
    whose probability reaches ``top_p`` (nucleus; the most likely token always stays), and sampled.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def decode(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
    eos_id: Optional[int] = None,
) -> Tensor:
    """The prompt followed by up to ``max_new_tokens`` generated ids, [batch, prompt_len + new]
    (or 1-D for a 1-D prompt). Stops early once every sequence has produced ``eos_id``; a sequence
    that finished earlier is padded with ``eos_id``.

    With ``use_cache`` the prompt is run once and each new token reuses the cached keys/values;
    without it every step reruns the whole sequence (slower, the reference for tests).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    _check_sampling(temperature, top_k, top_p)
    squeeze = prompt_ids.dim() == 1
    tokens = prompt_ids.unsqueeze(0) if squeeze else prompt_ids
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(
            "prompt_ids must be [prompt_len] or [batch, prompt_len] with prompt_len >= 1; "
            f"got {tuple(prompt_ids.shape)}."
        )
    max_len = model.config.max_seq_len
    total = tokens.shape[1] + max_new_tokens
    if total > max_len:
        raise ValueError(
            f"prompt of {tokens.shape[1]} tokens + max_new_tokens={max_new_tokens} = {total} exceeds the model's "
            f"max_seq_len={max_len}; lower max_new_tokens to at most {max(max_len - tokens.shape[1], 0)} "
            "or shorten the prompt."
        )
    device = model.tok_embeddings.weight.device
    tokens = tokens.to(device)
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache(tokens.shape[0], capacity=total) if use_cache else None
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
        pos = 0
        for _ in range(max_new_tokens):
            if cache is not None:
                logits = model(tokens[:, pos:], cache=cache, start_pos=pos)
                pos = tokens.shape[1]
            else:
                logits = model(tokens)
            next_ids = sample_next_token(
                logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            if eos_id is not None:
                next_ids = next_ids.masked_fill(finished, eos_id)
                finished |= next_ids == eos_id
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return tokens[0] if squeeze else tokens


#: ``decode`` under inference mode, for one-off generation. A training loop's rollouts call ``decode`` under
#: ``torch.no_grad`` instead: inference tensors (FSDP2's gathered parameters among them) cannot be used by autograd later.
generate = torch.inference_mode()(decode)


def _check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy decoding).")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive integer or None (no top-k filter).")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None (no nucleus filter).")


# --------------------------------------------------------------------------------------------------
# Loading and the command line
# --------------------------------------------------------------------------------------------------


def load_model(
    checkpoint: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
    base: Optional[str | Path] = None,
) -> tuple[torch.nn.Module, Optional[str]]:
    """The family's model in eval mode from a recipe checkpoint (file or sharded dir) or an HF directory, and the
    tokenizer path that goes with it (None if unknown). ``dtype`` None keeps the checkpoint's dtype. A LoRA
    checkpoint's adapters are merged onto ``base``, by default the base the run recorded (its ``init_from``)."""
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist. Pass a recipe checkpoint file (.ckpt), a sharded "
            "checkpoint directory, or a Hugging Face model directory."
        )
    if is_hf_directory(path):
        config, state_dict = load_hf_checkpoint(path)
        tokenizer = str(path) if has_tokenizer(path) else None
    elif is_lora_checkpoint(path):  # adapters only: merged onto the base the run started from (its init_from)
        config, state_dict, metadata = read_merged(path, base=base)
        tokenizer = tokenizer_from_metadata(metadata)
    else:
        config, state_dict = load_recipe_checkpoint(path)
        tokenizer = tokenizer_from_metadata(read_recipe_metadata(path))
    model = build_model(config, state_dict, device=device, dtype=dtype)
    return model, tokenizer


def build_model(
    config: Any,
    state_dict: dict[str, Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: Optional[torch.dtype] = None,
) -> torch.nn.Module:
    """The family's model of ``config`` holding ``state_dict``, built on the meta device so the weights are
    allocated once."""
    with torch.device("meta"):
        model = families.of_config(config).model_class(config)
    model.load_state_dict(state_dict, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def resolve_device(name: str) -> torch.device:
    """``"auto"``: the first NPU if one is usable, else the CPU; ``"npu"``/``"npu:i"`` through the plugin's
    runtime (which says why when there is none); anything else as ``torch.device(name)``."""
    if name == "auto" or name.startswith("npu"):
        from lightning_npu import runtime

        if name == "auto" and not runtime.is_available():
            return torch.device("cpu")
        rt = runtime.get_runtime()
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        device = rt.device(index)
        rt.set_device(device)
        return device
    return torch.device(name)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Generate text with a recipe or Hugging Face checkpoint of any model"
                                     f" family of the recipe ({', '.join(sorted(families.FAMILIES))}).")
    parser.add_argument("checkpoint", type=Path, help="recipe .ckpt file, sharded checkpoint dir, or HF dir")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer dir (default: the checkpoint's)")
    parser.add_argument("--base", type=Path, default=None,
                        help="a LoRA checkpoint's base model (default: the init_from its run recorded)")
    parser.add_argument("--device", default="auto", help="auto, cpu, npu or npu:<index>")
    parser.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="auto = the checkpoint's dtype")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    args = parser.parse_args(None if argv is None else list(argv))

    try:
        _check_sampling(args.temperature, args.top_k, args.top_p)
        device = resolve_device(args.device)
        model, stored_tokenizer = load_model(
            args.checkpoint, device=device, dtype=None if args.dtype == "auto" else _DTYPES[args.dtype], base=args.base
        )
        tokenizer_path = args.tokenizer or stored_tokenizer
        if tokenizer_path is None:
            raise ValueError(
                f"{args.checkpoint} records no tokenizer; pass --tokenizer DIR (e.g. recipes/assets/tokenizer)."
            )
        tokenizer = load_tokenizer(tokenizer_path)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    prompt_ids = torch.tensor(tokenizer(args.prompt)["input_ids"], dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    try:
        out = generate(
            model,
            prompt_ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
            use_cache=not args.no_cache,
            eos_id=tokenizer.eos_token_id,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    new_tokens = out.numel() - prompt_ids.numel()
    print(tokenizer.decode(out.tolist(), skip_special_tokens=True))
    print(
        f"[{new_tokens} new tokens in {seconds:.2f} s: {new_tokens / max(seconds, 1e-9):.1f} tokens/s on {device}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
