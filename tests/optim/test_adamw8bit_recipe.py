"""AdamW8bit in the tiny recipe on 2 simulated NPUs (one launch trains all variants; a 1-rank launch restores its
checkpoint): loss parity with torch's AdamW (with a broken quantizer as the negative control), measured state bytes
against the planner, exact resume, 2 -> 1 rank resharding and the full and consolidated checkpoints loaded by
torch.optim.AdamW. The launches run in the background from the session's start (tests/prefetch.py)."""

import pytest
import torch

from lightning_npu.plan import ModelShape, PlanSpec, state_bytes
from recipes.decoder.module import DecoderLM
from tests.prefetch import PREFETCHED

STEPS, RESUME_AT = 200, 190
#: The launches take about 15 minutes on 2 shared CPU cores: 3 x 200 steps and 10 resumed on 2 ranks, 2 on 1.
LONG = pytest.mark.timeout(3600)
TINY_DATA = dict(seq_len=128, batch_size=8)  # tiny.yaml's


#: The largest loss difference allowed at a logged step. Issue 21 asked for 0.01; at the tiny recipe's peak LR (3e-3)
#: the 8-bit run's loss differs from torch's by up to 0.040 (step 190; last-20 mean 0.41%), while a per-tensor scale
#: gives 0.096 and 1.06%. 0.01 is below what any moment error this size gives: torch's AdamW with its fp32 moments
#: times 1 + 0.001 N(0, 1) after each step already differs by 0.014, bf16 moments by 0.021 (docs/measurements.md, AdamW8bit). So the
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


@PREFETCHED.fixture(seconds=200)
def tiny_runs(tmp_path_factory):
    from recipes.decoder.data import TextDataModule
    from tests.helpers import REPO, read_json, run_python

    out, cache = tmp_path_factory.mktemp("adamw8bit"), tmp_path_factory.mktemp("tokens")
    TextDataModule(**TINY_DATA, val_fraction=0.0, cache_dir=str(cache)).prepare_data()  # one process tokenises
    script = str(REPO / "tests/optim/scripts/adamw8bit_run.py")
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
