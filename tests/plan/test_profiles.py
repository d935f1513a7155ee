"""How ``lightning-npu plan`` finds a model's memory profile: a model package's own ``memory_profile`` module
through the config's class paths, a decoder given by its shapes, and the errors when neither is there."""

import sys
import textwrap

import pytest

from lightning_npu.cli import main
from lightning_npu.plan import DecoderProfile, ModelShape, PlanError, estimate, load_spec, report
from tests.helpers import REPO

CONFIG_7B = REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b.yaml"
SHAPE_7B = "hidden=4096,layers=32,heads=32,kv_heads=32,ffn=11008,vocab=32000,max_seq_len=4096"


@pytest.fixture
def model_zoo(tmp_path, monkeypatch):
    """A third-party model package ``zoo_gpt`` (a profile that saves one extra tensor per block) with a config in
    its own tree, outside the checkout and off sys.path."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    root = tmp_path / "project"
    package = root / "zoo_gpt" / "gpt"
    package.mkdir(parents=True)
    (root / "zoo_gpt" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "memory_profile.py").write_text(textwrap.dedent("""
        from lightning_npu.plan import DecoderProfile, ModelShape

        class GPTProfile(DecoderProfile):
            def saved_by_block(self, kernels, act_bytes, seq_len):
                saved = super().saved_by_block(kernels, act_bytes, seq_len)
                saved.mlp["dropout mask"] = self.shape.dim  # one byte per channel
                return saved

        def lightning_npu_memory_profile(model):
            width = int(model["width"])
            shape = ModelShape(vocab_size=1000, dim=width, n_layers=4, n_heads=4, n_kv_heads=4,
                               ffn_hidden_dim=4 * width, max_seq_len=512)
            return GPTProfile(shape, name="GPT " + str(width), block_class="zoo_gpt.gpt.model.Block")
    """))
    config = root / "configs" / "gpt.yaml"
    config.parent.mkdir()
    config.write_text(textwrap.dedent("""
        model:
          class_path: zoo_gpt.gpt.module.GPT
          init_args: {width: 256}
        data: {seq_len: 128, batch_size: 2}
        trainer:
          strategy:
            class_path: lightning_npu.NPUFSDPStrategy
            init_args:
              auto_wrap_policy: [zoo_gpt.gpt.model.Block]
    """))
    yield config
    for name in [name for name in sys.modules if name.startswith("zoo_gpt")]:
        del sys.modules[name]


def test_a_model_package_supplies_its_own_profile_through_the_config_class_paths(model_zoo):
    """Catches a planner that assumes one model (the LLaMA recipe) instead of asking the config's model package,
    or that cannot find that package from the config's location."""
    spec = load_spec(model_zoo, devices=2)
    assert (spec.profile.name, spec.model.dim, spec.model.ffn_hidden_dim) == ("GPT 256", 256, 1024)
    assert spec.wrap_blocks
    plain = load_spec(model_zoo, devices=2, model_shape=spec.model)  # the same shapes as the generic decoder
    assert type(plain.profile) is DecoderProfile
    # The profile's extra tensor (dim bytes per token per block) is in the plan.
    per_token = "activation_bytes_per_token_per_layer"
    assert report(spec)[per_token] - report(plain)[per_token] == 256
    assert estimate(spec).total > estimate(plain).total


def test_shapes_alone_plan_as_the_recipe_preset_with_those_shapes():
    """Catches --model-shape keys mapped to the wrong dimension, or a generic decoder that counts other tensors
    than the LLaMA recipe's profile."""
    recipe = load_spec(CONFIG_7B, devices=8)
    shapes = load_spec(CONFIG_7B, devices=8, model_shape=ModelShape.parse(SHAPE_7B))
    assert shapes.model == recipe.model
    assert report(shapes)["stages"] == report(recipe)["stages"]


def test_a_config_with_no_profile_to_find_names_the_ways_to_give_the_model(tmp_path, capsys):
    config = tmp_path / "bare.yaml"
    config.write_text("model:\n  preset: 7b\ntrainer:\n  strategy: npu_fsdp\n")
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "no memory profile" in err and "--profile MODULE" in err and "--model-shape" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hidden=4096", "lacks layers, heads, ffn, vocab, max_seq_len"),
        (SHAPE_7B.replace("max_seq_len", "seq_len"), "key 'seq_len' is unknown (the trained length is --seq-len)"),
        (SHAPE_7B.replace("heads=32,kv", "heads=30,kv"), "heads must divide dim"),
        (SHAPE_7B.replace("ffn=11008", "ffn=big"), "give ffn=N with a positive integer N"),
    ],
)
def test_bad_model_shapes_name_the_value_and_the_fix(text, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelShape.parse(text)
