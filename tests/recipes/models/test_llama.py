"""The native LLaMA-2 model and its config: shapes, presets, initialisation, caching, errors."""

from __future__ import annotations

import pytest
import torch

from recipes.models.llama.config import PRESETS, LLaMAConfig
from recipes.models.llama.model import LLaMA, TransformerBlock


def small_config(**overrides) -> LLaMAConfig:
    values = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=96, max_seq_len=32)
    values.update(overrides)
    return LLaMAConfig(**values)


def random_model(config: LLaMAConfig, seed: int = 0) -> LLaMA:
    torch.manual_seed(seed)
    model = LLaMA(config)
    model.reset_parameters()
    return model.eval()


def test_presets_match_published_llama2_sizes():
    # Meta's LLaMA-2 parameter counts (7B: 6,738,415,616; 13B: 13,015,864,320).
    assert LLaMAConfig.from_preset("7b").num_params() == 6_738_415_616
    assert LLaMAConfig.from_preset("13b").num_params() == 13_015_864_320
    tiny = LLaMAConfig.from_preset("tiny")
    assert tiny.vocab_size >= 2048  # the shipped tokenizer's vocabulary
    assert tiny.n_kv_heads < tiny.n_heads  # exercises grouped-query attention


def test_num_params_counts_the_built_model():
    config = small_config()
    model = LLaMA(config)
    total = sum(p.numel() for p in model.parameters())
    assert config.num_params() == total
    assert config.num_params(include_embedding=False) == total - model.tok_embeddings.weight.numel()


def test_flops_per_token_follows_6n_plus_attention():
    config = small_config()
    n = config.num_params(include_embedding=False)
    assert config.flops_per_token(16) == 6 * n + 12 * config.n_layers * 16 * config.dim
    assert config.flops_per_token() == config.flops_per_token(config.max_seq_len)


def test_from_preset_applies_overrides_and_rejects_unknown_names():
    config = LLaMAConfig.from_preset("7b", max_seq_len=2048)
    assert (config.dim, config.max_seq_len, config.n_kv_heads) == (4096, 2048, 32)
    with pytest.raises(ValueError, match=r"Unknown LLaMA preset '65b'.*'13b', '70b', '7b', 'tiny'"):
        LLaMAConfig.from_preset("65b")
    with pytest.raises(ValueError, match=r"Unknown LLaMAConfig field\(s\) \['hidden'\]"):
        LLaMAConfig.from_preset("tiny", hidden=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(dim=66), r"dim=66 is not divisible by n_heads=4"),
        (dict(n_kv_heads=3), r"n_kv_heads=3 does not divide n_heads=4"),
        (dict(n_layers=0), r"n_layers=0 is invalid"),
        (dict(norm_eps=-1.0), r"norm_eps=-1.0 is invalid"),
        (dict(dim=12, n_heads=4), r"head_dim = dim // n_heads = 3 is odd"),
    ],
)
def test_invalid_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_config_round_trips_through_dict_and_defaults_kv_heads():
    config = small_config()
    assert LLaMAConfig.from_dict(config.to_dict()) == config
    assert LLaMAConfig(dim=64, n_heads=4, n_layers=1, vocab_size=8, ffn_hidden_dim=8).n_kv_heads == 4
    assert set(PRESETS) == {"tiny", "7b", "13b", "70b"}


def test_forward_returns_fp32_logits_per_position():
    config = small_config()
    model = random_model(config)
    tokens = torch.randint(0, config.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, config.vocab_size)
    assert logits.dtype == torch.float32
    model.to(torch.bfloat16)
    assert model(tokens).dtype == torch.float32


def test_logits_are_causal():
    config = small_config()
    model = random_model(config)
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_state_dict_is_the_documented_layout_without_buffers():
    config = small_config(n_layers=1)
    model = LLaMA(config)
    assert list(model.buffers()) == []  # rotary tables are computed, not stored
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "tok_embeddings.weight": (101, 64),
        "layers.0.attention_norm.weight": (64,),
        "layers.0.attention.wq.weight": (64, 64),
        "layers.0.attention.wk.weight": (32, 64),
        "layers.0.attention.wv.weight": (32, 64),
        "layers.0.attention.wo.weight": (64, 64),
        "layers.0.ffn_norm.weight": (64,),
        "layers.0.feed_forward.w_gate.weight": (96, 64),
        "layers.0.feed_forward.w_up.weight": (96, 64),
        "layers.0.feed_forward.w_down.weight": (64, 96),
        "norm.weight": (64,),
        "output.weight": (101, 64),
    }
    assert all(isinstance(block, TransformerBlock) for block in model.layers)


def test_meta_model_materialised_by_lightning_gets_finite_llama_init():
    from lightning.fabric.utilities.init import _materialize_meta_tensors

    config = small_config(dim=256, n_heads=4, ffn_hidden_dim=512)
    with torch.device("meta"):
        model = LLaMA(config)
    assert all(p.is_meta for p in model.parameters())
    # Lightning calls to_empty + reset_parameters on each module that owns parameters.
    _materialize_meta_tensors(model, torch.device("cpu"))
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, (name, p.std().item())
            assert abs(p.mean().item()) < 0.002, name
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    assert torch.isfinite(model(tokens)).all()


def test_model_reset_parameters_reinitialises_every_module():
    model = random_model(small_config())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    model.reset_parameters()
    assert all((p != 7.0).all() for p in model.parameters())


def test_sequence_longer_than_max_seq_len_is_a_clear_error():
    config = small_config(max_seq_len=16)
    model = random_model(config)
    with pytest.raises(ValueError, match=r"17 positions .* exceeds max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match=r"exceeds max_seq_len=16"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, start_pos=15)
    with pytest.raises(ValueError, match=r"shape \[batch, seq\]; got shape \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"start_pos=3 needs a KV cache"):
        model(torch.zeros(1, 2, dtype=torch.long), start_pos=3)


def test_incremental_forward_with_cache_matches_full_forward():
    config = small_config()
    model = random_model(config)
    tokens = torch.randint(0, config.vocab_size, (2, 14))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, capacity=14)
        steps = [model(tokens[:, :9], cache=cache)]
        for pos in range(9, 14):
            steps.append(model(tokens[:, pos : pos + 1], cache=cache, start_pos=pos))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_rejects_overflow_and_wrong_batch():
    model = random_model(small_config())
    cache = model.new_cache(2, capacity=4)
    with pytest.raises(ValueError, match=r"holds 4 positions but positions 3..4"):
        model(torch.zeros(2, 2, dtype=torch.long), cache=cache, start_pos=3)
    with pytest.raises(ValueError, match=r"batch_size=2 but the tokens have batch_size=1"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"capacity=33 exceeds max_seq_len=32"):
        model.new_cache(1, capacity=33)


def test_bf16_cached_decoding_matches_the_full_forward_to_bf16_rounding():
    """Breakage caught: a cache written or read at the wrong positions, or bf16 activations meeting the fp32
    cache wrongly. The logits here are O(0.5); bf16 rounding moves them by ~2e-3, a token decoded one position
    off by ~9e-2, so the tolerances below separate the two by more than 10x."""
    config = small_config()
    model = random_model(config)
    tokens = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))

    def decode(start_of_last: int) -> torch.Tensor:
        cache = model.new_cache(1)  # fp32 cache, bf16 activations
        first = model(tokens[:, :5], cache=cache)
        return torch.cat([first, model(tokens[:, 5:], cache=cache, start_pos=start_of_last)], 1).float()

    with torch.no_grad():
        reference = model(tokens)  # fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full, decoded, one_off = model(tokens).float(), decode(5), decode(4)
    scale = reference.abs().max()
    torch.testing.assert_close(decoded, full, atol=1e-3 * scale, rtol=0)
    torch.testing.assert_close(full, reference, atol=1e-2 * scale, rtol=0)
    assert (one_off - reference).abs().max() > 0.1 * scale


def test_backward_reaches_every_parameter():
    config = small_config()
    model = random_model(config).train()
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def _packed_batch(config: LLaMAConfig, lengths: list[list[int]], seq: int):
    """Rows of ``seq`` random tokens holding samples of ``lengths`` (a row's last one may pad it out), and the
    boundaries over the flattened batch."""
    tokens = torch.randint(0, config.vocab_size, (len(lengths), seq), generator=torch.Generator().manual_seed(1))
    bounds = [0]
    for row in lengths:
        assert sum(row) == seq
        for length in row:
            bounds.append(bounds[-1] + length)
    return tokens, bounds


def test_packed_rows_give_every_sample_the_logits_and_gradients_it_gets_alone():
    """Catches attention across sample boundaries (within a row or from the previous row), rotary positions that do
    not restart per sample, and gradients that differ from those of the samples run one by one (fp32, 1e-5)."""
    config = small_config(n_heads=4, n_kv_heads=2)
    model = random_model(config).train()
    lengths = [[5, 7, 4], [9, 1, 6]]
    tokens, bounds = _packed_batch(config, lengths, seq=16)
    packed = model(tokens, cu_seqlens=bounds)
    packed.square().sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b, row in enumerate(lengths):
        start = 0
        for length in row:
            alone = model(tokens[b, start : start + length][None])[0]
            torch.testing.assert_close(packed[b, start : start + length], alone, atol=1e-5, rtol=1e-5)
            total = total + alone.square().sum()
            start += length
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_packed_forward_takes_boundaries_as_a_tensor_and_explicit_positions_alike():
    """Catches cu_seqlens tensors read differently from lists, and position_ids ignored (shifted positions must
    change the logits) or refused when they are the samples' own."""
    from recipes.models.llama.model import positions_in_samples

    config = small_config()
    model = random_model(config)
    tokens, bounds = _packed_batch(config, [[3, 5], [8]], seq=8)
    with torch.no_grad():
        reference = model(tokens, cu_seqlens=bounds)
        positions = positions_in_samples(bounds).view(2, 8)
        assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]
        torch.testing.assert_close(model(tokens, cu_seqlens=torch.tensor(bounds, dtype=torch.int32)), reference)
        torch.testing.assert_close(model(tokens, cu_seqlens=bounds, position_ids=positions), reference)
        assert not torch.allclose(model(tokens, cu_seqlens=bounds, position_ids=positions + 1), reference)
        # Unpacked rows at explicit positions (what a context-parallel part or a later pipeline stage gets).
        whole = torch.arange(8).expand(2, -1)
        torch.testing.assert_close(model(tokens, position_ids=whole), model(tokens), rtol=0, atol=0)


def test_a_part_of_each_sequence_without_its_positions_is_refused():
    """Under context parallelism a rank's tokens are a part of each sequence: without position_ids the trunk would
    give them the positions 0 .. part - 1 (silently wrong rotary), so it refuses, naming the fix."""
    model = random_model(small_config())
    for block in model.layers:
        block.attention.context_parallel = object()  # what npu_fsdp gives: a ContextParallel
    with pytest.raises(ValueError, match=r"runs under context parallelism.*pass position_ids=context_parallel.shard"):
        model(torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"position_ids": torch.zeros(2, 9, dtype=torch.long)}, "must match tokens"),
        ({"position_ids": torch.tensor([list(range(8)), list(range(1, 9))])}, r"row 1 \(\[1, 2, .*differ from row 0's"),
        ({"cu_seqlens": [0, 3, 3, 16]}, "rise strictly"),
        ({"cu_seqlens": [0, 8, 12]}, "end at the token count T=16"),
        ({"cu_seqlens": [0, 16], "position_ids": torch.zeros(16, dtype=torch.long)}, "must match tokens"),
    ],
)
def test_bad_packing_arguments_are_clear_errors(kwargs, message):
    config = small_config()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        random_model(config)(tokens, **kwargs)
