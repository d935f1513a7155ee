"""Tiny random transformers checkpoints for the families' parity tests: every weight drawn (norm gains around 1,
biases included) so each feature of an architecture moves the logits."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import transformers


def random_hf_model(config_class: type, model_class: type, fields: Mapping[str, Any], *,
                    seed: int = 0) -> transformers.PreTrainedModel:
    """``model_class(config_class(**fields))`` in eval mode with every parameter drawn from N(0, 0.2), plus 1 for
    norm gains, from ``seed``."""
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if "norm" in name:
                param.add_(1.0)
    return model


def saved(model: transformers.PreTrainedModel, path) -> object:
    """``path`` after ``model.save_pretrained(path)``."""
    model.save_pretrained(path)
    return path


def random_tokens(vocab_size: int, *, seed: int = 1, batch: int = 2, seq: int = 12) -> torch.Tensor:
    """[batch, seq] token ids below ``vocab_size`` from ``seed``."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def with_random_adapters(model, lora, *, seed: int, std: float) -> tuple[dict, dict]:
    """``model`` with ``lora``'s adapters added (``recipes.decoder.lora.add_lora``) and drawn from N(0, std), B too,
    so they change the output: its base state before, and the adapters' state."""
    from recipes.decoder.lora import add_lora, is_adapter_name

    base = {k: v.clone() for k, v in model.state_dict().items()}
    add_lora(model, lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.normal_(0, std)
    return base, {k: v for k, v in model.state_dict().items() if is_adapter_name(k)}


def assert_lora_exports_give_the_recipe_logits(tmp_path, hf_base, ours, lora, adapters, ids) -> dict:
    """A LoRA recipe checkpoint of ``adapters`` (``ours``'s, on the HF directory ``hf_base`` as its ``init_from``)
    through ``convert.py to-peft`` loaded by ``peft.PeftModel`` on transformers' model of ``hf_base``, and through
    ``to-hf --merge-lora``, gives the fp32 logits of ``ours`` on ``ids`` within 1e-5, which the base's are not.
    Returns the ``adapter_config.json``."""
    import json

    import peft

    from recipes import convert
    from recipes.decoder.checkpoint_layout import make_recipe_checkpoint

    checkpoint = make_recipe_checkpoint(ours.config, adapters)
    checkpoint["hyper_parameters"].update(lora=lora.to_dict(), init_from=str(hf_base))
    torch.save(checkpoint, tmp_path / "lora.ckpt")
    for argv in (["to-peft", tmp_path / "lora.ckpt", tmp_path / "peft"],
                 ["to-hf", tmp_path / "lora.ckpt", tmp_path / "merged", "--merge-lora"]):
        assert convert.main([str(arg) for arg in argv]) == 0, argv
    with torch.no_grad():
        expected = ours.eval()(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).eval()
        assert (base(ids).logits - expected).abs().max() > 1e-2  # the adapters matter
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft", torch_device="cpu").eval()
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=0, atol=1e-5)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())


def assert_convert_and_generation_are_transformers(tmp_path, hf: transformers.PreTrainedModel, prompt: torch.Tensor,
                                                   model_class: type) -> None:
    """``hf`` saved, ``convert.py from-hf`` then ``to-hf`` writes its safetensors back bit for bit, and greedy
    generation (8 tokens from ``prompt``) by ``recipes.generate`` from the HF directory and from the recipe
    checkpoint, each loaded as ``model_class``, is transformers' ``generate``."""
    from safetensors.torch import load_file

    from recipes import convert
    from recipes.generate import generate, load_model

    hf_dir = saved(hf, tmp_path / "hf")
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "model.ckpt")]) == 0
    assert convert.main(["to-hf", str(tmp_path / "model.ckpt"), str(tmp_path / "out")]) == 0
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("out", "hf"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for source in (hf_dir, tmp_path / "model.ckpt"):
        model, _ = load_model(source)
        assert isinstance(model, model_class)
        assert torch.equal(generate(model, prompt, 8), expected), source
