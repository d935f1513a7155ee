"""lightning-npu selftest: the whole command on two simulated NPUs, and each check family made to fail on purpose
(a wrong fused kernel through the strict fake, a wrong collective, a resume that does not reproduce the run, a
pipelined loss off plain npu_fsdp's)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_npu import runtime as runtime_pkg
from lightning_npu.cli import main
from lightning_npu.kernels import _dispatch
from lightning_npu.runtime.npu import NPURuntime
from lightning_npu.selftest import collectives, kernels, model, report, training
from tests.helpers import REPO, WARM_PYTHON
from tests.npu_fake import install_fake_torch_npu
from tests.test_kernels import attention_mod, install_cann

E2E_TIMEOUT_S = 180


def _by_label(data):
    return {f"{check['family']}/{check['name']}": check for check in data["checks"]}


def _run(checks):
    """The results of ``kernel_checks`` / ``collective_checks``, run in their order as the selftest runs them."""
    return [check() for _, check in checks]


@pytest.mark.slow
def test_quick_selftest_on_two_simulated_npus_passes_and_reports_fused_kernels_not_available(tmp_path):
    """Catches a selftest that cannot run end to end here (launch, collectives over gloo, sharded save and resume
    on two processes, the decoder split into two pipeline stages), one that counts a fused kernel it never ran as
    passed, a missing table or JSON, and a pipeline whose loss is wrong (scaling the schedule's loss by 1 + 1e-4
    fails the pipelined row here)."""
    status, output, checkpoint_at_first_line = _quick_selftest(tmp_path, terminal=False)
    assert status == 0, output[-8000:]
    data = json.loads((tmp_path / "selftest.json").read_text())
    checks = _by_label(data)
    assert data["exit_code"] == 0 and data["failures"] == []
    kernel_checks = [c for label, c in checks.items() if label.startswith("kernels/")]
    assert len(kernel_checks) == 21  # 7 kernels x fp32/bf16/fp16
    for check in kernel_checks:
        assert check["verdict"] == "not available" and "cpu tensors run the PyTorch reference path" in check["detail"]
        assert check["figures"]["reference_s"] > 0
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                 "all_to_all_single uneven", "all_gather", "broadcast", "send/recv (batch_isend_irecv)"):
        check = checks[f"collectives/{name}"]
        assert check["verdict"] == "pass" and check["figures"]["ranks"] == 2
        assert check["figures"]["busbw_1MiB_gbps"] > 0 and check["figures"]["busbw_8MiB_gbps"] > 0
    assert checks["training/loss"]["verdict"] == "pass"
    assert checks["training/resume"]["verdict"] == "pass" and checks["training/resume"]["figures"]["steps_compared"] == 4
    assert checks["training/memory"]["verdict"] == "info" and checks["training/memory"]["figures"]["planned_tensors_gib"] > 0
    # Both ranks' losses (each its own, sent from the last stage) within fp32's tolerance of plain npu_fsdp's.
    pipelined = checks["training/pipelined step (1F1B)"]
    assert pipelined["verdict"] == "pass", pipelined["detail"]
    assert pipelined["figures"]["tolerance"] == 1e-5 and pipelined["figures"]["max_rel_diff"] <= 1e-5
    assert pipelined["figures"]["stages"] == 2 and len(pipelined["figures"]["losses"]) == 4
    assert data["versions"]["torch"] == torch.__version__ and data["settings"]["ranks"] == 2
    assert "kernels/rms_norm bf16" in output and "summary: " in output and "FAILED" not in output
    # On a pipe: each check's start and end as a plain line, as it happens (before the training's checkpoint).
    assert checkpoint_at_first_line is False and "\r" not in output
    ends = _progress_ends(output, data)
    assert [label for label, _ in ends[:-2]] == [label for label in checks if not label.startswith("training/")]
    assert all(outcome == checks[label]["verdict"] for label, outcome in ends[:-2])
    assert ends[-2] == ("training/loss, resume, memory (8 steps)", "pass, pass, info")
    assert ends[-1] == ("training/pipelined step (1F1B)", "pass")
    starts = re.findall(r"^selftest \[(\d+)/\d+\] .* \.\.\.$", output, re.MULTILINE)
    assert starts == [str(i) for i in range(1, len(ends) + 1)]
    assert output.index("selftest [2/") > output.index("selftest [1/") and "selftest: 31/31 done in" in output


@pytest.mark.slow
def test_quick_selftest_on_a_terminal_draws_a_bar_and_shows_each_check_as_it_ends(tmp_path):
    """Catches a selftest silent on a terminal until its report (the ranks' output buffered, or the bar drawn only by
    the launcher), and one that floods a terminal with a line per redraw."""
    status, output, checkpoint_at_first_line = _quick_selftest(tmp_path, terminal=True)
    assert status == 0, output[-8000:]
    data = json.loads((tmp_path / "selftest.json").read_text())
    assert checkpoint_at_first_line is False
    assert re.search(r"\r\x1b\[Kselftest \[#*\.*\] 0/31 \d+ s  kernels/attention fp32", output)
    bars = re.findall(r"\r\x1b\[Kselftest \[(#*)(\.*)\] (\d+)/31 \d+ s", output)
    assert {int(done) for *_, done in bars} == set(range(32))  # redrawn after every check
    assert all(len(filled) == 24 * int(done) // 31 and len(filled + empty) == 24 for filled, empty, done in bars)
    ends = _progress_ends(output.replace("\r\n", "\n").replace("\r\x1b[K", "\n"), data)
    assert len(ends) == 31 and ends[-1] == ("training/pipelined step (1F1B)", "pass")
    assert not re.search(r"selftest \[\d+/31\] [^\r\n]* \.\.\.\r\n", output)  # no start lines: the bar has them
    assert "summary: " in output


def _quick_selftest(tmp_path, *, terminal):
    """``lightning-npu selftest --quick`` on two simulated NPUs, its stdout and stderr on one pipe or one pseudo-
    terminal, read as they arrive: its exit status, its output, and whether the training check's checkpoint was on
    disk when the first check's start line arrived (it never is if the lines come as the checks run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_NPU_SIMULATE", "TERM")}
    env.update(PYTHONPATH=str(REPO), LIGHTNING_NPU_SIMULATE="2")
    args = [WARM_PYTHON.command(env), "-m", "lightning_npu.cli", "selftest", "--quick", "--json",
            str(tmp_path / "selftest.json"), "--workdir", str(tmp_path)]
    reader, writer = pty.openpty() if terminal else os.pipe()
    output, checkpoint_at_first_line = b"", None
    with subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer) as popen:
        os.close(writer)
        try:
            while True:
                if not select.select([reader], [], [], E2E_TIMEOUT_S)[0]:
                    popen.kill()
                    raise AssertionError(f"the selftest printed nothing for {E2E_TIMEOUT_S} s:\n{output[-8000:]}")
                try:
                    chunk = os.read(reader, 1 << 16)
                except OSError:  # EIO: the pseudo-terminal's last writer closed it
                    chunk = b""
                if not chunk:
                    break
                output += chunk
                if checkpoint_at_first_line is None and b"selftest [1/" in output:
                    checkpoint_at_first_line = (tmp_path / "selftest-checkpoint").exists()
        finally:
            os.close(reader)
        status = popen.wait(timeout=E2E_TIMEOUT_S)
    return status, output.decode(), checkpoint_at_first_line


def _progress_ends(output, data):
    """(check, outcome) of each progress line that ends a check, in order; their numbers must count 1, 2, ..."""
    ends = re.findall(r"^selftest \[(\d+)/(\d+)\] (.*) \.\.\. (.+) [\d.]+ s$", output, re.MULTILINE)
    assert [int(number) for number, *_ in ends] == list(range(1, len(ends) + 1)), output[-8000:]
    assert {int(total) for _, total, *_ in ends} == {len(ends)} and len(data["checks"]) == len(ends) + 2
    return [(label, outcome) for *_, label, outcome in ends]




# ---------------------------------------------------------------- kernels, through the strict fake


def _wrong_attention(original):
    def call(*args, **kwargs):
        return original(*args, **{**kwargs, "scale": 1.0})  # the op's default scale, not 1/sqrt(head_dim)
    return call


def _wrong_rms_norm(original):
    def call(x, gamma, epsilon=1e-6):
        return original(x, torch.ones_like(gamma), epsilon=epsilon)  # gamma ignored
    return call


def _wrong_rotary(original):
    def call(x, r1, r2):
        return original(x, r1, r2, rotary_mode="interleave")  # the other pairing of channels
    return call


def _wrong_swiglu(original):
    def call(x, dim=-1):
        a, b = x.chunk(2, dim=dim)
        return original(torch.cat((b, a), dim=dim), dim=dim)  # gate and up swapped
    return call


def _wrong_grouped_matmul(original):
    def call(x, weight, **kwargs):
        out = original(x, weight, **kwargs)
        return [out[0].flip(0)] if kwargs["group_type"] == 2 else out  # each expert gets another's weight gradient
    return call


def _wrong_token_permute(original):
    def call(tokens, indices, *args, **kwargs):
        permuted, sorted_indices = original(tokens, indices, *args, **kwargs)
        return permuted, torch.argsort(sorted_indices).to(torch.int32)  # the argsort convention, not CANN's
    return call


def _wrong_weight_quant_matmul(original):
    def call(x, weight, antiquant_scale, **kwargs):
        return original(x, weight, antiquant_scale.flip(-1), **kwargs)  # each channel decoded with another's scale
    return call


WRONG = {"attention": ("npu_fusion_attention", _wrong_attention), "rms_norm": ("npu_rms_norm", _wrong_rms_norm),
         "rotary": ("npu_rotary_mul", _wrong_rotary), "swiglu": ("npu_swiglu", _wrong_swiglu),
         "grouped_matmul": ("npu_grouped_matmul", _wrong_grouped_matmul),
         "token_permute": ("npu_moe_token_permute", _wrong_token_permute),
         "weight_quant_matmul": ("npu_weight_quant_batchmatmul", _wrong_weight_quant_matmul)}
#: The ops whose fused kernel takes no fp32 input: their fp32 check is "not available".
HALF_PRECISION_ONLY = {"weight_quant_matmul"}


def _tiny_cases():
    return [case for case in kernels.kernel_cases(quick=True) if case.name.startswith("tiny")]


@pytest.fixture
def fake_npu(monkeypatch):
    """The strict fake torch_npu with the kernels treating CPU tensors as NPU tensors (as tests/test_kernels.py)."""
    monkeypatch.setattr(_dispatch, "_announced", set())
    monkeypatch.setattr(_dispatch, "_device_name", {})
    monkeypatch.setattr(attention_mod, "_cann", {})
    monkeypatch.setattr(attention_mod, "_announced_value_paths", set())
    fake = install_fake_torch_npu(monkeypatch)
    monkeypatch.setattr(_dispatch, "_on_npu", lambda x: True)
    return fake


@pytest.mark.slow
def test_fused_kernels_that_match_the_reference_pass_with_errors_and_timings(fake_npu):
    """Catches a check that never calls the fused op, compares nothing, or times without synchronising the
    device through the runtime (every torch_npu call here goes through the strict fake)."""
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=_tiny_cases()))
    assert [r.name for r in results] == [f"{op} {dt}" for op in WRONG for dt in ("fp32", "bf16", "fp16")]
    for result in results:
        if result.name.partition(" ")[0] in HALF_PRECISION_ONLY and result.name.endswith("fp32"):
            assert result.verdict == "not available" and "takes fp16/bf16 inputs" in result.detail, result
            continue
        assert result.verdict == "pass", result
        assert result.figures["max_err"] <= kernels.TOLERANCES[torch.float32 if "fp32" in result.name else
                                                               torch.bfloat16].max_err
        assert result.figures["fused_s"] > 0 and result.figures["reference_s"] > 0
    for op, (npu_op, _) in WRONG.items():
        dtypes = 2 if op in HALF_PRECISION_ONLY else 3
        assert len(fake_npu.calls_to(npu_op)) >= dtypes * 4  # each dtype: checked run, warm-up, 3 timed runs
    # The ring-attention step's backward: its blocks' grad op with the merged statistics.
    assert len(fake_npu.calls_to("npu_fusion_attention_grad")) >= 3 * 4
    assert len(fake_npu.calls_to("npu.synchronize")) > 0


@pytest.mark.slow
@pytest.mark.parametrize("op", list(WRONG))
def test_a_wrong_fused_kernel_fails_its_check_and_names_its_fallback_switch(fake_npu, monkeypatch, op):
    """Catches a kernel check blind to a wrong kernel (a realistic bug per op: attention without its scale, RMSNorm
    ignoring gamma, rotary pairing channels the other way, SwiGLU with gate and up swapped, int8 channels decoded with
    another channel's scale), and a report that does
    not fail the run or does not say how to train around it."""
    npu_op, make_wrong = WRONG[op]
    monkeypatch.setattr(fake_npu.torch_npu, npu_op, make_wrong(getattr(fake_npu.torch_npu, npu_op)))
    cases = [case for case in _tiny_cases() if case.op == op]
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=cases))
    checked = results[1:] if op in HALF_PRECISION_ONLY else results
    assert [r.verdict for r in checked] == ["fail"] * len(checked) and len(results) == 3
    assert all(r.fallback == f"LIGHTNING_NPU_DISABLE_FUSED={op}" for r in checked)
    full = report.Report(versions={"torch": torch.__version__}, chip={"name": "Ascend910B2"}, checks=results)
    text = report.render(full)
    assert full.exit_code == 1
    first = "bf16" if op in HALF_PRECISION_ONLY else "fp32"
    assert f"FAILED kernels/{op} {first}: {_dispatch.FUSED_OPS[op].npu_op} differs from the PyTorch reference" in text
    assert f"to train meanwhile, set LIGHTNING_NPU_DISABLE_FUSED={op}" in text


@pytest.mark.slow
def test_packed_attention_attending_across_samples_fails_the_attention_check(fake_npu, monkeypatch):
    """Catches a selftest blind to the varlen (document) mask of SFT rows: an npu_fusion_attention that ignores the
    sample boundaries (TND with one sample of all T tokens) must fail kernels/attention, naming the packed case,
    although every unpacked case still passes."""
    original = fake_npu.torch_npu.npu_fusion_attention

    def leaking(*args, **kwargs):
        if kwargs.get("input_layout") == "TND":
            everything = [kwargs["actual_seq_qlen"][-1]]
            kwargs = {**kwargs, "actual_seq_qlen": everything, "actual_seq_kvlen": everything}
        return original(*args, **kwargs)

    monkeypatch.setattr(fake_npu.torch_npu, "npu_fusion_attention", leaking)
    cases = [case for case in _tiny_cases() if case.op == "attention"]
    assert any("packed" in case.name for case in cases) and any("packed" not in case.name for case in cases)
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=cases))
    assert [r.verdict for r in results] == ["fail"] * 3
    assert all("differs from the PyTorch reference at tiny packed" in r.detail for r in results)
    unpacked = [case for case in cases if "packed" not in case.name]
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=unpacked))
    assert [r.verdict for r in results] == ["pass"] * 3


@pytest.mark.slow
def test_attention_that_mishandles_smaller_value_heads_fails_the_attention_check_at_the_mla_cases(
        fake_npu, monkeypatch, tmp_path):
    """Catches a selftest blind to MLA's head dims (q/k 192, v 128; v unpadded on CANN 8.2.RC1): an
    npu_fusion_attention that takes its scale from v's head dim when it is smaller than k's must fail
    kernels/attention naming an MLA case, while the cases with one head dim still pass."""
    install_cann(monkeypatch, tmp_path, "8.2.RC1")
    original = fake_npu.torch_npu.npu_fusion_attention

    def value_scaled(query, key, value, *args, **kwargs):
        if value.shape[-1] < key.shape[-1]:
            kwargs = {**kwargs, "scale": value.shape[-1] ** -0.5}
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(fake_npu.torch_npu, "npu_fusion_attention", value_scaled)
    cases = [case for case in _tiny_cases() if case.op == "attention"]
    mla = [case for case in cases if "mla" in case.name]
    assert [case.name for case in mla] == ["tiny mla b2 q64 kv64 h4/4 d192/128",
                                           "tiny mla packed 3 samples T64 h4/4 d192/128",
                                           "tiny mla ring step b1 q32 kv64 h4/4 d192/128"]
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=mla))
    assert [r.verdict for r in results] == ["fail"] * 3
    assert all("differs from the PyTorch reference at tiny mla" in r.detail for r in results)
    one_head_dim = [case for case in cases if "mla" not in case.name]
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=one_head_dim))
    assert [r.verdict for r in results] == ["pass"] * 3


@pytest.mark.slow
def test_mla_attention_cases_pass_with_v_unpadded_on_cann_8_2(fake_npu, monkeypatch, tmp_path):
    """The MLA cases pass with v reaching the op at its own head dim on CANN 8.2.RC1 (the quick-tier run above reads
    no CANN, so pads)."""
    install_cann(monkeypatch, tmp_path, "8.2.RC1")
    mla = [case for case in _tiny_cases() if "mla" in case.name]
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=mla))
    assert [r.verdict for r in results] == ["pass"] * 3
    assert {call["value"].shape[-1] for call in fake_npu.calls_to("npu_fusion_attention")} == {128}


def test_bf16_is_not_available_on_a_chip_without_it(monkeypatch):
    """Catches bf16 kernels run (and failed) on a 910A, which has no bf16 units."""
    install_fake_torch_npu(monkeypatch, device_name="Ascend910A")
    monkeypatch.setattr(_dispatch, "_device_name", {})
    results = _run(kernels.kernel_checks(NPURuntime(), torch.device("cpu"), quick=True, cases=_tiny_cases()[:1]))
    verdicts = {r.name: r.verdict for r in results}
    assert verdicts["attention bf16"] == "not available"
    assert verdicts["attention fp32"] == "not available"  # CPU tensors: the reference path, never "pass"


# ---------------------------------------------------------------- collectives


class _WrongAllGather:
    """torch.distributed with an all_gather_into_tensor that corrupts the last element it writes."""

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_gather_into_tensor(self, output, input, group=None):
        work = dist.all_gather_into_tensor(output, input, group=group)
        output[-1] += 1
        return work


@pytest.fixture
def one_rank_group(simulate):
    simulate(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield runtime_pkg.get_runtime()
    dist.destroy_process_group()


def test_a_wrong_collective_result_fails_only_that_collective(one_rank_group):
    """Catches a collective check that does not compare results exactly (one wrong element of a million)."""
    sizes = (64 * 1024,)
    right = _run(collectives.collective_checks(one_rank_group, torch.device("cpu"), sizes=sizes, iterations=1))
    assert [r.verdict for r in right] == ["pass"] * 7 + ["not available"]  # no peer to send to on one rank
    wrong = _run(collectives.collective_checks(one_rank_group, torch.device("cpu"), sizes=sizes, iterations=1,
                                               ops=_WrongAllGather()))
    assert {r.name: r.verdict for r in wrong} == {"all_reduce": "pass", "all_gather_into_tensor": "fail",
                                                  "reduce_scatter_tensor": "pass", "all_to_all_single": "pass",
                                                  "all_to_all_single uneven": "pass", "all_gather": "pass",
                                                  "broadcast": "pass", "send/recv (batch_isend_irecv)": "not available"}
    assert "rank 0: 1 of 16384 elements differ from the exact result at 64KiB" in wrong[1].detail


def test_a_rank_whose_collective_failed_fails_the_merged_result():
    ok = report.CheckResult("collectives", "all_reduce", "pass", "exact on 2 rank(s)", {"ranks": 2})
    bad = report.CheckResult("collectives", "all_reduce", "fail", "rank 1: 3 of 8 elements differ")
    (merged,) = report.merge_ranks([[ok], [bad]])
    assert merged.verdict == "fail" and merged.detail == "rank 1: 3 of 8 elements differ" and merged.figures == {"ranks": 2}


# ---------------------------------------------------------------- training


_TRAIN_WITH_A_RESUME_THAT_DROPS_THE_OPTIMIZER = textwrap.dedent("""
    import json, sys
    from lightning.fabric import Fabric
    import lightning_npu
    from lightning_npu.runtime import get_runtime
    from lightning_npu.selftest.training import check_training
    original = Fabric.load
    def load(self, path, state=None, strict=True):
        # The bug under test: a resume that restores the weights and the step but not AdamW's moments.
        optimizer = state.pop("optimizer")
        try:
            return original(self, path, state, strict=False)
        finally:
            state["optimizer"] = optimizer
    Fabric.load = load
    fabric = Fabric(accelerator="npu", devices=1, strategy="npu_fsdp")
    fabric.launch()
    results = check_training(fabric, get_runtime(), sys.argv[1], steps=6, precision="32-true")
    print(json.dumps({r.name: [r.verdict, r.detail] for r in results}))
""")


@pytest.mark.slow
def test_a_resume_that_does_not_reproduce_the_run_fails_the_training_check(tmp_path):
    """Catches a resume check that compares nothing or too loosely: dropping the optimizer state from the load
    changes the resumed losses and must fail training/resume (the end-to-end test sees the intact load pass)."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_NPU_SIMULATE"}
    env.update(PYTHONPATH=str(REPO), LIGHTNING_NPU_SIMULATE="1")
    proc = subprocess.run([WARM_PYTHON.command(env), "-c", _TRAIN_WITH_A_RESUME_THAT_DROPS_THE_OPTIMIZER, str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    verdicts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdicts["loss"][0] == "pass" and verdicts["resume"][0] == "fail"
    # Step 3's loss comes before the first optimizer step, from the restored weights; step 4 shows the lost moments.
    assert verdicts["resume"][1].startswith("resuming the sharded checkpoint of step 3 does not reproduce the run:"
                                            " step 4 gave")


def test_a_loss_that_does_not_fall_fails():
    assert training.loss_result([5.5, 5.5, 5.4]).verdict == "fail"
    assert training.loss_result([5.5, float("nan"), 1.0]).verdict == "fail"
    assert training.loss_result([5.5, 4.0, 3.0]).verdict == "pass"


_PLAIN_LOSSES = [5.7494, 5.0109, 4.2829, 3.5560]


def test_a_pipelined_loss_off_plain_npu_fsdps_fails_the_pipelined_step():
    """Catches a comparison too loose for fp32 or too tight for bf16, and a pipeline that does not learn."""
    assert training.pipeline_result(_PLAIN_LOSSES, _PLAIN_LOSSES, 1e-5, rank=0).verdict == "pass"
    off = [x * (1 + 2e-5) for x in _PLAIN_LOSSES]
    wrong = training.pipeline_result(off, _PLAIN_LOSSES, training.PIPELINE_TOLERANCE["32-true"], rank=1)
    assert wrong.verdict == "fail" and wrong.fallback.startswith("pipeline_parallel_size=1")
    assert wrong.detail.startswith("rank 1: step 0's pipelined loss 5.74951 differs from plain npu_fsdp's 5.7494")
    # bf16's tolerance takes rounding noise, not a lost microbatch (a loss over 3 of 4 rows' tokens).
    assert training.pipeline_result(off, _PLAIN_LOSSES, training.PIPELINE_TOLERANCE["bf16-mixed"], rank=0).verdict == "pass"
    lost = [x * 3 / 4 for x in _PLAIN_LOSSES]
    assert training.pipeline_result(lost, _PLAIN_LOSSES, training.PIPELINE_TOLERANCE["bf16-mixed"], rank=0).verdict == "fail"
    nan = [*_PLAIN_LOSSES[:-1], float("nan")]
    assert training.pipeline_result(nan, _PLAIN_LOSSES, 1e-5, rank=0).verdict == "fail"
    flat = [5.7, 5.6, 5.5, 5.4]
    stuck = training.pipeline_result(flat, flat, 1e-5, rank=0)
    assert stuck.verdict == "fail" and "did not fall below 0.9 x the first step's" in stuck.detail


def test_the_pipelined_step_is_info_where_the_ranks_cannot_form_two_stages():
    """Catches a selftest that fails (or hangs building a mesh) on one rank or an odd world size."""
    config = model.DecoderConfig()
    assert [training.pipeline_problem(world, nodes, config) for world, nodes in ((2, 1), (4, 1), (16, 2))] == [None] * 3
    assert "does not divide the world size 3" in training.pipeline_problem(3, 1, config)
    one_rank = SimpleNamespace(world_size=1, global_rank=0, strategy=SimpleNamespace(num_nodes=1))
    result = training.check_pipeline(one_rank, runtime=None, precision="32-true")
    assert result.verdict == "info" and result.label == "training/pipelined step (1F1B)"
    assert result.detail == "not run on 1 rank(s): 2 pipeline stages need at least 2 ranks"


# ---------------------------------------------------------------- options


def test_an_unknown_kernel_in_the_disable_switch_stops_the_selftest_before_it_starts(monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_NPU_DISABLE_FUSED", "flash")
    assert main(["selftest", "--quick"]) == 2
    assert "LIGHTNING_NPU_DISABLE_FUSED='flash' names 'flash', which is not a fused kernel" in capsys.readouterr().err
