"""Hugging Face <-> recipe checkpoint conversion: same logits both ways, every source layout, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_npu.strategies.checkpoints.layout import is_sharded_checkpoint
from recipes import convert
from recipes.decoder import checkpoint_layout, hf_checkpoint
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from tests.helpers import run_python

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97


# One tiny model in both vocabularies: (recipe LLaMAConfig field, HF LlamaConfig field, value).
SHAPE = (
    ("vocab_size", "vocab_size", VOCAB),
    ("dim", "hidden_size", 64),
    ("n_layers", "num_hidden_layers", 2),
    ("n_heads", "num_attention_heads", 4),
    ("ffn_hidden_dim", "intermediate_size", 96),
    ("max_seq_len", "max_position_embeddings", 64),
    ("norm_eps", "rms_norm_eps", 1e-5),
    ("rope_theta", "rope_theta", 500.0),
)


def hf_model(n_kv_heads: int, *, tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM. Weights are drawn wide (std 0.2) so that a wrong rotary convention
    or a swapped gate/up would move the logits far beyond the 1e-5 tolerance."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{theirs: value for _, theirs, value in SHAPE}, num_key_value_heads=n_kv_heads, tie_word_embeddings=tie
    )
    return wide_weights(LlamaForCausalLM(config))


def recipe_model(config: LLaMAConfig, seed: int = 0) -> LLaMA:
    torch.manual_seed(seed)
    return wide_weights(LLaMA(config))


def wide_weights(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def recipe_config(n_kv_heads: int = 2) -> LLaMAConfig:
    return LLaMAConfig(**{ours: value for ours, _, value in SHAPE}, n_kv_heads=n_kv_heads)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens())
    return out.logits if hasattr(out, "logits") else out


def load_recipe(path) -> LLaMA:
    config, state_dict = checkpoint_layout.load_recipe_checkpoint(path)
    model = LLaMA(config)
    model.load_state_dict(state_dict)
    return model.eval()


def save_sharded_recipe_checkpoint(path: Path, config: LLaMAConfig, model: LLaMA) -> None:
    """Lay a checkpoint out as Lightning's sharded save does: DCP files for "state_dict" and the
    optimizer states, the rest (hyper-parameters) in meta.pt."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save

    checkpoint = checkpoint_layout.make_recipe_checkpoint(config, model.state_dict())
    path.mkdir(parents=True)
    optimizer_state = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1.0, "params": [0]}]}
    with pytest.warns(UserWarning, match="single process"):
        _distributed_checkpoint_save({"state_dict": checkpoint.pop("state_dict"), "optimizer_0": optimizer_state}, path)
    torch.save(checkpoint, path / checkpoint_layout.LIGHTNING_METADATA_FILE)


@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_hf_to_recipe_logits_match_transformers(tmp_path, n_kv_heads):
    hf = hf_model(n_kv_heads)
    hf.save_pretrained(tmp_path / "hf")
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "recipe.ckpt")]) == 0
    ours = load_recipe(tmp_path / "recipe.ckpt")
    assert ours.config == recipe_config(n_kv_heads)
    expected = logits_of(hf)
    assert expected.abs().max() > 1.0  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(logits_of(ours), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_recipe_file_to_hf_logits_match_transformers(tmp_path, n_kv_heads):
    config = recipe_config(n_kv_heads)
    ours = recipe_model(config)
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "recipe.ckpt", config, ours.state_dict())
    assert convert.main(["to-hf", str(tmp_path / "recipe.ckpt"), str(tmp_path / "hf")]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == n_kv_heads
    torch.testing.assert_close(logits_of(hf), logits_of(ours), atol=1e-5, rtol=0)


def test_recipe_sharded_dcp_directory_to_hf_logits_match_transformers(tmp_path):
    config = recipe_config()
    ours = recipe_model(config, seed=3)
    save_sharded_recipe_checkpoint(tmp_path / "sharded", config, ours)
    assert is_sharded_checkpoint(tmp_path / "sharded")
    assert convert.main(["to-hf", str(tmp_path / "sharded"), str(tmp_path / "hf")]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits_of(hf), logits_of(ours), atol=1e-5, rtol=0)


_FSDP_SAVE_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
    from recipes.decoder import checkpoint_layout
    from recipes.models.llama.config import LLaMAConfig
    from recipes.models.llama.model import LLaMA

    def run(rank, out, store_file):
        dist.init_process_group("gloo", init_method="file://" + store_file, rank=rank, world_size=2)
        config = LLaMAConfig.from_dict({config!r})
        torch.manual_seed(0)
        model = LLaMA(config)
        model.reset_parameters()
        if rank == 0:
            torch.save(model.state_dict(), out + ".reference.pt")
        mesh = init_device_mesh("cpu", (2,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = {{"model." + k: v for k, v in get_model_state_dict(model).items()}}
        _distributed_checkpoint_save({{"state_dict": state}}, __import__("pathlib").Path(out))
        if rank == 0:
            meta = checkpoint_layout.make_recipe_checkpoint(config, {{}})
            meta.pop("state_dict")
            torch.save(meta, out + "/meta.pt")
        dist.destroy_process_group()

    if __name__ == "__main__":
        # fork: the children inherit the imports instead of paying for them again (no device is initialised).
        mp.start_processes(run, args=(sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
    """
)


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_from_two_ranks_is_read_whole(tmp_path):
    config = recipe_config()
    script = tmp_path / "save_sharded.py"
    script.write_text(_FSDP_SAVE_SCRIPT.format(config=config.to_dict()))
    out = tmp_path / "sharded"
    run_python([str(script), str(out), str(tmp_path / "store")], simulate=None, timeout=120)
    assert len(list(out.glob("*.distcp"))) == 2  # one shard file per rank
    loaded_config, state_dict = checkpoint_layout.load_recipe_checkpoint(out)
    reference = torch.load(str(out) + ".reference.pt")
    assert loaded_config == config
    assert state_dict.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state_dict[name], tensor), name


def test_name_map_covers_every_transformers_parameter_once():
    config = recipe_config()
    hf_names = set(hf_model(2).state_dict())
    mapped = [name for names in hf_checkpoint.hf_name_map(config).values() for name in names]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == hf_names
    assert set(hf_checkpoint.hf_name_map(config)) == set(LLaMA(config).state_dict())


def test_gate_and_up_map_to_their_hf_projections():
    hf = hf_model(2)
    ours = hf_checkpoint.hf_to_recipe_state_dict(hf.state_dict(), recipe_config())
    assert torch.equal(ours["layers.1.feed_forward.w_gate.weight"], hf.model.layers[1].mlp.gate_proj.weight)
    assert torch.equal(ours["layers.1.feed_forward.w_up.weight"], hf.model.layers[1].mlp.up_proj.weight)


def test_a_checkpoint_written_with_the_fused_gate_up_layer_loads_as_it_was(tmp_path):
    """Catches checkpoints of the layout before FeedForward held two layers (one [gate; up] matrix per MLP) no longer
    loading, or loading with gate and up swapped: init_from, generate and convert read them through this path."""
    config = recipe_config()
    model = recipe_model(config)
    old = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("w_gate.weight"):
            up = model.state_dict()[name.replace("w_gate.", "w_up.")]
            old[name.replace("w_gate.", "w_gate_up.")] = torch.cat([tensor, up])
        elif not name.endswith("w_up.weight"):
            old[name] = tensor
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "old.ckpt", config, old)
    assert checkpoint_layout.fused_gate_up_names(tmp_path / "old.ckpt") == [
        f"layers.{i}.feed_forward.w_gate_up.weight" for i in range(config.n_layers)]
    _, loaded = checkpoint_layout.load_recipe_checkpoint(tmp_path / "old.ckpt")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "new.ckpt", config, model.state_dict())
    assert checkpoint_layout.fused_gate_up_names(tmp_path / "new.ckpt") == []


def test_a_tied_hf_checkpoint_imports_with_one_embedding_and_exports_again(tmp_path):
    hf = hf_model(2, tie=True)
    hf.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in hf_checkpoint.load_hf_state_dict(tmp_path / "hf")
    config, state_dict = hf_checkpoint.load_hf_checkpoint(tmp_path / "hf")
    assert torch.equal(state_dict["output.weight"], state_dict["tok_embeddings.weight"])
    ours = LLaMA(config)
    ours.load_state_dict(state_dict)
    torch.testing.assert_close(logits_of(ours.eval()), logits_of(hf), atol=1e-5, rtol=0)
    # The tie survives a recipe checkpoint and exports again.
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "recipe.ckpt", config, state_dict)
    hf_checkpoint.convert_recipe_to_hf(tmp_path / "recipe.ckpt", tmp_path / "hf_again")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "hf_again").eval()
    torch.testing.assert_close(logits_of(again), logits_of(hf), atol=1e-5, rtol=0)


def test_sharded_safetensors_export_round_trips_showing_each_file(tmp_path, capsys):
    """Also catches an export or a load (a run's init_from) silent for minutes on a large model: each file is one
    progress line as it starts and one as it ends (stderr is no terminal here)."""
    config = recipe_config()
    ours = recipe_model(config)
    hf_checkpoint.save_hf_checkpoint(config, ours.state_dict(), tmp_path / "hf", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / "hf" / s).is_file() for s in shards)
    written = capsys.readouterr().err
    for i, shard in enumerate(sorted(shards), start=1):
        assert f"write {tmp_path / 'hf'} [{i}/{len(shards)}] {shard} ...\n" in written
        assert f"write {tmp_path / 'hf'} [{i}/{len(shards)}] {shard} ... done " in written
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits_of(hf), logits_of(ours), atol=1e-5, rtol=0)
    config_back, state_back = hf_checkpoint.load_hf_checkpoint(tmp_path / "hf")
    assert config_back == config
    for name, tensor in ours.state_dict().items():
        assert torch.equal(state_back[name], tensor), name
    read = capsys.readouterr().err
    assert [line.split("] ")[1].split(" ...")[0] for line in read.splitlines() if " ... done " in line] == sorted(shards)
    assert f"read {tmp_path / 'hf'}: {len(shards)}/{len(shards)} done in " in read


def test_pytorch_bin_checkpoints_with_rotary_buffers_are_read(tmp_path):
    hf = hf_model(2)
    directory = tmp_path / "hf"
    hf.config.save_pretrained(directory)
    state = dict(hf.state_dict())
    # Checkpoints written by older transformers carry this buffer; it must be ignored.
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    torch.save(state, directory / "pytorch_model.bin")
    config, state_dict = hf_checkpoint.load_hf_checkpoint(directory)
    ours = LLaMA(config)
    ours.load_state_dict(state_dict)
    torch.testing.assert_close(logits_of(ours.eval()), logits_of(hf), atol=1e-5, rtol=0)


def test_bf16_checkpoint_exports_bf16_config(tmp_path):
    config = recipe_config()
    ours = recipe_model(config).to(torch.bfloat16)
    hf_checkpoint.save_hf_checkpoint(config, ours.state_dict(), tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16


def test_hf_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    hf_model(2).save_pretrained(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config["intermediate_size"] = 80
    config_path.write_text(json.dumps(hf_config))
    with pytest.raises(
        checkpoint_layout.CheckpointError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(96, 64\) .* implies \(80, 64\)",
    ):
        hf_checkpoint.load_hf_checkpoint(tmp_path / "hf")


def test_recipe_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    ours = recipe_model(recipe_config())
    wrong = recipe_config()
    wrong.ffn_hidden_dim = 80
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "recipe.ckpt", wrong, ours.state_dict())
    with pytest.raises(
        checkpoint_layout.CheckpointError,
        match=r"'layers\.0\.feed_forward\.w_gate\.weight' has shape \(96, 64\) .* needs \(80, 64\)",
    ):
        checkpoint_layout.load_recipe_checkpoint(tmp_path / "recipe.ckpt")


def test_unknown_and_missing_tensors_are_named(tmp_path):
    hf = hf_model(2)
    config = recipe_config()
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        hf_checkpoint.hf_to_recipe_state_dict(state, config)
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"lacks 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_checkpoint.hf_to_recipe_state_dict(state, config)
    ours = recipe_model(config).state_dict()
    ours["layers.0.attention.rotary.cos"] = torch.zeros(1)
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"'layers\.0\.attention\.rotary\.cos'"):
        checkpoint_layout.check_state_dict(ours, config, source="test")


def test_missing_paths_and_non_llama_models_give_clear_errors(tmp_path, capsys):
    assert convert.main(["from-hf", str(tmp_path / "nowhere"), str(tmp_path / "out.ckpt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert convert.main(["to-hf", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")]) == 1
    assert "missing.ckpt' does not exist" in capsys.readouterr().err
    hf_model(2).config.save_pretrained(tmp_path / "no_weights")
    with pytest.raises(
        checkpoint_layout.CheckpointError, match=r"has no weights: expected one of .*model\.safetensors"
    ):
        hf_checkpoint.load_hf_checkpoint(tmp_path / "no_weights")
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"model_type='mistral'"):
        hf_checkpoint.config_from_hf({"model_type": "mistral"})
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"rope_type='linear'"):
        hf_checkpoint.config_from_hf({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}})
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"not a Lightning sharded checkpoint"):
        checkpoint_layout.load_recipe_checkpoint(tmp_path / "plain_dir")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"has no 'state_dict' entry"):
        checkpoint_layout.load_recipe_checkpoint(tmp_path / "other.pt")


def test_checkpoint_without_config_or_model_prefix_is_explained(tmp_path):
    config = recipe_config()
    state = recipe_model(config).state_dict()
    torch.save({"state_dict": {"model." + k: v for k, v in state.items()}, "hyper_parameters": {}}, tmp_path / "a.ckpt")
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"no hyper_parameters\['config'\]"):
        checkpoint_layout.load_recipe_checkpoint(tmp_path / "a.ckpt")
    torch.save({"state_dict": state, "hyper_parameters": {"config": config.to_dict()}}, tmp_path / "b.ckpt")
    with pytest.raises(checkpoint_layout.CheckpointError, match=r"no tensor under 'model\.'"):
        checkpoint_layout.load_recipe_checkpoint(tmp_path / "b.ckpt")


def test_recipe_checkpoint_accepts_preset_names_and_wrapped_module_keys(tmp_path):
    config = LLaMAConfig.from_preset("tiny", n_layers=1)
    torch.manual_seed(0)
    state = LLaMA(config).state_dict()
    wrapped = {
        "model._orig_mod." + k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v for k, v in state.items()
    }
    torch.save(
        {"state_dict": {**wrapped, "loss_scale": torch.ones(1)}, "hyper_parameters": {"config": config.to_dict()}},
        tmp_path / "c.ckpt",
    )
    loaded_config, loaded = checkpoint_layout.load_recipe_checkpoint(tmp_path / "c.ckpt")
    assert loaded_config == config and loaded.keys() == state.keys()
    assert checkpoint_layout.config_from_hparams({"config": "tiny"}) == LLaMAConfig.from_preset("tiny")


def test_recipe_checkpoint_loads_into_a_lightning_module_holding_the_model(tmp_path):
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self, config: dict):
            super().__init__()
            self.save_hyperparameters()
            self.model = LLaMA(LLaMAConfig.from_dict(config))

    config = recipe_config()
    ours = recipe_model(config)
    checkpoint_layout.save_recipe_checkpoint(tmp_path / "recipe.ckpt", config, ours.state_dict())
    module = Module.load_from_checkpoint(tmp_path / "recipe.ckpt", weights_only=False)
    torch.testing.assert_close(logits_of(module.model.eval()), logits_of(ours), atol=0, rtol=0)


@pytest.mark.slow
def test_convert_runs_as_a_script_from_any_directory(tmp_path):
    hf_model(2).save_pretrained(tmp_path / "hf")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "recipes/convert.py"),
            "from-hf",
            str(tmp_path / "hf"),
            str(tmp_path / "r.ckpt"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "r.ckpt").is_file()
    assert f"read {tmp_path / 'hf'} [1/1] model.safetensors ... done " in result.stderr  # a line as it is read


def test_a_config_json_without_a_key_the_recipe_needs_names_it():
    """A Mixtral config.json without rms_norm_eps stopped convert.py with a bare ``KeyError: 'rms_norm_eps'``."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=64).to_dict()
    del config["rms_norm_eps"]
    with pytest.raises(checkpoint_layout.CheckpointError, match="config.json: no 'rms_norm_eps', which the recipe"
                                                                 " reads to build a mixtral model; add it"):
        hf_checkpoint.config_from_hf(config)


def test_a_top_level_original_max_position_embeddings_is_read_as_transformers_reads_it():
    """transformers takes a top-level original_max_position_embeddings over rope_parameters' own; the recipe read
    only rope_parameters' (logits 4.1 off where they disagreed). Used where it alone is given, refused where the
    two disagree."""
    from recipes.decoder.hf_checkpoint import rope_from_hf

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}
    _, scaling = rope_from_hf({"rope_parameters": llama3, "original_max_position_embeddings": 16})
    assert scaling["original_max_position_embeddings"] == 16
    with pytest.raises(checkpoint_layout.CheckpointError, match="original_max_position_embeddings=16 at the top"
                                                                 " level but 64 in rope_parameters"):
        rope_from_hf({"rope_parameters": {**llama3, "original_max_position_embeddings": 64},
                      "original_max_position_embeddings": 16})


def test_hidden_act_swish_is_the_silu_of_the_swiglu_mlp():
    """transformers runs ``hidden_act: swish`` as SiLU; the recipe refused it."""
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=VOCAB, hidden_act="swish").to_dict()
    assert hf_checkpoint.config_from_hf(config) == hf_checkpoint.config_from_hf({**config, "hidden_act": "silu"})
    with pytest.raises(checkpoint_layout.CheckpointError, match="hidden_act='gelu'"):
        hf_checkpoint.config_from_hf({**config, "hidden_act": "gelu"})
