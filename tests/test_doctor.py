"""`lightning-npu doctor`: each diagnosis on an environment built to be broken that way.

torch_npu is never installed: broken environments are stand-in distributions (a dist-info with METADATA, and
for the autoload trap the real wheel's `[torch.backends]` entry point) whose package fails on import exactly
like the real one does without CANN. In-process tests put them on sys.path; the autoload trap needs a fresh
interpreter and runs `python -m lightning_npu.cli doctor` with the stand-in on PYTHONPATH.
"""

import json
import re
import os
import platform
import subprocess
import sys

import pytest
import torch

from lightning_npu.cli import main
from lightning_npu.doctor import cann, probe, rules
from tests.helpers import REPO
from tests.npu_fake import install_fake_torch_npu

AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
LIBHCCL = "libhccl.so: cannot open shared object file: No such file or directory"
#: The real torch_npu/__init__.py's first lines, then the failure its `torch_npu._C` import hits without CANN.
#: It switches autoload off before its own `import torch` and switches it back only on success (in _autoload).
STAND_IN_PACKAGE = f"""\
import os
ORG_AUTOLOAD = os.getenv("{AUTOLOAD}", "1")
os.environ["{AUTOLOAD}"] = "0"
import torch
raise ImportError({{error!r}})


def _autoload():
    os.environ["{AUTOLOAD}"] = ORG_AUTOLOAD
"""


def make_torch_npu(site, version="2.13.0", import_error=LIBHCCL, entry_point=True):
    """A stand-in torch_npu distribution in ``site``: metadata, the wheel's entry point, a failing package."""
    package = site / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN_PACKAGE.format(error=import_error))
    info = site / f"torch_npu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
    if entry_point:
        (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return site


def make_cann(root, version="8.0.RC2", layout="info"):
    """A CANN toolkit tree as the installer lays it out: ascend-toolkit/latest plus set_env.sh beside it."""
    home = root / "Ascend" / "ascend-toolkit" / "latest"
    if layout == "info":
        arch = home / f"{platform.machine()}-linux"
        arch.mkdir(parents=True)
        (arch / "ascend_toolkit_install.info").write_text(
            f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C18SPC001B220\n"
            f"arch={platform.machine()}\nos=linux\npath={arch}\n"
        )
    else:
        home.mkdir(parents=True)
        (home / "version.cfg").write_text(
            f"# version: 1.0\nruntime_running_version=[7.3.0.1.231:{version}]\n"
            f"toolkit_running_version=[7.3.0.1.231:{version}]\n"
        )
    (home.parent / "set_env.sh").write_text("export ASCEND_HOME_PATH=...\n")
    return home


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No NPU settings from the machine running the tests, and no CANN outside tmp_path."""
    for var in [v.name for v in rules.ENV_VARS] + ["ASCEND_TOOLKIT_HOME", "PYTORCH_ALLOC_CONF",
                                                     "HCCL_ASYNC_ERROR_HANDLING"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cann, "DEFAULT_CANN_HOMES", (str(tmp_path / "no-cann"),))


def run_doctor(capsys, *args):
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def problems(out):
    return out.split("\nProblems", 1)[1]


# ------------------------------------------------------------------------------------------------ in-process


def test_machine_without_npu_says_why_and_fails(capsys):
    code, out = run_doctor(capsys)
    assert code == 1
    assert f"torch          {torch.__version__}" in out
    assert "torch_npu      not installed" in out
    assert "CANN           not found (looked in" in out
    assert "NPUs          none usable: torch_npu is not installed" in out
    wanted = ".".join(torch.__version__.split("+")[0].split(".")[:3])
    assert f"ERROR    NPU: torch_npu is not installed\n           fix: on an Ascend machine run `pip install " \
           f"torch-npu=={wanted}`" in out
    assert out.rstrip().endswith("Not ready: 1 error(s), 0 warning(s) (exit status 1).")


def test_simulation_alone_is_healthy(capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "2")
    code, out = run_doctor(capsys)
    assert code == 0
    assert "simulation    on: 2 simulated NPU(s) on the CPU" in out
    assert "NOTE     NPU: no real NPU is usable (torch_npu is not installed); accelerator='npu' runs 2 simulated" in out
    assert "ERROR" not in problems(out)
    assert out.rstrip().endswith("Ready: 0 error(s), 0 warning(s) (exit status 0).")


def test_invalid_simulation_value_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "two")
    code, out = run_doctor(capsys)
    assert code == 1
    assert "ERROR    LIGHTNING_NPU_SIMULATE: LIGHTNING_NPU_SIMULATE='two' is not a number of devices" in out
    assert "fix: set it to a positive integer such as 2" in out


def test_healthy_npu_machine_passes(capsys, monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=8)
    # What `import torch_npu` does to torch.distributed.
    monkeypatch.setitem(torch.distributed.Backend.default_device_backend_map, "npu", "hccl")
    code, out = run_doctor(capsys)
    assert code == 0, out
    assert "NPUs          8 x Ascend910B2" in out
    assert "bf16          supported" in out
    assert "peak          353.9 TFLOP/s bf16 per chip" in out
    assert "memory        64.0 GiB per NPU" in out
    assert "HCCL          registered for npu" in out
    assert "Problems: none" in out


def test_fp16_only_chip_and_forgotten_simulation_are_flagged(capsys, monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=2, device_name="Ascend910A", bf16_supported=False)
    monkeypatch.setitem(torch.distributed.Backend.default_device_backend_map, "npu", "hccl")
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "2")
    code, out = run_doctor(capsys)
    assert code == 0  # both are warnings: training can run
    assert "WARNING  bf16: Ascend910A has no bf16 units: precision='bf16-mixed' will fail" in out
    assert "fix: use precision='16-mixed'" in out
    assert ("WARNING  LIGHTNING_NPU_SIMULATE: LIGHTNING_NPU_SIMULATE=2 makes accelerator='npu' run on the CPU although"
            " 2 NPU(s) are available") in out


def test_torch_npu_built_for_another_torch(capsys, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(make_torch_npu(tmp_path / "site", version="2.6.0", entry_point=False)))
    code, out = run_doctor(capsys)
    assert code == 1
    assert "torch_npu      2.6.0" in out
    assert f"ERROR    NPU: torch {torch.__version__} and torch_npu 2.6.0 do not match" in out
    assert "fix: install torch-npu==2.13.0 or the torch release your torch_npu was built for" in out


def test_cann_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(AUTOLOAD, "0")  # the user already avoids the autoload trap; `import torch_npu` still fails
    monkeypatch.syspath_prepend(str(make_torch_npu(tmp_path / "site")))
    code, out = run_doctor(capsys)
    assert code == 1
    assert "CANN           not found" in out
    assert f"ERROR    NPU: torch_npu is installed but the CANN libraries are missing ({LIBHCCL})" in out
    assert "fix: install the CANN toolkit and source its environment before starting Python, e.g." \
           " `source /usr/local/Ascend/ascend-toolkit/set_env.sh`" in out
    assert "NOTE     TORCH_DEVICE_BACKEND_AUTOLOAD: TORCH_DEVICE_BACKEND_AUTOLOAD=0: `import torch` does not" in out


def test_cann_installed_but_not_sourced(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(AUTOLOAD, raising=False)  # the stand-in sets it; monkeypatch restores "unset" afterwards
    home = make_cann(tmp_path)
    monkeypatch.setattr(cann, "DEFAULT_CANN_HOMES", (str(home),))
    monkeypatch.syspath_prepend(str(make_torch_npu(tmp_path / "site", entry_point=False)))
    code, out = run_doctor(capsys)
    assert code == 1
    assert f"CANN           8.0.RC2 ({home})" in out
    assert f"WARNING  CANN: CANN 8.0.RC2 is installed at {home} but its environment is not loaded in this shell" in out
    assert f"fix: `source {home.parent / 'set_env.sh'}`" in out


@pytest.mark.parametrize("layout", ["info", "cfg"])
def test_cann_version_is_read_from_either_documented_file(tmp_path, layout):
    home = make_cann(tmp_path, version="8.1.RC1", layout=layout)
    found = cann.find_cann({"ASCEND_HOME_PATH": str(home)})
    assert found.version == "8.1.RC1"
    assert found.version_file.endswith("ascend_toolkit_install.info" if layout == "info" else "version.cfg")
    assert found.set_env == str(home.parent / "set_env.sh")


def test_ascend_home_path_without_cann_is_flagged(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "empty"))
    _, out = run_doctor(capsys)
    assert f"WARNING  CANN: ASCEND_HOME_PATH={tmp_path / 'empty'} holds no CANN toolkit" in out


@pytest.mark.parametrize(
    ("value", "message", "fix"),
    [
        ("0, 1", "ASCEND_RT_VISIBLE_DEVICES='0, 1' is malformed: torch_npu reads only device(s) 0 from it"
         " (it stops at the first empty field or character other than a digit or comma)",
         "use comma-separated device ids without spaces, e.g. 0,1"),
        ("3,1", "ASCEND_RT_VISIBLE_DEVICES='3,1' is not strictly ascending (CANN then shows no device)",
         "list each id once in ascending order, e.g. 1,3"),
    ],
)
def test_malformed_visible_devices_is_an_error_even_when_simulating(capsys, monkeypatch, value, message, fix):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", value)
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "1")
    code, out = run_doctor(capsys)
    assert code == 1
    assert f"ERROR    ASCEND_RT_VISIBLE_DEVICES: {message}\n           fix: {fix}" in out
    assert f"ASCEND_RT_VISIBLE_DEVICES        {value}" in out


def test_bad_hccl_timeout_fails_the_check(capsys, monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "60")
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "1")
    code, out = run_doctor(capsys)
    assert code == 1
    assert "HCCL_CONNECT_TIMEOUT             60" in out
    assert ("ERROR    HCCL_CONNECT_TIMEOUT: HCCL_CONNECT_TIMEOUT=60 is outside the documented range [120, 7200] s"
            " (how long ranks wait for each other while HCCL sets up links)") in out
    assert "fix: set it within [120, 7200], or unset it for the default" in out


@pytest.mark.parametrize(
    ("env", "level", "text"),
    [
        ({"HCCL_CONNECT_TIMEOUT": "7201"}, "error", "outside the documented range [120, 7200] s"),
        ({"HCCL_CONNECT_TIMEOUT": "2m"}, "error", "HCCL_CONNECT_TIMEOUT='2m' is not an integer"),
        ({"HCCL_EXEC_TIMEOUT": "-1"}, "error", "outside the documented range [0, 2147483647] s"),
        ({"HCCL_EXEC_TIMEOUT": "0"}, "warning", "leaves the others hanging forever"),
        ({"HCCL_EXEC_TIMEOUT": "nan"}, "error", "HCCL_EXEC_TIMEOUT='nan' is not a number"),
        ({"HCCL_BUFFSIZE": "0"}, "error", "HCCL_BUFFSIZE=0 is outside the documented range >= 1 MB"),
        ({"HCCL_IF_IP": "10.0.0.300"}, "error", "HCCL_IF_IP='10.0.0.300' is not an IP address"),
        ({"HCCL_IF_IP": "10.0.0.3", "HCCL_SOCKET_IFNAME": "eth"}, "note", "HCCL_IF_IP takes precedence"),
        ({"HCCL_SOCKET_IFNAME": "ib"}, "warning", "matches none of this host's network interfaces (lo, eth0)"),
        ({"HCCL_SOCKET_IFNAME": "=eth"}, "warning", "matches none of this host's network interfaces"),
        ({"HCCL_IF_BASE_PORT": "80"}, "error", "HCCL_IF_BASE_PORT=80 is outside the documented range [1024, 65520]"),
        ({"TORCH_HCCL_ASYNC_ERROR_HANDLING": "4"}, "error", "is not one of 0, 1, 2, 3"),
        ({"HCCL_ASYNC_ERROR_HANDLING": "1"}, "warning", "HCCL_ASYNC_ERROR_HANDLING is deprecated"),
        ({"HCCL_DETERMINISTIC": "yes"}, "error", "HCCL_DETERMINISTIC='yes' is not one of false, true, strict"),
        ({"TASK_QUEUE_ENABLE": "3"}, "error", "TASK_QUEUE_ENABLE='3' is not one of 1, 0, 2"),
        ({"ASCEND_LAUNCH_BLOCKING": "1"}, "warning", "runs every operator synchronously"),
        ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments=True"}, "error", "is not a key:value pair"),
        ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:yes"}, "error", "must be True or False"),
        ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "x:1"}, "error",
         "both set; torch_npu refuses"),
    ],
)
def test_environment_values_are_checked(env, level, text):
    _, findings = rules.check_environment(env, interfaces=["lo", "eth0"])
    assert [(f.level, text in f.cause) for f in findings] == [(level, True)], findings


@pytest.mark.parametrize(
    "env",
    [
        {"HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "1836.5", "HCCL_BUFFSIZE": "400", "HCCL_IF_IP": "fe80::1",
         "HCCL_IF_BASE_PORT": "50000", "HCCL_DETERMINISTIC": "strict", "TASK_QUEUE_ENABLE": "2",
         "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128", AUTOLOAD: "1"},
        {"HCCL_SOCKET_IFNAME": "=eth0"},
        {"HCCL_SOCKET_IFNAME": "^eth"},
        {"HCCL_SOCKET_IFNAME": "en,eth"},
    ],
)
def test_good_environment_values_pass(env):
    assert rules.check_environment(env, interfaces=["lo", "eth0"])[1] == []


def test_probe_results_carry_cause_and_fix_apart(monkeypatch):
    """Catches: the probe handing over one "cause; fix" string (which the doctor would have to parse back apart)."""
    from lightning_npu.runtime.probe import probe_npu

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3,1")
    result = probe_npu()
    assert (result.available, result.cause, result.fix) == (
        False, "ASCEND_RT_VISIBLE_DEVICES='3,1' is not strictly ascending (CANN then shows no device)",
        "list each id once in ascending order, e.g. 1,3")
    assert result.reason == f"{result.cause}; {result.fix}"


def test_a_cause_containing_a_semicolon_is_shown_whole(capsys, monkeypatch, tmp_path):
    """Catches: the doctor splitting the runtime's message at "; " (here inside the text of the ImportError that
    `import torch_npu` raises), which printed half of the cause as a bogus fix."""
    error = "libtorch_npu.so: undefined symbol: _ZN3c10; built for another torch"
    monkeypatch.setenv(AUTOLOAD, "0")
    monkeypatch.syspath_prepend(str(make_torch_npu(tmp_path / "site", import_error=error, entry_point=False)))
    code, out = run_doctor(capsys)
    assert code == 1
    assert f"ERROR    NPU: `import torch_npu` failed: ImportError: {error}\n" in out
    assert "fix: built for another torch" not in out


def test_json_report_matches_the_exit_code(capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "3")
    code, out = run_doctor(capsys, "--json")
    report = json.loads(out)
    assert code == report["exit_code"] == 0
    assert report["devices"]["simulated_devices"] == 3
    assert {"name": "LIGHTNING_NPU_SIMULATE", "value": "3", "when_unset": "off (real NPUs)"} in report["environment"]


def test_dispatcher_usage(capsys):
    assert main([]) == 2
    assert re.search(r"\n  doctor +check that this machine can train on Ascend NPUs", capsys.readouterr().err)
    assert main(["--help"]) == 0
    assert "usage: lightning-npu <command> [options]" in capsys.readouterr().out
    assert main(["fly"]) == 2
    assert "unknown command 'fly'; choose one of: consolidate, doctor, plan, run" in capsys.readouterr().err
    assert main(["doctor", "--bogus"]) == 2
    assert main(["doctor", "--help"]) == 0
    assert "exit status:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ fresh interpreter


def doctor_subprocess(site, *args):
    env = {k: v for k, v in os.environ.items() if k not in (AUTOLOAD, "LIGHTNING_NPU_SIMULATE", "ASCEND_HOME_PATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return subprocess.run([sys.executable, "-m", "lightning_npu.cli", "doctor", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_autoload_trap_import_torch_fails_but_doctor_runs(tmp_path):
    proc = doctor_subprocess(make_torch_npu(tmp_path / "site"))
    out = proc.stdout
    assert out.startswith("lightning-npu doctor") and proc.returncode == 1, proc.stderr[-3000:]
    assert ("import torch  FAILS: RuntimeError: Failed to load the backend extension: torch_npu. You can disable"
            " extension auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0. (with TORCH_DEVICE_BACKEND_AUTOLOAD=0: ok)"
            ) in out
    assert f"and loading torch_npu failed: ImportError: {LIBHCCL}" in problems(out)
    assert "`export TORCH_DEVICE_BACKEND_AUTOLOAD=0` lets `import torch` work without torch_npu" in problems(out)
    assert "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`" in problems(out)
    assert f"ERROR    NPU: torch_npu is installed but the CANN libraries are missing ({LIBHCCL})" in out
    # The failed autoload set TORCH_DEVICE_BACKEND_AUTOLOAD=0 in the doctor's process; the report shows the user's.
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD    (unset" in out


def test_broken_torch_install_is_diagnosed_without_torch(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object file')")
    proc = doctor_subprocess(site)
    out = proc.stdout
    assert out.startswith("lightning-npu doctor") and proc.returncode == 1, proc.stderr[-3000:]
    assert "import torch  FAILS: ImportError: libtorch_cpu.so: cannot open shared object file" in out
    assert "NPUs          not probed (torch cannot be imported)" in out
    assert f"fix: reinstall torch: `pip install --force-reinstall torch=={torch.__version__}`" in out


def test_cli_modules_import_nothing_that_imports_torch():
    """The doctor must start where `import torch` fails: top-level imports of the CLI and the doctor's modules are
    stdlib or torch-free lightning_npu modules, and importing them all in a fresh interpreter loads no torch."""
    import ast
    from pathlib import Path

    import lightning_npu.doctor

    package = Path(lightning_npu.__file__).parent
    torch_free = ("lightning_npu.cli", "lightning_npu.cluster", "lightning_npu.doctor", "lightning_npu.facts",
                  "lightning_npu.timeouts")
    cli = package / "cli"
    paths = [cli / "__init__.py", cli / "__main__.py", cli / "doctor.py", *sorted(Path(lightning_npu.doctor.__file__)
                                                                               .parent.glob("*.py"))]
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__" or name.startswith(torch_free), \
                    f"{path.name} imports {name} at module level"
    # The timeout rule the doctor shares with the strategies imports nothing but the standard library and facts.
    for node in ast.parse((package / "timeouts.py").read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert module.split(".")[0] in sys.stdlib_module_names or module == "__future__" \
                or module.startswith("lightning_npu.facts"), module  # facts: torch-free (tests/test_facts.py)
    modules = ["lightning_npu.cli.doctor"] + [f"lightning_npu.doctor.{p.stem}" for p in paths[3:]]
    code = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_doctor_reports_an_import_torch_that_kills_the_process(tmp_path):
    """Catches: the doctor's own process importing torch (a segfaulting `import torch` -- a broken driver or CANN
    library -- would kill it before it reports), a crashed probe reported as anything but a crash of `import torch`
    that names the signal, a zero exit status, or a traceback."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    proc = doctor_subprocess(site)
    out = proc.stdout
    assert out.startswith("lightning-npu doctor") and proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    crash = ("the torch import probe was killed by signal SIGSEGV (Segmentation fault) during `import torch`"
             f" (in {site / 'torch' / '__init__.py'}, line 2)")
    assert f"import torch  FAILS: {crash} (with {AUTOLOAD}=0: the same)" in out
    assert "NPUs          not probed (torch cannot be imported)" in out
    assert f"ERROR    import torch: `import torch` crashes: {crash}\n           fix: a native library torch" in out
    assert "Traceback" not in out + proc.stderr and "Fatal Python error" not in out + proc.stderr


def test_process_group_timeout_below_hccl_exec_timeout_is_flagged_with_the_fix(capsys, monkeypatch):
    """Catches: the doctor not comparing the process-group timeout with HCCL_EXEC_TIMEOUT (torch_npu advises it
    above both HCCL timeouts), or a fix that does not name a timeout that would pass."""
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "1")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")
    code, out = run_doctor(capsys, "--timeout", "1800")
    assert code == 0  # a warning, not an error
    assert ("WARNING  timeouts: the process-group timeout (1800 s) is not above HCCL_EXEC_TIMEOUT (3600 s;"
            " HCCL_CONNECT_TIMEOUT=120 s (default), HCCL_EXEC_TIMEOUT=3600 s)") in out
    assert "fix: set the strategy's timeout to at least 3660" in out
    assert "export HCCL_EXEC_TIMEOUT=1740" in out
    assert "  process group          1800\n" in out


def test_default_timeouts_agree_with_hccl_defaults(capsys, monkeypatch):
    """Catches: the strategies' default process-group timeout (once 1800 s) below HCCL_EXEC_TIMEOUT's default
    of 1836 s, which every real NPU run would then violate."""
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "1")
    code, out = run_doctor(capsys)
    assert "timeouts:" not in out
    assert "  process group          1896\n" in out and "  HCCL_EXEC_TIMEOUT      1836\n" in out


def test_hang_diagnostics_prints_the_flight_recorder_exports(capsys, monkeypatch):
    """Catches: --hang-diagnostics missing or naming variables torch_npu 2.13 does not read (names checked
    against the wheel's libtorch_npu.so), and overriding a value the user already set."""
    monkeypatch.setenv("LIGHTNING_NPU_SIMULATE", "1")
    monkeypatch.setenv("TORCH_HCCL_TRACE_BUFFER_SIZE", "500")
    _, out = run_doctor(capsys, "--hang-diagnostics")
    for line in ("export TORCH_HCCL_TRACE_BUFFER_SIZE=500", "export TORCH_HCCL_ENABLE_MONITORING=1",
                 "export TORCH_HCCL_DUMP_ON_TIMEOUT=1", "export TORCH_HCCL_DEBUG_INFO_TEMP_FILE=/tmp/hccl_trace_rank_"):
        assert line + "\n" in out
    assert "export" not in run_doctor(capsys)[1]  # only on request
