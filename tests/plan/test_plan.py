"""lightning-npu plan: hand-counted shard sizes, activations checked against what autograd really saves, the verdict
and micro-batch search, YAML reading with flag overrides, the console command, and clear errors."""

import contextlib
import dataclasses
import json
import subprocess
import sys
import weakref

import pytest
import torch

from lightning_npu.cli import main
from lightning_npu.plan import GIB, ModelShape, PlanError, PlanSpec, estimate, load_spec, max_micro_batch, state_bytes
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.memory_profile import lightning_npu_memory_profile
from tests.helpers import REPO

CONFIG_7B = REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b.yaml"
CONFIG_7B_2NODES = REPO / "recipes" / "models" / "llama" / "configs" / "llama2_7b_2nodes.yaml"
# LLaMA-2 7B: embeddings + output (2 x 32000 x 4096), final norm, 32 blocks of wq/wk/wv/wo (4 x 4096^2),
# gate/up/down (3 x 4096 x 11008) and two norms.
PARAMS_7B = 2 * 32000 * 4096 + 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)


def test_7b_parameter_gradient_and_optimizer_shards_over_8_devices_match_a_hand_count():
    assert PARAMS_7B == 6_738_415_616
    spec = load_spec(CONFIG_7B, devices=8)
    per_device = PARAMS_7B * 4 // 8  # fp32 master shards; every 7B dimension divides by 8, so no padding
    assert per_device == 3_369_207_808
    assert state_bytes(spec) == {"parameters": per_device, "gradients": per_device, "optimizer": 2 * per_device}
    # accumulate_grad_batches=4 keeps the gradients alive at the peak, so all three appear in the table.
    items = estimate(spec).items
    assert (items["parameters"], items["gradients"], items["optimizer"]) == (per_device, per_device, 2 * per_device)


def test_hybrid_sharding_shards_within_a_node_and_replicates_across_nodes():
    hybrid = load_spec(CONFIG_7B_2NODES)
    assert (hybrid.world_size, hybrid.shard_group) == (16, 8)
    assert state_bytes(hybrid)["parameters"] == PARAMS_7B * 4 // 8
    full = dataclasses.replace(hybrid, options=dataclasses.replace(hybrid.options, sharding="full"))
    assert state_bytes(full)["parameters"] == PARAMS_7B * 4 // 16


def test_shards_pad_each_tensor_to_a_multiple_of_the_group_along_dim_0():
    model = ModelShape(vocab_size=10, dim=6, n_layers=1, n_heads=3, n_kv_heads=3, ffn_hidden_dim=5, max_seq_len=8)
    spec = PlanSpec(model=model, seq_len=8, micro_batch=1, devices=4, precision="32-true")
    # ceil(rows / 4) rows per device: root = emb 3x6 + norm 2 + output 3x6 = 38; block = norms 2 + 2,
    # wq/wk/wv/wo 2x6 each = 48, gate and up ceil(5/4)=2 x 6 each = 24, down 2 x 5 = 10 -> 86.
    assert state_bytes(spec)["parameters"] == (38 + 86) * 4


def _saved_bytes_per_token(block, dtype, kernels_context, batch_sizes, seq, input_grad=True, cos_sin=None):
    """What autograd keeps from one forward of ``block``, per token (from two batch sizes, so constants cancel);
    ``input_grad=False``: a block whose input needs no gradient (the first, after a frozen embedding). Only what is
    still kept when the forward returns counts: a node whose output the forward drops (the values of a top-k of
    which only the ids are used) is freed with what it saved, whose storage a later tensor may then reuse.
    ``cos_sin``: the block's rotary tables for ``seq`` positions (default: ``rotary_tables`` at its head_dim)."""
    from lightning_npu.kernels import rotary_tables

    if cos_sin is None:
        cos_sin = rotary_tables(seq, block.attention.head_dim)
    cos, sin = (t.to(dtype) for t in cos_sin)

    def forward(batch):
        x = torch.randn(batch, seq, block.attention_norm.weight.numel(), dtype=dtype, requires_grad=input_grad)
        with kernels_context():
            return block(x, cos, sin)

    return _kept_bytes_per_token(forward, block, batch_sizes, seq)


def _kept_bytes_per_token(forward, module, batch_sizes, seq):
    """Bytes per token of what autograd keeps from ``forward(batch)`` (which returns what holds its graph) beyond
    ``module``'s parameters, from two batch sizes of ``seq``-token rows, so constants cancel; each storage once."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    totals = []
    for batch in batch_sizes:
        saved: list[weakref.ref] = []

        def pack(tensor, saved=saved):
            saved.append(weakref.ref(tensor))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(batch)  # kept: the graph, and what it saved, live as long as the output
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (ref() for ref in saved) if t is not None}
        totals.append(sum(n for ptr, n in storages.items() if ptr not in params))
        del out
    return (totals[1] - totals[0]) / ((batch_sizes[1] - batch_sizes[0]) * seq)


def _kernels_context(precision, kernels):
    """The contexts a block's forward runs under for a precision and kernels choice, as one context manager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    contexts = [contextlib.nullcontext]
    if precision == "bf16-mixed":
        contexts.append(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    if kernels == "eager":
        contexts.append(lambda: sdpa_kernel(SDPBackend.MATH))

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            for make in contexts:
                stack.enter_context(make())
            yield

    return context


# Eager attention is checked in fp32 only: on the CPU, SDPA's math backend upcasts bf16 inputs to fp32 copies, which
# an NPU's eager attention would not do.
@pytest.mark.parametrize(("precision", "kernels"), [("32-true", "reference"), ("bf16-mixed", "reference"),
                                                    ("32-true", "eager")])
def test_block_activation_count_matches_the_tensors_autograd_saves(precision, kernels):
    from recipes.models.llama.model import TransformerBlock

    config = LLaMAConfig.from_preset("tiny")  # grouped-query attention: 4 query heads share 2 kv heads
    torch.manual_seed(0)
    block = TransformerBlock(config, 0)
    dtype = torch.float32
    if precision == "bf16-mixed":
        block = block.to(torch.bfloat16)  # what FSDP's MixedPrecisionPolicy(param_dtype=bf16) computes with
        dtype = torch.bfloat16
    seq = 32
    measured = _saved_bytes_per_token(block, dtype, _kernels_context(precision, kernels), (2, 4), seq)
    act_bytes = 4 if precision == "32-true" else 2
    predicted = sum(lightning_npu_memory_profile({"preset": "tiny"}).block_activations(kernels, act_bytes, seq).values())
    assert measured == predicted


LORA_CASES = {
    "attention": dict(rank=8, targets=["q", "k", "v", "o"]),
    "gate_and_down": dict(rank=4, targets=["gate", "down"]),
    "all_with_dropout": dict(rank=8, dropout=0.1, targets=["q", "k", "v", "o", "gate", "up", "down"]),
    "v_up_with_dropout": dict(rank=8, dropout=0.1, targets=["v", "up"]),
}


@pytest.mark.parametrize("first_block", [False, True], ids=["later_block", "first_block"])
@pytest.mark.parametrize(("precision", "kernels"), [("32-true", "reference"), ("bf16-mixed", "reference"),
                                                    ("32-true", "eager")])
@pytest.mark.parametrize("lora", list(LORA_CASES))
def test_lora_block_activation_count_matches_the_tensors_autograd_saves(lora, precision, kernels, first_block):
    """A block of the recipe's LoRA model (add_lora: frozen base, adapters) keeps exactly what the profile counts.
    Catches counting a frozen projection's input (its weight gets no gradient), the reference RMSNorm's normalised
    tensor for a frozen gain, missing the rank-r intermediates or the adapters' dropped-out inputs and masks, and,
    in the first block (frozen embedding: its input needs no gradient), counting tensors kept before its first
    adapter or dropout masks there."""
    from recipes.decoder.lora import LoRAConfig, add_lora
    from recipes.models.llama.model import LLaMA

    config = LLaMAConfig.from_preset("tiny", n_layers=1)
    torch.manual_seed(0)
    block = add_lora(LLaMA(config), LoRAConfig.from_value(LORA_CASES[lora])).layers[0]
    dtype = torch.float32
    if precision == "bf16-mixed":
        block = block.to(torch.bfloat16)
        dtype = torch.bfloat16
    seq = 32
    measured = _saved_bytes_per_token(block, dtype, _kernels_context(precision, kernels), (2, 4), seq,
                                      input_grad=not first_block)
    profile = lightning_npu_memory_profile({"preset": "tiny", "lora": LORA_CASES[lora]})
    act_bytes = 4 if precision == "32-true" else 2
    count = profile.saved_by_first_block if first_block else profile.saved_by_block
    assert measured == sum(count(kernels, act_bytes, seq).all.values())


LORA_7B = dict(rank=16, alpha=32, targets=["q", "k", "v", "o"])
#: Its adapters: 32 blocks x 4 projections x (A [16, 4096] + B [4096, 16]).
ADAPTERS_7B = 32 * 4 * (16 * 4096 + 4096 * 16)


@pytest.fixture
def lora_7b_config(tmp_path):
    """llama2_7b.yaml with ``model.lora`` (rank 16 on q, k, v, o)."""
    import yaml

    document = yaml.safe_load(CONFIG_7B.read_text())
    document["model"]["lora"] = LORA_7B
    path = tmp_path / "llama2_7b_lora.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_lora_7b_plan_holds_gradients_and_adamw_moments_for_the_adapters_only(lora_7b_config):
    """Breakage caught: gradients, reduce-scatters or AdamW moments planned for frozen base weights (the sharded
    parameters still include them, with the adapters), and a LoRA plan whose peak is not below full fine-tuning's."""
    assert ADAPTERS_7B == 16_777_216
    lora, full = load_spec(lora_7b_config, devices=8), load_spec(CONFIG_7B, devices=8)
    assert lora.profile.num_trainable_params() == ADAPTERS_7B
    assert lora.profile.num_params() == PARAMS_7B + ADAPTERS_7B
    adapter_shard = ADAPTERS_7B * 4 // 8  # fp32 shards over 8 devices; 16 rows and 4096 rows divide by 8
    assert state_bytes(lora) == {"parameters": (PARAMS_7B + ADAPTERS_7B) * 4 // 8, "gradients": adapter_shard,
                                 "optimizer": 2 * adapter_shard}
    for stage in (2, 3):
        planned, baseline = estimate(lora, stage), estimate(full, stage)
        # accumulate_grad_batches=4 keeps the gradients alive at the peak.
        assert planned.items["gradients"] + planned.items["optimizer"] == 3 * adapter_shard
        # bf16 adapter gradients and their fp32 reduce-scatter input, at most one block's, plus the previous one's.
        assert planned.items["unsharded_grads"] <= 2 * ADAPTERS_7B // 32 * (2 + 4)
        assert planned.total < baseline.total - 3 * (PARAMS_7B * 4 // 8 - adapter_shard)


def test_lora_plan_says_it_is_a_lora_run_and_marks_its_gradient_rows_trainable_only(lora_7b_config, capsys):
    """Breakage caught: a LoRA plan that reads as full fine-tuning (no trainable count), or gradient / optimizer
    rows that do not say they hold the trainable parameters only."""
    assert main(["plan", "--config", str(lora_7b_config), "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert (f"LoRA run: trainable parameters {ADAPTERS_7B:,} of {PARAMS_7B + ADAPTERS_7B:,} (0.25%), low-rank"
            " adapters (rank 16) on q, k, v, o") in out
    rows = [line.split("  ")[0] for line in out.splitlines()]
    for row in ("gradients (fp32 shards), trainable only", "optimizer states (AdamW 2 x fp32 shards), trainable only",
                "unsharded gradients + reduce-scatter buffers, trainable only", "parameters (fp32 shards)"):
        assert row in rows
    assert main(["plan", "--config", str(lora_7b_config), "--devices", "8", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["trainable_params"], model["adapters"]["rank"]) == (ADAPTERS_7B, 16)
    assert main(["plan", "--config", str(CONFIG_7B), "--devices", "8"]) == 0
    assert "trainable" not in capsys.readouterr().out


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_a_quantized_lora_base_is_planned_at_its_codes_and_scales(lora_7b_config, scheme):
    """Breakage caught: a quantized base planned at fp32 (or bf16) bytes, scales forgotten, or codes gathered at the
    working dtype's size. LLaMA-2 7B on 8 devices: every block projection at its codes plus fp32 scales
    (``facts.weight_quant``), the rest (embeddings, norms, adapters) fp32; gathered, the codes as they are and the
    scales in bf16."""
    from lightning_npu.facts import weight_quant

    plain, spec = load_spec(lora_7b_config, devices=8), load_spec(lora_7b_config, devices=8, lora_base=scheme)
    assert spec.profile.adapters.base_quantization == scheme and plain.profile.adapters.base_quantization is None
    projections = [shape for shape, stored in spec.profile.block_storage() if stored == scheme]
    assert len(projections) == 7  # wq, wk, wv, wo, w_gate, w_up, w_down
    quantized = 32 * sum(weight_quant.sharded_bytes(shape, scheme, 8) for shape in projections)
    projection_numel = 32 * sum(rows * columns for rows, columns in projections)
    assert state_bytes(spec)["parameters"] == state_bytes(plain)["parameters"] - projection_numel * 4 // 8 + quantized
    ratio = quantized / (projection_numel * 2 / 8)  # against the same weights' bf16 shards
    assert ratio == pytest.approx({"int8": 0.5, "nf4": 0.28125}[scheme], rel=0.01)
    for stage in (2, 3):
        assert estimate(spec, stage).total < estimate(plain, stage).total


def test_the_plan_table_names_a_quantized_base_and_lora_base_needs_a_lora_run(lora_7b_config, capsys):
    assert main(["plan", "--config", str(lora_7b_config), "--devices", "8", "--lora-base", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "block projections stored nf4 (codes + fp32 scales)" in out
    assert "parameters (fp32 shards; base nf4 codes + fp32 scales)" in out
    assert "gathered parameters (bf16 copy, base nf4 codes + bf16 scales)" in out
    assert main(["plan", "--config", str(CONFIG_7B), "--devices", "8", "--lora-base", "int8"]) == 2
    assert "--lora-base int8 sets how a LoRA run stores its frozen base, but LLaMA 7b trains every weight" in (
        capsys.readouterr().err)


def test_a_config_with_base_quantization_is_planned_so_and_a_bad_value_is_named(tmp_path):
    import yaml

    document = yaml.safe_load(CONFIG_7B.read_text())
    document["model"]["lora"] = {**LORA_7B, "base_quantization": "int8"}
    path = tmp_path / "qlora.yaml"
    path.write_text(yaml.safe_dump(document))
    assert load_spec(path, devices=8).profile.adapters.base_quantization == "int8"
    document["model"]["lora"]["base_quantization"] = "int4"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(PlanError, match="lora.base_quantization='int4' is not a base quantization: use one of int8"):
        load_spec(path, devices=8)


def _spec_7b(**changes):
    return dataclasses.replace(load_spec(CONFIG_7B, devices=8), **changes)


def test_verdict_compares_the_peak_with_the_device_memory():
    total = estimate(_spec_7b()).total
    roomy = estimate(_spec_7b(device_memory_gib=total / GIB + 1.0))
    tight = estimate(_spec_7b(device_memory_gib=total / GIB - 1.0))
    assert roomy.fits and roomy.headroom == pytest.approx(GIB)
    assert not tight.fits and tight.headroom == pytest.approx(-GIB)


def test_largest_micro_batch_is_the_last_one_that_fits():
    spec = _spec_7b(device_memory_gib=32.0)
    for stage in (2, 3):
        best = max_micro_batch(spec, stage)
        fitting = [b for b in range(1, best + 3) if estimate(spec, stage, b).fits]
        assert best >= 1 and fitting == list(range(1, best + 1))


def test_no_micro_batch_fits_when_one_device_cannot_hold_the_optimizer_states():
    spec = dataclasses.replace(load_spec(CONFIG_7B, devices=1), device_memory_gib=64.0)
    assert max_micro_batch(spec, 3) == 0 and not estimate(spec).fits


def test_zero3_and_activation_checkpointing_lower_the_7b_peak():
    spec = _spec_7b(ac_ratio=0.0)
    zero2, zero3 = estimate(spec, 2), estimate(spec, 3)
    assert zero3.items["gathered"] < zero2.items["gathered"] / 5  # one or two blocks instead of the whole model
    assert zero3.total < zero2.total
    assert estimate(_spec_7b(ac_ratio=1.0), 3).total < zero3.total


def test_yaml_fields_are_read_and_flags_override_them(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  preset: tiny\n  config: {dim: 256, n_layers: 6, max_seq_len: 512}\n"
        "data:\n  path: /path/to/nowhere\n  seq_len: 128\n  batch_size: 3\n"
        "trainer:\n  devices: 4\n  num_nodes: 2\n  precision: bf16-mixed\n  accumulate_grad_batches: 2\n"
        "  strategy:\n    class_path: lightning_npu.NPUFSDPStrategy\n    init_args:\n"
        "      auto_wrap_policy: [recipes.models.llama.model.TransformerBlock]\n      zero_stage: 2\n"
        "      sharding: hybrid\n      activation_checkpointing_policy: [TransformerBlock]\n"
        "      activation_checkpointing_ratio: 0.5\n"
    )
    spec = load_spec(config)
    assert (spec.model.dim, spec.model.n_layers, spec.model.vocab_size) == (256, 6, 2048)
    assert (spec.seq_len, spec.micro_batch, spec.devices, spec.nodes) == (128, 3, 4, 2)
    assert (spec.precision, spec.accumulate_grad_batches) == ("bf16-mixed", 2)
    assert (spec.zero_stage, spec.sharding) == (2, "hybrid")
    assert spec.wrap_blocks and spec.checkpointed_layers == [1, 3, 5]
    overridden = load_spec(config, devices=2, nodes=1, micro_batch=7, seq_len=64, precision="32-true", ac_ratio=0.0)
    assert (overridden.devices, overridden.nodes, overridden.micro_batch, overridden.seq_len) == (2, 1, 7, 64)
    assert overridden.precision == "32-true" and overridden.checkpointed_layers == []


def test_the_fine_tuning_configs_are_planned_at_their_data_class_settings_and_lora():
    """Catches a `data: {class_path, init_args}` section (SFTDataModule) being read at its top level, which plans the
    model's longest sequence (131072 for LLaMA-3.1) at micro-batch 1 instead of the configured rows; and the shipped
    LoRA configs planned as full fine-tunes."""
    configs = REPO / "recipes" / "models" / "llama" / "configs"
    llama3 = load_spec(configs / "llama3_8b_lora.yaml")
    assert (llama3.seq_len, llama3.micro_batch) == (8192, 1) and llama3.profile.adapters is not None
    sft = load_spec(configs / "llama2_7b_sft.yaml")
    assert (sft.seq_len, sft.profile.adapters) == (4096, None)
    lora = load_spec(configs / "llama2_7b_lora.yaml")
    assert state_bytes(lora)["gradients"] * 100 < state_bytes(sft)["gradients"]


def test_console_command_plans_the_7b_config_on_8_devices():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_npu.cli", "plan", "--config", str(CONFIG_7B), "--devices", "8",
         "--device-memory", "64"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("ZeRO-2" in line and "ZeRO-3*" in line for line in lines)
    assert [line.split()[-2:] for line in lines if line.startswith("parameters (fp32 shards)")] == [["3.14", "3.14"]]
    assert [line.split()[-2:] for line in lines if line.startswith("verdict")] == [["fits", "fits"]]


def test_json_output_and_exit_status_follow_the_verdict(capsys):
    assert main(["plan", "--config", str(CONFIG_7B), "--devices", "8", "--device-memory", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["stages"]["3"]["fits"] and plan["stages"]["3"]["max_micro_batch"] >= 1
    assert plan["stages"]["3"]["items_gib"]["parameters"] == pytest.approx(PARAMS_7B * 4 / 8 / GIB)
    assert main(["plan", "--config", str(CONFIG_7B), "--devices", "8", "--device-memory", "12"]) == 1
    assert "NO FIT" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("model:\n  preset: 65b\n", [], "Unknown LLaMA preset '65b'"),
        ("model:\n  preset: 7b\ntrainer:\n  strategy: npu_fsdp\n", ["--devices", "3", "--chip", "Ascend910A"],
         "use 1, 2, 4 or 8 devices"),
        ("model:\n  preset: 7b\ntrainer:\n  strategy: npu_ddp\n", [], "models npu_fsdp"),
        ("model:\n  preset: tiny\ndata:\n  seq_len: 4096\ntrainer:\n  strategy: npu_fsdp\n", [], "max_seq_len=256"),
        ("trainer:\n  devices: auto\n  strategy: npu_fsdp\n", [], "pass --devices N"),
        ("model:\n  preset: tiny\n  lora: {rank: 0}\ntrainer:\n  strategy: npu_fsdp\n", [], "lora.rank=0 must be"),
        ("model:\n  preset: tiny\n  lora: {targets: [q, w1]}\ntrainer:\n  strategy: npu_fsdp\n", [],
         "lora.targets has unknown name(s) ['w1']"),
    ],
)
def test_bad_configs_fail_with_the_value_and_the_fix(tmp_path, capsys, yaml_text, flags, message):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    assert main(["plan", "--config", str(config), "--profile", "recipes.models.llama.memory_profile", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("chip", ["Ascend910B2", "Ascend910B4", "Ascend910_9391"])
@pytest.mark.parametrize("devices", [3, 5, 6, 7])
def test_a2_and_a3_chips_plan_any_device_count(chip, devices):
    """Catches the first-generation 1/2/4/8 rule applied to A2/A3 servers, whose HCCL takes any count."""
    spec = load_spec(CONFIG_7B, devices=devices, chip=chip)
    assert (spec.world_size, spec.shard_group) == (devices, devices)
    assert estimate(spec).items["parameters"] > 0


@pytest.mark.parametrize("chip", ["Ascend910A", "Ascend910ProB", "Ascend910B"])
def test_first_generation_chips_need_1_2_4_or_8_devices_per_node(chip):
    """Catches the rule lost where CANN does state it: the Atlas training series (including "Ascend910B"
    itself, SocVersion 104) runs collectives over 1, 2, 4 or 8 devices per server only."""
    with pytest.raises(PlanError, match=f"devices=6 per node cannot run HCCL collectives on {chip}"):
        load_spec(CONFIG_7B, devices=6, chip=chip, device_memory_gib=64)
    spec = load_spec(CONFIG_7B, devices=4, nodes=3, chip=chip, device_memory_gib=64)  # 4 x n servers is allowed
    assert spec.world_size == 12


def test_missing_config_file_is_an_error_not_a_traceback(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


BACKWARD_SCHEMAS = REPO / "tests" / "npu_fake" / "torch_npu_2_13_0_backward_schemas.json"
#: Tensor arguments of the fused backwards that are not saved activations: the incoming gradient, parameters,
#: the rotary tables (counted once per step, under "inputs") and the inputs lightning_npu.kernels never passes or
#: shares across calls (the cached compressed causal mask).
_NOT_ACTIVATIONS = {
    "npu_rms_norm_backward": {"dy", "gamma"},
    "npu_rotary_mul_backward": {"grad", "r1", "r2"},
    "npu_fusion_attention_grad": {"dy", "pse", "padding_mask", "atten_mask", "sink"},
    "npu_swiglu_backward": {"grad_output"},
}
#: Backward arguments that are forward outputs: (position in the forward's result).
_FORWARD_OUTPUTS = {
    "npu_rms_norm_backward": {"rstd": 1},
    "npu_fusion_attention_grad": {"attention_in": 0, "softmax_max": 1, "softmax_sum": 2, "softmax_in": 3},
}


def _backward_tensor_args(schema: str) -> list[str]:
    import re

    arguments = schema[schema.index("(") + 1:schema.index(") ->")]
    return re.findall(r"Tensor\??\s+(\w+)", arguments)


def _saved_by_fused_op(op: str, inputs: dict, outputs, tokens: int) -> int:
    """Bytes per token the fused op's forward keeps for backward: the tensors its backward schema takes (from the
    recorded torch_npu 2.13.0 schemas), sized by running the strict fake's forward."""
    record = json.loads(BACKWARD_SCHEMAS.read_text())
    backward = record["forward_to_backward"][op]
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = 0
    for name in _backward_tensor_args(record["schemas"][backward]):
        if name in _NOT_ACTIVATIONS[backward]:
            continue
        position = _FORWARD_OUTPUTS.get(backward, {}).get(name)
        tensor = outputs[position] if position is not None else inputs.get(name)
        assert tensor is not None, f"{backward} takes {name!r}, which the test cannot size: classify it"
        total += tensor.numel() * tensor.element_size()
    assert total % tokens == 0
    return total // tokens


def test_fused_activation_counts_match_what_torch_npu_backward_signatures_take():
    """The planner's ``fused`` counts (the NPU default) must equal, per fused op, the bytes of the tensors the op's
    torch_npu 2.13.0 backward takes (recorded schemas; shapes and dtypes from the strict fake's forwards, called as
    lightning_npu.kernels calls them: BSND, kv heads unexpanded, bf16). Catches a wrong count, e.g. a planner that
    forgets npu_rms_norm's fp32 rstd, counts softmax_max/sum with 1 instead of 8 values per row, or keeps the
    expanded-to-all-heads k/v of the reference path; and a torch_npu backward that starts taking a tensor the test
    does not know of."""
    from tests.npu_fake import ops

    config = LLaMAConfig.from_preset("tiny")  # grouped-query attention: 4 query heads share 2 kv heads
    model = ModelShape.of(config)
    batch, seq, dtype = 2, 16, torch.bfloat16
    tokens, n, kv, hd = batch * seq, model.n_heads, model.n_kv_heads, model.head_dim
    x = torch.randn(batch, seq, model.dim, dtype=dtype)
    q, k, v = (torch.randn(batch, seq, heads, hd, dtype=dtype) for heads in (n, kv, kv))
    cos, sin = torch.rand(1, seq, 1, hd, dtype=dtype), torch.rand(1, seq, 1, hd, dtype=dtype)
    gate_up = torch.randn(batch, seq, 2 * model.ffn_hidden_dim, dtype=dtype)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)

    gamma = torch.ones(model.dim, dtype=x.dtype)  # the kernel casts the weight to the input dtype (torch_npu requires it)
    norm = _saved_by_fused_op("npu_rms_norm", {"input": x}, ops.npu_rms_norm(x, gamma), tokens)
    rotary = sum(_saved_by_fused_op("npu_rotary_mul", {"input": t}, ops.npu_rotary_mul(t, cos, sin), tokens)
                 for t in (q, k))
    attention = _saved_by_fused_op(
        "npu_fusion_attention", {"query": q, "key": k, "value": v},
        ops.npu_fusion_attention(q, k, v, n, "BSND", atten_mask=mask, scale=hd**-0.5, sparse_mode=3), tokens)
    swiglu = _saved_by_fused_op("npu_swiglu", {"input": gate_up}, ops.npu_swiglu(gate_up), tokens)

    planned = lightning_npu_memory_profile({"preset": "tiny"}).block_activations("fused", 2, seq)
    assert planned["attention_norm input + rstd"] == planned["ffn_norm input + rstd"] == norm
    assert planned["rotary inputs (q, k)"] == rotary
    # The attention output is also wo's input: the planner counts that one tensor once, under its wo entry.
    assert (planned["attention q, k, v"] + planned["attention softmax max + sum"]
            + planned["attention output (wo input)"]) == attention
    assert planned["swiglu input (gate, up)"] == swiglu


def test_fused_adamw_steps_in_place_while_foreach_holds_a_moment_sized_scratch():
    """Breakage caught: planning the NPU run (fused AdamW, the recipe's choice there) as if it were foreach, or the
    implementations swapped. Short samples put the peak at the optimizer step, where only the scratch differs."""
    spec = load_spec(CONFIG_7B, devices=8, seq_len=16, micro_batch=1)
    fused, foreach, per_tensor = (estimate(dataclasses.replace(spec, optimizer=name)) for name in
                                  ("fused", "foreach", "per-tensor"))
    shard = PARAMS_7B * 4 // 8
    assert foreach.peak_phase == "optimizer step"
    assert foreach.items["temporaries"] == pytest.approx(shard, rel=1e-3)
    assert fused.items["temporaries"] < 0.01 * shard
    assert fused.total <= per_tensor.total < foreach.total  # the per-tensor scratch stays below the backward peak
    with pytest.raises(PlanError, match=r"optimizer='adam' is not one of fused, foreach, per-tensor"):
        dataclasses.replace(spec, optimizer="adam")


def test_a_pipelined_config_plans_each_rank_holding_only_its_stages(tmp_path):
    """The 7B config with pipeline_parallel_size: 2 on its 8 devices: each rank's shards are its stage's blocks over
    the 4 ranks of its stage, so the two ranks' parameter bytes add up to the whole model over 4 (not 8, and not
    the whole model on every rank, which the planner before pipelines would have planned)."""
    config = tmp_path / "pp.yaml"
    config.write_text(CONFIG_7B.read_text().replace(
        "class_path: lightning_npu.NPUFSDPStrategy\n    init_args:\n",
        "class_path: lightning_npu.NPUFSDPStrategy\n    init_args:\n      pipeline_parallel_size: 2\n"))
    spec = load_spec(config, micro_batch=2)
    plain = load_spec(CONFIG_7B, micro_batch=2)
    assert spec.pipeline.size == 2 and spec.shard_group == plain.shard_group // 2
    from lightning_npu.plan.stages import estimate_ranks

    ranks = estimate_ranks(spec)
    shards = sum(rank.items["parameters"] for rank in ranks)
    assert shards == pytest.approx(state_bytes(plain)["parameters"] * 2, rel=1e-3)
    assert estimate(spec).total == max(rank.total for rank in ranks)
