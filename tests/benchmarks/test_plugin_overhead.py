"""The arithmetic of ``benchmarks/plugin_overhead.py`` on made-up clocks and profiles (no process is started): which
interval is whose step in an interleaved run, how a profile's time is grouped, the spread of the ratios."""

import importlib.util
from pathlib import Path

import pytest
from tests.helpers import REPO

BENCHMARK = REPO / "benchmarks" / "plugin_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plugin_overhead", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_interleaved_step_of_each_side_runs_between_the_other_sides_ends(bench):
    # clocks: (wall, cpu, user, sys, gc, page faults). Trainer steps cost 10 (cpu), raw steps 8; the first (warmup)
    # pair differs.
    lightning, raw, now = [], [], [0.0] * 6
    for step in range(5):
        cost_l, cost_r = (50.0, 40.0) if step == 0 else (10.0, 8.0)
        now = [now[0] + 2 * cost_l, now[1] + cost_l, now[2] + cost_l - 1, now[3] + 1, now[4] + 0.5, now[5] + 7]
        lightning.append(tuple(now))
        now = [now[0] + 2 * cost_r, now[1] + cost_r, now[2] + cost_r - 2, now[3] + 2, now[4] + 0.25, now[5] + 3]
        raw.append(tuple(now))
    summary = bench.interleaved_summary(lightning, raw, warmup=1)
    assert summary["lightning"]["steps"] == summary["raw"]["steps"] == 4
    assert summary["lightning"]["cpu_ms_per_step"] == pytest.approx(10_000)
    assert summary["raw"]["cpu_ms_per_step"] == pytest.approx(8_000)
    assert summary["lightning"]["sys_ms_per_step"] == pytest.approx(1_000)
    assert summary["raw"]["user_ms_per_step"] == pytest.approx(6_000)
    assert summary["lightning"]["cpu_share"] == pytest.approx(0.5)
    assert summary["lightning"]["gc_ms_per_step"] == pytest.approx(500)
    assert summary["raw"]["gc_ms_per_step"] == pytest.approx(250)
    assert summary["raw"]["page_faults_per_step"] == pytest.approx(3)
    assert summary["cpu_ratio"] == pytest.approx(0.8)
    assert summary["median_step_cpu_ratio"] == pytest.approx(0.8)


def test_a_separate_run_measures_from_the_end_of_the_last_warmup_step(bench):
    ends = [(0.0,) * 6, (5.0, 3.0, 2.0, 1.0, 0.0, 0.0)] + [
        (5.0 + k, 3.0 + 0.5 * k, 2.0 + 0.4 * k, 1.0 + 0.1 * k, 0.0, 0.0) for k in range(1, 4)]
    summary = bench.step_summary(ends, warmup=2, batch=8, seq=128)
    assert summary["steps"] == 3
    assert summary["cpu_ms_per_step"] == pytest.approx(500)
    assert summary["median_step_ms"] == pytest.approx(1000)
    assert summary["tokens_per_s"] == pytest.approx(8 * 128 * bench.WORLD)


@pytest.mark.parametrize(("path", "function", "group"), [
    ("~", "<built-in method torch._C._nn.linear>", "<caller>"),
    ("/v/site-packages/lightning/pytorch/loops/training_epoch_loop.py", "advance", "Lightning loops"),
    ("/v/site-packages/lightning/fabric/utilities/apply_func.py", "move_data_to_device", "Lightning fabric"),
    ("/v/site-packages/lightning_utilities/core/apply_func.py", "apply_to_collection",
     "Lightning lightning_utilities"),
    ("/repo/lightning_npu/telemetry/monitor.py", "on_train_batch_end", "lightning_npu.telemetry"),
    ("/repo/lightning_npu/guards.py", "observe", "lightning_npu.guards"),
    ("/repo/recipes/decoder/module.py", "training_step", "recipe DecoderLM (LightningModule)"),
    ("/repo/recipes/models/llama/model.py", "forward", "model (recipes)"),
    ("/repo/benchmarks/plugin_overhead.py", "__getitem__", "data loading"),
    ("/repo/benchmarks/plugin_overhead.py", "step", "benchmark (raw loop, clock)"),
    ("/v/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", "_pre_forward", "torch FSDP2"),
    ("/v/site-packages/torch/distributed/distributed_c10d.py", "all_reduce", "torch.distributed collectives"),
    ("/v/site-packages/torch/_tensor.py", "backward", "<caller>"),
    ("/v/site-packages/torch/optim/adamw.py", "adamw", "torch optim + LR schedule"),
    ("/usr/lib/python3.11/contextlib.py", "__exit__", "<caller>"),
])
def test_functions_are_grouped_by_where_their_code_lives(bench, path, function, group):
    assert bench.bucket_of(path, function) == group


def test_built_ins_and_glue_count_for_their_callers_in_proportion_to_their_time_under_each(bench):
    guard = ("/r/lightning_npu/guards.py", 10, "observe")
    loop = ("/s/lightning/pytorch/loops/loop.py", 5, "advance")
    layer = ("/s/torch/nn/modules/linear.py", 1, "forward")
    glue = ("/s/torch/_tensor.py", 3, "wrapper")  # called by the guard and the loop
    isfinite = ("~", 0, "<built-in method torch.isfinite>")  # called by the glue only
    linear = ("~", 0, "<built-in method torch._C._nn.linear>")
    orphan = ("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>")  # no recorded caller
    stats = {
        guard: (1, 1, 0.5, 4.5, {loop: (1, 1, 0.5, 4.5)}),
        loop: (1, 1, 1.0, 20.0, {}),
        layer: (2, 2, 0.25, 12.25, {loop: (2, 2, 0.25, 12.25)}),
        glue: (4, 4, 2.0, 8.0, {guard: (1, 1, 0.5, 2.0), loop: (3, 3, 1.5, 6.0)}),
        isfinite: (4, 4, 6.0, 6.0, {glue: (4, 4, 6.0, 6.0)}),
        linear: (2, 2, 12.0, 12.0, {layer: (2, 2, 12.0, 12.0)}),
        orphan: (1, 1, 0.75, 0.75, {}),
    }
    groups = bench.attribute(stats, root="Lightning loops")
    assert groups == pytest.approx({
        # own 0.5 + a quarter of the glue (0.5) and of the built-in under it (1.5)
        "lightning_npu.guards": 0.5 + 0.5 + 1.5,
        # own 1.0 + three quarters of glue and built-in + the caller-less built-in
        "Lightning loops": 1.0 + 1.5 + 4.5 + 0.75,
        "torch nn (forward layers)": 0.25 + 12.0,
    })
    assert sum(groups.values()) == pytest.approx(sum(entry[2] for entry in stats.values()))
    parts = bench.contributions(stats, root="Lightning loops")
    assert bench.top_functions(parts, "lightning_npu.guards", 2) == [
        ("<built-in method torch.isfinite>", pytest.approx(1.5)), ("/r/lightning_npu/guards.py:10(observe)", 0.5)]
    hooks = bench.hook_times(stats)
    assert hooks == {"/r/lightning_npu/guards.py:10(observe)": (4.5, 1)}


def test_a_cycle_of_glue_code_ends_at_the_root(bench):
    a = ("/usr/lib/python3.11/functools.py", 1, "a")
    b = ("/usr/lib/python3.11/functools.py", 2, "b")
    stats = {a: (2, 1, 1.0, 3.0, {b: (1, 0, 1.0, 1.0)}), b: (1, 1, 2.0, 3.0, {a: (1, 1, 2.0, 3.0)})}
    assert bench.attribute(stats, root="benchmark (raw loop, clock)") == pytest.approx(
        {"benchmark (raw loop, clock)": 3.0})


def test_spread_gives_the_median_range_and_a_reproducible_interval(bench):
    values = [0.99, 1.01, 1.00, 0.98, 1.02]
    first, second = bench.spread(values), bench.spread(values)
    assert first == second
    assert first["median"] == pytest.approx(1.00)
    assert (first["min"], first["max"]) == (0.98, 1.02)
    assert 0.98 <= first["ci95"][0] <= first["median"] <= first["ci95"][1] <= 1.02


def test_lightnings_inclusive_list_leaves_out_what_wraps_the_step(bench):
    backward = ("/v/site-packages/lightning/pytorch/core/module.py", 1120, "backward")
    log = ("/v/site-packages/lightning/pytorch/core/module.py", 386, "log")
    apply = ("/v/site-packages/lightning_utilities/core/apply_func.py", 29, "apply_to_collection")
    ours = ("/r/lightning_npu/guards.py", 85, "observe")
    stats = {backward: (1, 1, 0.1, 90.0, {}), log: (2, 2, 0.5, 2.0, {}), apply: (11, 11, 0.2, 1.5, {}),
             ours: (1, 1, 0.1, 0.3, {})}
    assert bench.lightning_inclusive(stats, below=10.0, count=5) == [
        ("lightning/pytorch/core/module.py:386(log)", 2.0, 2),
        ("lightning_utilities/core/apply_func.py:29(apply_to_collection)", 1.5, 11)]


def test_process_figures_give_each_threads_cpu_per_step_and_the_collections(bench):
    start = {"threads": {"main": 1.0, "gloo": 0.5}, "gc_collections": [10, 2, 0]}
    end = {"threads": {"main": 3.0, "gloo": 0.9, "pt_new": 0.2}, "gc_collections": [30, 4, 1]}
    figures = bench.process_figures(start, end, steps=4)
    assert figures["threads_cpu_ms_per_step"] == pytest.approx({"main": 500.0, "gloo": 100.0, "pt_new": 50.0})
    assert list(figures["threads_cpu_ms_per_step"]) == ["main", "gloo", "pt_new"]
    assert figures["gc_collections"] == [20, 2, 1]


def test_this_processs_threads_are_read_from_proc(bench):
    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc task list here")
    sum(range(3_000_000))  # some CPU time on the main thread
    assert bench._thread_cpu()["main"] > 0
