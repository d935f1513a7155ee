"""lightning_npu.optim.AdamW8bit: the blockwise quantizer's error bounds, one tensor's update against torchao's
AdamW8bit (run eagerly, a test-only oracle), fp32 leftovers against torch's AdamW, exact resume through its state
dict, interchange with torch.optim.AdamW through the full (dequantized) form, the planner's bytes, the recipe's YAML
option. The tiny recipe's runs with it on 2 simulated NPUs: tests/optim/test_adamw8bit_recipe.py."""

import copy
import io

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_npu.facts import optim8bit
from lightning_npu.optim import AdamW8bit
from lightning_npu.quant import blockwise
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


def _awkward_values(midpoints):
    """Every range's smallest and largest value, each midpoint and its two fp32 neighbours, signed zeros, the
    smallest normal and denormal magnitudes, NaN and +inf, and random values over 40 decades of [-1, 1]."""
    ranges = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = torch.cat([ranges, ranges | 0xFFFF])
    edges = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    specials = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 2, -tiny / 2, 1e-45, -1e-45, float("nan"), float("inf")])
    g = torch.Generator().manual_seed(1)
    magnitudes = torch.rand(20_000, generator=g) * torch.logspace(-40, 0, 20_000)
    signs = torch.randint(0, 2, (20_000,), generator=g) * 2 - 1
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(-2.0)),
                      torch.nextafter(midpoints, torch.tensor(2.0))])
    return torch.cat([edges[torch.isfinite(edges) | torch.isnan(edges)], specials, magnitudes * signs, near])


@pytest.mark.parametrize("table", ["signed", "unsigned", "nf4", "crowded"])
def test_the_encoder_is_bucketize_bit_for_bit(table, monkeypatch):
    """Catches a range table off by one at any of the 65536 ranges, at a midpoint, at either zero, for denormals or
    NaN, too few steps where a range holds several midpoints (``crowded``: 256 values in [0.5, 0.52]), and chunks
    that drop or repeat elements (a chunk of 777 elements)."""
    from lightning_npu.quant.weights import nf4_values

    values = {"signed": blockwise.dynamic_map(True), "unsigned": blockwise.dynamic_map(False), "nf4": nf4_values(),
              "crowded": tuple(torch.linspace(0.5, 0.52, 256).tolist())}[table]
    book = blockwise.codebook(values, torch.device("cpu"))
    midpoints = (book.values[:-1] + book.values[1:]) / 2
    assert (book.steps == 1) == (table != "crowded")  # a range of [0.5, 1) is 2^-8 wide: 50 crowded midpoints
    monkeypatch.setattr(blockwise, "ENCODE_CHUNK", 777)
    x = _awkward_values(midpoints)
    codes = book.encode(x.reshape(-1, 2) if x.numel() % 2 == 0 else x)
    expected = torch.bucketize(x, midpoints, right=True)
    assert codes.dtype == torch.uint8 and torch.equal(codes.reshape(-1).long(), expected)


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
