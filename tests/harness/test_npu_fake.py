"""The strict torch_npu fake: it refuses what the real 2.13.0 API refuses, and its fused ops compute the documented math."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from tests.npu_fake import RELEASES, install_fake_torch_npu, load_api
from tests.npu_fake.fake import _Runtime, signature_from_params


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    return install_fake_torch_npu(monkeypatch, device_count=8)


# ---------------------------------------------------------------- the recorded API


def test_recorded_api_matches_the_documented_facts():
    api = load_api()
    assert api["torch_npu_version"] == "2.13.0"
    fa = {p["name"]: p for p in api["ops"]["npu_fusion_attention"]["params"]}
    assert fa["scale"]["default"] == 1.0  # not 1/sqrt(d): callers must pass it
    assert fa["sparse_mode"]["default"] == 0 and fa["keep_prob"]["default"] == 1.0
    assert [p["name"] for p in api["ops"]["npu_fusion_attention"]["params"][:5]] == [
        "query", "key", "value", "head_num", "input_layout"]
    assert [(p["name"], p.get("default")) for p in api["ops"]["npu_rms_norm"]["params"]] == [
        ("input", None), ("gamma", None), ("epsilon", 1e-6)]
    assert api["ops"]["npu_rotary_mul"]["params"][3] == {
        "name": "rotary_mode", "kind": "POSITIONAL_OR_KEYWORD", "type": "str", "default": "half"}
    assert str(signature_from_params(api["npu"]["set_per_process_memory_fraction"]["params"])) == "(fraction, device=None)"
    assert str(signature_from_params(api["npu"]["get_device_name"]["params"])) == "(device_name=None)"
    assert str(signature_from_params(api["npu"]["Stream"]["init_params"])) == "(device=None, priority=0, **kwargs)"
    assert api["npu"]["config"]["settable_attributes"] == ["allow_internal_format"]
    assert api["npu"]["config"]["gettable_attributes"] == []


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_moe_ops_carry_the_wheels_autograd_and_output_dtype_facts(release):
    """moe-facts.md section 1: no release registers a backward for npu_grouped_matmul; the permute pair has one
    from 2.13; output_dtype is ScalarType? in 2.6.0 but int? later, so the kernels never pass it."""
    ops = load_api(release)["ops"]
    assert ops["npu_grouped_matmul"]["autograd_node"] is None
    trains = release != "2.6.0"
    assert (ops["npu_moe_token_permute"]["autograd_node"] == "NpuMoeTokenPermuteBackward0") == trains
    assert (ops["npu_moe_token_unpermute"]["autograd_node"] == "NpuMoeTokenUnpermuteBackward0") == trains
    types = {p["name"]: p["type"] for p in ops["npu_grouped_matmul"]["params"]}
    assert types["output_dtype"] == ("ScalarType?" if release == "2.6.0" else "int?")
    assert types["group_list"] == "Tensor?" and types["group_list_type"] == "int?"


def test_every_modelled_runtime_function_has_the_recorded_signature():
    api = load_api()["npu"]
    modelled = [n for n in vars(_Runtime) if not n.startswith("_")]
    assert len(modelled) >= 25
    for name in modelled:
        assert api[name]["kind"] == "function", name
        ours = inspect.signature(getattr(_Runtime, name))
        ours = ours.replace(parameters=list(ours.parameters.values())[1:], return_annotation=inspect.Signature.empty)
        assert ours == signature_from_params(api[name]["params"]), name


@pytest.mark.parametrize("release", RELEASES)
def test_each_recorded_release_binds_onto_the_modelled_functions(release):
    """Catches a release record the fake cannot serve: every modelled function it records must accept exactly
    the recorded parameters (2.6.0's is_bf16_supported() takes none; 2.13.0's takes including_emulation)."""
    api = load_api(release)
    assert api["torch_npu_version"] == release
    for name in (n for n in vars(_Runtime) if not n.startswith("_") and n in api["npu"]):
        recorded = [p["name"] for p in api["npu"][name]["params"]]
        ours = list(inspect.signature(getattr(_Runtime, name)).parameters.values())[1:]
        assert recorded == [p.name for p in ours][: len(recorded)], (release, name)
        assert all(p.default is not inspect.Parameter.empty for p in ours[len(recorded):]), (release, name)


def test_the_calls_the_plugin_makes_are_the_same_in_2_13_0_and_2_14_0():
    new, old = load_api("2.14.0"), load_api("2.13.0")
    assert new["ops"] == old["ops"] and new["npu"] == old["npu"] and new["npu_amp"] == old["npu_amp"]


# ---------------------------------------------------------------- strictness


def test_unknown_names_raise_attribute_error(fake):
    import torch_npu

    with pytest.raises(AttributeError, match="has no attribute 'npu_flash_attention'"):
        torch_npu.npu_flash_attention
    with pytest.raises(AttributeError, match="set_memory_fraction"):
        torch.npu.set_memory_fraction
    with pytest.raises(AttributeError):
        torch.npu.amp.autocast_mode  # a submodule of the real package, not one of torch.npu.amp's names


def test_wrong_arguments_raise_type_error(fake):
    import torch_npu

    x, w = torch.randn(2, 4), torch.ones(4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        torch_npu.npu_rms_norm(x, w, eps=1e-6)
    with pytest.raises(TypeError, match="missing a required argument: 'device'"):
        torch.npu.set_device(dev=0)
    with pytest.raises(TypeError, match="too many positional"):
        torch.npu.device_count(0)
    with pytest.raises(TypeError, match="'head_num' must be int"):
        torch_npu.npu_fusion_attention(x[None, None], x[None, None], x[None, None], 1.0, "BNSD")
    assert fake.calls_to("npu_rms_norm") == []  # refused calls are not recorded


def test_memory_fraction_must_be_a_float_between_0_and_1(fake):
    with pytest.raises(TypeError, match="must be `float`"):
        torch.npu.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match="Allowed range: 0~1"):
        torch.npu.set_per_process_memory_fraction(1.5)
    torch.npu.set_per_process_memory_fraction(0.5, 3)
    assert torch.npu.get_per_process_memory_fraction(3) == 0.5


def test_recorded_but_unmodelled_names_refuse_to_run(fake):
    with pytest.raises(NotImplementedError, match="npu.Stream"):
        torch.npu.Stream(priority=-1)
    with pytest.raises(NotImplementedError, match="memory_snapshot"):
        torch.npu.memory_snapshot()
    with pytest.raises(TypeError, match="unexpected keyword argument 'timing'"):
        torch.npu.Event(timing=True)


def test_settings_objects_accept_only_recorded_attributes(fake):
    torch.npu.config.allow_internal_format = False
    with pytest.raises(AttributeError, match="cannot be read"):
        torch.npu.config.allow_internal_format  # write-only in torch_npu
    torch.npu.matmul.allow_hf32 = True
    assert torch.npu.matmul.allow_hf32 is True
    with pytest.raises(TypeError, match="must be a bool"):
        torch.npu.matmul.allow_hf32 = 1
    with pytest.raises(AttributeError, match="cannot be set"):
        torch.npu.matmul.allow_tf32 = True
    assert ("npu.config.allow_internal_format", {"value": False}) in fake.calls


def test_install_is_undone_with_the_monkeypatch_and_torch_accelerator_works_after_it():
    """Catches the fake leaving "npu" as torch's accelerator with no ``torch.npu`` behind it: after a fake test,
    ``torch.accelerator.is_available()`` raised "Device 'npu' does not have a corresponding module registered as
    'torch.npu'" (PEFT's infer_device, torch.utils.checkpoint's default device ask it). While installed, torch
    finds the fake as the real torch_npu registers itself; afterwards it finds no accelerator and no device, as in
    a process without torch_npu, and nothing else of the fake."""
    with pytest.MonkeyPatch.context() as mp:
        install_fake_torch_npu(mp)
        fake = install_fake_torch_npu(mp, device_count=2)  # a second install in one test: torch finds the last one
        import torch.npu as registered
        import torch_npu

        assert torch.npu is torch_npu.npu is registered is torch.get_device_module("npu")
        assert torch.accelerator.is_available() and torch.accelerator.device_count() == 2
    assert fake.npu is not torch.get_device_module("npu")
    assert not torch.accelerator.is_available() and torch.accelerator.device_count() == 0
    assert torch.accelerator.current_accelerator(check_available=True) is None
    with pytest.raises(AttributeError, match="no torch_npu in this process"):
        torch.npu.set_device(0)
    with pytest.raises(ImportError):
        import torch_npu  # noqa: F401,F811


# ---------------------------------------------------------------- runtime semantics


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, 8), ("0,1", 2), ("3", 1), ("", 0), ("2,1", 0), ("1,1", 0), ("0,9", 1), ("0,1,x", 2), ("abc", 0), ("4,5x6", 2),
     ("0,1,", 2), ("0, 1", 1), (" 0,1", 0), ("0,,1", 1)],
)
def test_device_count_honours_ascend_rt_visible_devices(monkeypatch, visible, expected):
    fake = install_fake_torch_npu(monkeypatch, device_count=8)
    if visible is None:
        monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
    assert torch.npu.device_count() == expected
    assert torch.npu.is_available() is (expected > 0)
    assert not fake.initialized  # device_count must not initialise the device (fork safety)


def test_set_device_accepts_npu_devices_and_records_the_call(fake):
    torch.npu.set_device(torch.device("npu", 2))
    assert torch.npu.current_device() == 2
    torch.npu.set_device("npu:5")
    assert torch.npu.current_device() == 5
    with torch.npu.device(1):
        assert torch.npu.current_device() == 1
    assert torch.npu.current_device() == 5
    with pytest.raises(ValueError, match="Expected a npu device"):
        torch.npu.set_device(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="invalid device id 8"):
        torch.npu.set_device(8)
    assert fake.calls_to("npu.set_device")[0] == {"device": torch.device("npu", 2)}


def test_device_name_and_bf16_follow_the_configured_chip(monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=2, device_name="Ascend910A", bf16_supported=False)
    assert torch.npu.get_device_name() == "Ascend910A"
    assert torch.npu.get_device_name(1) == "Ascend910A"
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.get_device_name(2)
    assert torch.npu.is_bf16_supported() is False
    assert torch.npu.get_amp_supported_dtype() == [torch.float16, torch.float32]


@pytest.mark.parametrize(
    ("chip", "bf16"),
    [("Ascend910A", False), ("Ascend910B", False), ("Ascend310P3", False), ("Ascend910B1", True),
     ("Ascend910B4-1", True), ("Ascend910_9391", True), ("Ascend950", True)],
)
def test_bf16_support_follows_the_soc_version_and_initialises_the_device(monkeypatch, chip, bf16):
    """Catches a fake that answers bf16 from a default instead of torch_npu's rule (SocVersion >= Ascend910B1)."""
    fake = install_fake_torch_npu(monkeypatch, device_name=chip)
    assert torch.npu.is_bf16_supported() is bf16
    assert fake.initialized  # torch_npu's is_bf16_supported() calls _lazy_init()


def test_a_chip_outside_torch_npus_soc_table_needs_an_explicit_bf16_answer(monkeypatch):
    with pytest.raises(ValueError, match="not one of torch_npu's SocVersion names"):
        install_fake_torch_npu(monkeypatch, device_name="Ascend999")
    install_fake_torch_npu(monkeypatch, device_name="Ascend999", bf16_supported=True)
    assert torch.npu.get_device_name() == "Ascend999" and torch.npu.is_bf16_supported() is True


def test_memory_stats_are_empty_until_init_then_track_current_and_peak(fake):
    assert torch.npu.memory_stats() == {}
    assert torch.npu.memory_allocated() == 0
    mib = 1024**2
    fake.simulate_alloc(10 * mib)
    fake.simulate_alloc(5 * mib)
    fake.simulate_free(10 * mib)
    stats = torch.npu.memory_stats()
    assert stats["allocated_bytes.all.current"] == 5 * mib
    assert stats["allocated_bytes.all.peak"] == 15 * mib
    assert torch.npu.max_memory_allocated() == 15 * mib
    assert torch.npu.memory_reserved() == 16 * mib  # cache keeps 2 MiB blocks after the free
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == 5 * mib
    torch.npu.empty_cache()
    assert torch.npu.memory_reserved() == 6 * mib
    assert torch.npu.max_memory_reserved() == 16 * mib
    free, total = torch.npu.mem_get_info()
    assert (free, total) == (64 * 1024**3 - 6 * mib, 64 * 1024**3)
    assert torch.npu.memory_allocated(1) == 0


def test_memory_fraction_caps_simulated_allocations(monkeypatch):
    fake = install_fake_torch_npu(monkeypatch, total_memory=100 * 1024**2)
    torch.npu.set_per_process_memory_fraction(0.5)
    fake.simulate_alloc(40 * 1024**2)
    with pytest.raises(RuntimeError, match="out of memory"):
        fake.simulate_alloc(20 * 1024**2)
    assert torch.npu.memory_stats()["num_ooms"] == 1


def test_manual_seed_sets_the_per_device_generator(fake):
    torch.npu.manual_seed_all(7)
    assert torch.npu.initial_seed() == 7
    torch.npu.set_device(3)
    torch.npu.manual_seed(11)
    assert torch.npu.initial_seed() == 11
    state = torch.npu.get_rng_state(3)
    torch.npu.set_rng_state(state, 0)
    assert torch.equal(torch.npu.get_rng_state(0), state)


@pytest.mark.parametrize(("dynamic", "scale_after_overflow"), [(True, 4.0), (False, 8.0)])
def test_grad_scaler_backs_off_on_overflow_only_when_dynamic(fake, dynamic, scale_after_overflow):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.npu.amp.GradScaler(init_scale=8.0, dynamic=dynamic)
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale_after_overflow
    assert torch.equal(w.detach(), torch.ones(2))  # the overflowing step was skipped
    assert fake.calls_to("npu.amp.GradScaler") == [{"init_scale": 8.0, "dynamic": dynamic}]
    with pytest.raises(TypeError, match="device"):
        torch.npu.amp.GradScaler(device="npu")  # unlike torch.amp.GradScaler, it takes no device


# ---------------------------------------------------------------- fused ops


def _attention_by_hand(q, k, v, masked, scale):
    """BNSD fp64: softmax over keys of scale*q.k with masked[i][j] True meaning 'excluded', written with loops."""
    b, n, sq, d = q.shape
    group = n // k.shape[1]
    out = torch.zeros(b, n, sq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(n):
            for i in range(sq):
                keep = [j for j in range(k.shape[2]) if not masked[i][j]]
                s = torch.stack([(q[bi, h, i].double() * k[bi, h // group, j].double()).sum() * scale for j in keep])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[bi, h, i] = sum(p[t] * v[bi, h // group, j].double() for t, j in enumerate(keep))
    return out


def _triu2048():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g)  # BNSD: 4 query heads, Sq=3
    k = torch.randn(1, 2, 5, 8, generator=g)  # 2 key/value heads (GQA), Skv=5
    v = torch.randn(1, 2, 5, 8, generator=g)
    return q, k, v


def test_fusion_attention_without_mask_is_full_attention_whatever_sparse_mode(fake, qkv):
    import torch_npu

    q, k, v = qkv
    none_masked = [[False] * 5 for _ in range(3)]
    expected = _attention_by_hand(q, k, v, none_masked, 0.25)
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25, sparse_mode=3)
    assert len(out) == 7
    torch.testing.assert_close(out[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_fusion_attention_sparse_modes_2_and_3_are_left_up_and_right_down_causal(fake, qkv):
    import torch_npu

    q, k, v = qkv
    left_up = [[j > i for j in range(5)] for i in range(3)]
    right_down = [[j > i + 2 for j in range(5)] for i in range(3)]
    out2 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=_triu2048(), scale=0.3, sparse_mode=2)[0]
    out3 = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=_triu2048(), scale=0.3, sparse_mode=3)[0]
    torch.testing.assert_close(out2.double(), _attention_by_hand(q, k, v, left_up, 0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out3.double(), _attention_by_hand(q, k, v, right_down, 0.3), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out2, out3)


def test_fusion_attention_mask_true_means_masked_out(fake, qkv):
    import torch_npu

    q, k, v = qkv
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:, 1] = True
    mask[0, 4] = True
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3)[0]
    torch.testing.assert_close(out.double(), _attention_by_hand(q, k, v, mask.tolist(), 0.3), atol=1e-5, rtol=1e-5)


def test_fusion_attention_scale_defaults_to_one(fake, qkv):
    import torch_npu

    q, k, v = qkv
    none_masked = [[False] * 5 for _ in range(3)]
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    torch.testing.assert_close(out.double(), _attention_by_hand(q, k, v, none_masked, 1.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), _attention_by_hand(q, k, v, none_masked, 1 / math.sqrt(8)), atol=1e-3)


@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH"])
def test_fusion_attention_layouts_agree_with_bnsd(fake, qkv, layout):
    import torch_npu

    q, k, v = qkv
    ref = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=_triu2048(), scale=0.3, sparse_mode=3)[0]

    def to(t):
        bsnd = t.transpose(1, 2)
        if layout == "BSND":
            return bsnd
        bsh = bsnd.flatten(2)
        return bsh if layout == "BSH" else bsh.transpose(0, 1)

    out = torch_npu.npu_fusion_attention(to(q), to(k), to(v), 4, layout, atten_mask=_triu2048(), scale=0.3, sparse_mode=3)[0]
    torch.testing.assert_close(out, to(ref))


def test_fusion_attention_rejects_masks_it_does_not_document(fake, qkv):
    import torch_npu

    q, k, v = qkv
    with pytest.raises(ValueError, match="compressed mask"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~_triu2048(), sparse_mode=3)
    with pytest.raises(ValueError, match="compressed mask"):
        causal_3x5 = torch.triu(torch.ones(3, 5, dtype=torch.bool), diagonal=1)
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=causal_3x5, sparse_mode=2)
    with pytest.raises(TypeError, match="bool or uint8"):
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(3, 5))
    with pytest.raises(ValueError, match="inner_precise=2"):
        whole_row = torch.zeros(3, 5, dtype=torch.bool)
        whole_row[1] = True
        torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=whole_row)
    with pytest.raises(ValueError, match="head_num=2"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD")


def test_fusion_attention_outputs_follow_the_meta_shapes_and_dropout_counts(fake, qkv):
    import torch_npu

    q, k, v = qkv
    out, smax, ssum, sout, seed, offset, numels = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5)
    assert smax.shape == ssum.shape == (1, 4, 3, 8) and smax.dtype == torch.float32
    assert sout.numel() == 0 and numels == 1 * 4 * 3 * 5
    assert not torch.allclose(out, torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD")[0])


def test_rms_norm_returns_y_and_fp32_rstd(fake):
    import torch_npu

    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    w = torch.randn(8, dtype=torch.bfloat16)
    y, rstd = torch_npu.npu_rms_norm(x, w, epsilon=1e-5)
    x64 = x.double()
    expected_rstd = 1 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-5)
    assert rstd.shape == (2, 3, 1) and rstd.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(rstd.double(), expected_rstd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, (x64 * expected_rstd * w.double()).to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    with pytest.raises(TypeError, match="gamma's dtype to equal x's"):
        torch_npu.npu_rms_norm(x.half(), w)


@pytest.mark.parametrize(
    ("x_dtype", "gamma_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
     (torch.float16, torch.bfloat16)],
)
def test_rms_norm_refuses_a_gamma_of_another_dtype(fake, x_dtype, gamma_dtype):
    """Catches the fake accepting (bf16 x, fp32 gamma): the wheel's docs require gamma's dtype to equal x's."""
    import torch_npu

    with pytest.raises(TypeError, match="gamma's dtype to equal x's"):
        torch_npu.npu_rms_norm(torch.randn(2, 8, dtype=x_dtype), torch.ones(8, dtype=gamma_dtype))
    with pytest.raises(ValueError, match="2-8 dimensional"):
        torch_npu.npu_rms_norm(torch.randn(8, dtype=x_dtype), torch.ones(8, dtype=x_dtype))


def test_rotary_mul_enforces_its_documented_batch_and_heads_limits(fake):
    """Catches a fake that lets npu_rotary_mul run where torch_npu documents it cannot: B or N >= 1000 (half),
    B * N >= 1000 (interleave), and a backward whose broadcast axes (B * N) exceed 1024."""
    import torch_npu

    def tables(s, d):
        return torch.rand(1, s, 1, d) * 0.5, torch.rand(1, s, 1, d) * 0.5  # 1S1D: BSND input

    r1, r2 = tables(2, 8)
    with pytest.raises(ValueError, match="B, N < 1000"):
        torch_npu.npu_rotary_mul(torch.randn(1000, 2, 1, 8), r1, r2)
    with pytest.raises(ValueError, match="B, N < 1000"):
        torch_npu.npu_rotary_mul(torch.randn(1, 2, 1000, 8), r1, r2)
    with pytest.raises(ValueError, match="B \\* N < 1000"):
        torch_npu.npu_rotary_mul(torch.randn(40, 2, 25, 8), r1, r2, "interleave")
    x = torch.randn(33, 2, 32, 8, requires_grad=True)
    out = torch_npu.npu_rotary_mul(x, r1, r2)  # the forward is within its limits
    with pytest.raises(RuntimeError, match="B \\* N <= 1024"):
        out.sum().backward()
    ok = torch.randn(32, 2, 32, 8, requires_grad=True)
    torch_npu.npu_rotary_mul(ok, r1, r2).sum().backward()
    assert ok.grad is not None


def test_rotary_mul_half_and_interleave_modes(fake):
    import torch_npu

    x = torch.randn(2, 3, 2, 4)  # BSND
    cos = torch.rand(1, 3, 1, 4) * 2 - 1
    sin = torch.rand(1, 3, 1, 4) * 2 - 1
    x0, x1, x2, x3 = x.unbind(-1)
    half_rot = torch.stack([-x2, -x3, x0, x1], dim=-1)
    inter_rot = torch.stack([-x1, x0, -x3, x2], dim=-1)
    torch.testing.assert_close(torch_npu.npu_rotary_mul(x, cos, sin), x * cos + half_rot * sin)
    torch.testing.assert_close(torch_npu.npu_rotary_mul(x, cos, sin, "interleave"), x * cos + inter_rot * sin)
    with pytest.raises(ValueError, match="broadcast shape"):
        torch_npu.npu_rotary_mul(x, cos[0, :, 0], sin[0, :, 0])
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        torch_npu.npu_rotary_mul(x, cos * 3, sin)


def test_swiglu_splits_along_dim(fake):
    import torch_npu

    x = torch.randn(4, 6)
    torch.testing.assert_close(torch_npu.npu_swiglu(x), x[:, :3] * torch.sigmoid(x[:, :3]) * x[:, 3:])
    torch.testing.assert_close(torch_npu.npu_swiglu(x, dim=0), x[:2] * torch.sigmoid(x[:2]) * x[2:])
    with pytest.raises(ValueError, match="contiguous"):
        torch_npu.npu_swiglu(x.t())
    with pytest.raises(ValueError, match="odd size"):
        torch_npu.npu_swiglu(torch.randn(4, 5))


# ---------------------------------------------------------------- MoE: npu_grouped_matmul, token permute / unpermute


def _gmm_inputs(counts=(3, 0, 2), k=4, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(len(counts), k, n, generator=g)
    return x, w, torch.tensor(counts, dtype=torch.int64)


def _per_group(x, w, counts):
    ends = torch.tensor(counts).cumsum(0).tolist()
    return torch.cat([x[start:end] @ w[e] for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends))])


@pytest.mark.parametrize("release", RELEASES)
def test_grouped_matmul_multiplies_each_group_and_has_no_autograd(monkeypatch, release):
    install_fake_torch_npu(monkeypatch, release=release)
    import torch_npu

    x, w, counts = _gmm_inputs()
    x.requires_grad_(True)
    w.requires_grad_(True)
    by_counts = torch_npu.npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)
    by_ends = torch_npu.npu_grouped_matmul([x], [w], group_list=counts.cumsum(0), split_item=2, group_type=0)
    torch.testing.assert_close(by_counts[0], _per_group(x.detach(), w.detach(), [3, 0, 2]))
    torch.testing.assert_close(by_ends[0], by_counts[0])
    # The wheel registers no autograd node for it: a direct call trains nothing.
    assert by_counts[0].grad_fn is None and not by_counts[0].requires_grad


def test_grouped_matmul_weight_gradient_form_splits_the_k_axis(fake):
    import torch_npu

    x, _, counts = _gmm_inputs()
    dy = torch.randn(5, 6)
    (dw,) = torch_npu.npu_grouped_matmul([x.t()], [dy], group_list=counts, split_item=3, group_type=2, group_list_type=1)
    assert dw.shape == (3, 4, 6)
    torch.testing.assert_close(dw[0], x[:3].t() @ dy[:3])
    assert torch.equal(dw[1], torch.zeros(4, 6))  # the empty group
    torch.testing.assert_close(dw[2], x[3:].t() @ dy[3:])


@pytest.mark.parametrize(
    ("release", "change", "error", "match"),
    [
        ("2.13.0", {"group_list": torch.tensor([3, 0, 2], dtype=torch.int32)}, TypeError, "int64 group_list"),
        ("2.13.0", {"group_list": [3, 0, 2]}, TypeError, "must be Tensor"),  # the .List overload is not the MoE form
        ("2.13.0", {"group_list": torch.tensor([3, 0, 1])}, ValueError, "summing to the 5"),
        ("2.13.0", {"group_list_type": 0}, ValueError, "non-decreasing cumulative ends"),
        ("2.13.0", {"output_dtype": 1}, ValueError, "do not pass it"),
        ("2.6.0", {"output_dtype": torch.float32}, ValueError, "do not pass it"),
        ("2.13.0", {"x_t": True}, ValueError, "contiguous"),
        ("2.13.0", {"bias": [torch.zeros(3, 5)]}, NotImplementedError, "bias"),
    ],
    ids=["int32-group-list", "list-group-list", "counts-not-summing", "ends-not-increasing", "output-dtype-2.13",
         "output-dtype-2.6", "transposed-x", "bias"],
)
def test_grouped_matmul_refuses_wrong_uses(monkeypatch, release, change, error, match):
    install_fake_torch_npu(monkeypatch, release=release)
    import torch_npu

    x, w, counts = _gmm_inputs()
    if change.pop("x_t", False):
        x = torch.randn(4, 5).t()
    kwargs = {"group_list": counts, "split_item": 2, "group_type": 0, "group_list_type": 1, **change}
    with pytest.raises(error, match=match):
        torch_npu.npu_grouped_matmul([x], [w], **kwargs)


def test_grouped_matmul_count_mode_rejects_a_single_group(fake):
    import torch_npu

    x, w, _ = _gmm_inputs(counts=(5,))
    with pytest.raises(ValueError, match="length 1"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([5]), split_item=2, group_type=0, group_list_type=1)
    (out,) = torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([5]), split_item=2, group_type=0)
    torch.testing.assert_close(out, x @ w[0])  # its cumulative end (type 0) is accepted


def test_grouped_matmul_weight_gradient_form_needs_2_13(monkeypatch):
    install_fake_torch_npu(monkeypatch, release="2.6.0")
    import torch_npu

    x, _, counts = _gmm_inputs()
    with pytest.raises(ValueError, match="group_type=2.*needs torch_npu >= 2.13"):
        torch_npu.npu_grouped_matmul([x.t()], [torch.randn(5, 6)], group_list=counts, split_item=3, group_type=2,
                                     group_list_type=1)


def test_token_permute_follows_the_documented_example_and_cann_index_convention(fake):
    """The 2.13.0 docstring's example: ids [[0, 4], [4, 3], [4, 2], [1, 1]] sort stably by expert to token rows
    1 0 0 3 2 1 2 3 (bf16); sorted_indices[i] is where (token i // 2, choice i % 2) went, not the argsort."""
    import torch_npu

    tokens = torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3], [0, 0, 0]], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 4], [4, 3], [4, 2], [1, 1]])
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, ids, ids.numel())
    assert permuted[:, 0].tolist() == [1, 0, 0, 3, 2, 1, 2, 3]
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == [0, 5, 6, 4, 7, 3, 1, 2]
    assert sorted_indices.tolist() != torch.argsort(ids.flatten(), stable=True).tolist()
    assert torch.equal(permuted[sorted_indices.long()], tokens.repeat_interleave(2, dim=0))
    probs = torch.full((4, 2), 0.5, dtype=torch.bfloat16)
    torch.testing.assert_close(torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs), tokens)
    assert torch_npu.npu_moe_token_permute(tokens, ids, 3)[0].shape == (3, 3)  # num_out_tokens keeps the first rows


@pytest.mark.parametrize("release", RELEASES)
def test_token_permute_pair_is_differentiable_from_2_13(monkeypatch, release):
    install_fake_torch_npu(monkeypatch, release=release)
    import torch_npu

    tokens = torch.randn(4, 3, requires_grad=True)
    probs = torch.rand(4, 2, requires_grad=True)
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(tokens, torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]]))
    out = torch_npu.npu_moe_token_unpermute(permuted * 1.0, sorted_indices, probs)
    differentiable = release != "2.6.0"  # 2.6.0's library has no NpuMoeToken*Backward0 node
    assert (permuted.grad_fn is not None) == differentiable and (out.grad_fn is not None) == differentiable


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: t.npu_moe_token_permute(torch.randn(2, 3), torch.zeros(2, 513, dtype=torch.int64)), ValueError, "topK <= 512"),
        (lambda t: t.npu_moe_token_permute(torch.randn(2, 3), torch.zeros(2, 2)), TypeError, "int32/int64"),
        (lambda t: t.npu_moe_token_permute(torch.randn(2, 3), torch.zeros(2, 2, dtype=torch.int64), padded_mode=True),
         ValueError, "padded_mode=False"),
        (lambda t: t.npu_moe_token_unpermute(torch.randn(4, 3, dtype=torch.bfloat16), torch.arange(4, dtype=torch.int32),
                                             torch.rand(2, 2)), TypeError, "NaN"),
        (lambda t: t.npu_moe_token_unpermute(torch.randn(4, 3), torch.arange(4), torch.rand(2, 2)), TypeError, "int32"),
    ],
    ids=["topk-513", "float-ids", "padded-mode", "probs-dtype", "int64-sorted-indices"],
)
def test_token_permute_pair_refuses_wrong_uses(fake, call, error, match):
    import torch_npu

    with pytest.raises(error, match=match):
        call(torch_npu)


# ---------------------------------------------------------------- the extractor


def test_extractor_follows_imports_and_parses_op_schemas(tmp_path):
    from tools.extract_torch_npu_api import FUSED_OPS, WheelSource, extract

    files = {
        "torch_npu/version.py": "__version__ = '9.9.9'\n",
        "torch_npu/npu/__init__.py": (
            "__all__ = ['set_device', 'memory_stats', 'config', 'Stream', 'FloatTensor']\n"
            "from .utils import set_device\n"
            "from .memory import *\n"
            "from .streams import Stream\n"
            "from .npu_config import *\n"
            "config = npu_config._Config()\n"
        ),
        "torch_npu/npu/utils.py": "def set_device(device):\n    pass\n",
        "torch_npu/npu/memory.py": (
            "__all__ = ['memory_stats']\n"
            "def memory_stats(device=None, *, pool='all', **kw):\n    pass\n"
        ),
        "torch_npu/npu/streams.py": "class Stream(Base):\n    def __new__(cls, device=None, priority=0, **kwargs):\n        pass\n",
        "torch_npu/npu/npu_config.py": (
            "__all__ = []\n"
            "class _Config:\n"
            "    def __setattr__(cls, name, value):\n"
            "        if name == 'allow_internal_format' and value == 'x':\n            pass\n"
        ),
        "torch_npu/npu/amp/__init__.py": "__all__ = ['autocast']\nfrom .autocast_mode import autocast\n",
        "torch_npu/npu/amp/autocast_mode.py": (
            "class autocast:\n    def __init__(self, enabled=True, dtype=torch.float16):\n        pass\n"
        ),
        "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml": "\n".join(
            f"- func: {op}(Tensor self, int[]? dims=None, *, float eps=1., str mode='half', int[2] span=[],"
            f" int[] pair=[0, -1], int reduction=Mean) -> (Tensor, Tensor)\n"
            f"- func: {op}_backward(Tensor grad) -> Tensor"
            for op in FUSED_OPS
        ),
        "torch_npu/_op_plugin_docs.py": (
            "torch_npu.npu_rms_norm(Tensor self, float eps=1.) -> (Tensor, Tensor)\n"
            "npu_grouped_matmul(x, weight, *, bias=None) -> List[torch.Tensor]\n"
        ),
        # Autograd node names as the library's strings hold them: one for npu_rms_norm, none for npu_swiglu.
        "torch_npu/lib/libtorch_npu.so": "\x00NpuRmsNormBackward0\x00NpuSwigluGroupQuantBackward0\x00",
        "torch_npu/utils/custom_ops.py": "torch_npu.npu_rms_norm = torch.ops.npu.npu_rms_norm\n",
        "torch_npu/profiler/__init__.py": (
            "from torch_npu._C._profiler import ProfilerActivity\n"
            "from .profiler import profile\n"
            "from .scheduler import Schedule as schedule\n"
            "from .scheduler import ProfilerAction\n"
            "__all__ = ['profile', 'ProfilerActivity', 'schedule', 'ProfilerAction']\n"
        ),
        "torch_npu/profiler/profiler.py": (
            "class _Base:\n    def start(self):\n        pass\n"
            "class profile(_Base):\n    def __init__(self, *, activities=None):\n        pass\n"
            "    def step(self):\n        if ProfilerActivity.NPU:\n            pass\n"
            "    def _private(self):\n        pass\n"
        ),
        "torch_npu/profiler/scheduler.py": (
            "class ProfilerAction(Enum):\n    NONE = 0\n    RECORD = 2\n"
            "class Schedule:\n    def __init__(self, wait, active, warmup=0):\n        pass\n"
        ),
        "torch_npu/contrib/transfer.py": "m = ['profiler.ProfilerActivity.CUDA', x.ProfilerActivity.CPU]\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    api = extract(WheelSource(tmp_path))
    npu = api["npu"]
    assert api["torch_npu_version"] == "9.9.9"
    assert npu["set_device"]["defined_in"] == "torch_npu/npu/utils.py"
    assert str(signature_from_params(npu["memory_stats"]["params"])) == "(device=None, *, pool='all', **kw)"
    assert str(signature_from_params(npu["Stream"]["init_params"])) == "(device=None, priority=0, **kwargs)"
    assert npu["config"]["settable_attributes"] == ["allow_internal_format"]
    assert npu["FloatTensor"]["kind"] == "unresolved"
    assert str(signature_from_params(api["npu_amp"]["autocast"]["init_params"])) == "(enabled=True, dtype=torch.float16)"
    rms = api["ops"]["npu_rms_norm"]
    assert str(signature_from_params(rms["params"])) == (
        "(input, dims=None, *, eps=1.0, mode='half', span=[], pair=[0, -1], reduction=Mean)")
    assert [p["type"] for p in rms["params"]] == ["Tensor", "int[]?", "float", "str", "int[2]", "int[]", "int"]
    assert rms["bound_to"] == "torch.ops.npu.npu_rms_norm" and rms["doc_signature"].startswith("torch_npu.npu_rms_norm(")
    assert api["ops"]["npu_grouped_matmul"]["doc_signature"].startswith("npu_grouped_matmul(x, weight")
    assert rms["autograd_node"] == "NpuRmsNormBackward0"
    assert api["ops"]["npu_swiglu"]["autograd_node"] is None  # NpuSwigluGroupQuantBackward0 is another op's
    prof = api["profiler"]
    assert str(signature_from_params(prof["profile"]["init_params"])) == "(*, activities=None)"
    assert prof["profile"]["methods"] == ["start", "step"]  # inherited ones too, private ones not
    assert str(signature_from_params(prof["schedule"]["init_params"])) == "(wait, active, warmup=0)"
    assert prof["ProfilerAction"]["members"] == ["NONE", "RECORD"]
    assert prof["ProfilerActivity"]["members"] == ["CPU", "NPU"]  # from code, not from the 'CUDA' string
