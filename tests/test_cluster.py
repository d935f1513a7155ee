"""Ascend cluster starts: an Ascend Operator pod's variables (``lightning-npu run``), ModelArts' once-per-card boot
file, and an HCCL rank table, each read as a Lightning cluster environment and checked before any worker starts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning.pytorch import Trainer

from lightning_npu.cli import main
from lightning_npu.cluster import modelarts, pod, rank_table
from lightning_npu.cluster.environments import AscendOperatorEnvironment, ModelArtsEnvironment
from lightning_npu.doctor import rules
from lightning_npu.facts import env as names
from lightning_npu.facts.problem import SettingError
from tests.helpers import REPO, SCRIPTS, free_port, outputs_of, read_json

SCRIPT = "tests/scripts/cluster_train.py"
JOB_YAML = REPO / "recipes/cluster/ascend_job.yaml"
BOOT = REPO / "recipes/cluster/modelarts_boot.sh"
#: Every variable a cluster or launcher could have left in the test's own environment.
_CLUSTER_VARIABLES = (names.RANK, names.LOCAL_RANK, names.WORLD_SIZE, names.LOCAL_WORLD_SIZE, names.MASTER_ADDR,
                      names.MASTER_PORT, names.MINDX_TASK_ID, names.MINDX_SERVER_IP, names.RANK_ID, names.RANK_SIZE,
                      names.ASCEND_DEVICE_ID, names.MA_NUM_HOSTS, names.VC_TASK_INDEX, names.VC_WORKER_HOSTS,
                      names.RANK_TABLE_FILE, names.TORCHELASTIC_RUN_ID, "GROUP_RANK", "NODE_RANK", names.SLURM_NTASKS,
                      names.SLURM_JOB_ID, "SLURM_PROCID", "SLURM_LOCALID")


def _pod_env(rank: int, port: int, **overrides: str) -> dict[str, str]:
    """What the Ascend Operator sets in pod ``rank`` of a 2-pod job with 1 NPU per pod."""
    return {names.RANK: str(rank), names.LOCAL_RANK: "{0}", names.WORLD_SIZE: "2", names.LOCAL_WORLD_SIZE: "1",
            names.MASTER_ADDR: "127.0.0.1", names.MASTER_PORT: str(port), names.MINDX_TASK_ID: "test-job-uid",
            names.MINDX_SERVER_IP: "127.0.0.1", **overrides}


def _card_env(rank: int, port: int, table: Path) -> dict[str, str]:
    """What ModelArts sets for card ``rank`` of a 1-host job with 2 cards."""
    return {names.RANK_ID: str(rank), names.RANK_SIZE: "2", names.ASCEND_DEVICE_ID: str(rank), names.MA_NUM_HOSTS: "1",
            names.VC_TASK_INDEX: "0", names.VC_WORKER_HOSTS: "127.0.0.1", names.MASTER_PORT: str(port),
            names.RANK_TABLE_FILE: str(table)}


def _table(servers: int = 1, devices: int = 2, **top: object) -> dict:
    """A version 1.0 (Atlas A2) hccl.json for ``servers`` x ``devices``, ranks counted server by server."""
    return {"status": "completed", "version": "1.0", "server_count": str(servers), "server_list": [
        {"server_id": f"10.0.0.{s + 1}", "host_ip": f"10.0.0.{s + 1}", "device": [
            {"device_id": str(d), "device_ip": f"192.168.{s}.{d + 1}", "rank_id": str(s * devices + d)}
            for d in range(devices)]} for s in range(servers)], **top}


def _write(path: Path, table: dict) -> Path:
    path.write_text(json.dumps(table))
    return path


@pytest.fixture
def clean_env(monkeypatch):
    for name in _CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- the Ascend Operator's pod variables -----------------------------------------------------------------------


def test_pod_variables_become_the_torchrun_launch_of_one_process_per_npu():
    """Catches RANK read as the process rank (torchrun would give pod 1's first process rank 1, not 8), the NPU list
    or the number of nodes taken from the wrong variable, and the operator's default port forgotten."""
    env = _pod_env(1, 0, **{names.LOCAL_RANK: "{0,1,2,3,4,5,6,7}", names.WORLD_SIZE: "16",
                            names.LOCAL_WORLD_SIZE: "8", names.MASTER_ADDR: "master-svc"})
    del env[names.MASTER_PORT]
    found = pod.AscendPod.from_env(env)
    assert found.torchrun_options() == ["--nproc-per-node=8", "--nnodes=2", "--node-rank=1",
                                        "--master-addr=master-svc", "--master-port=2222"]
    assert "ranks 8 .. 15 of 16" in found.describe()


@pytest.mark.parametrize("value", ["{0,1", "0,1", "{0,a}", "{0,0}", "{}", "[0,1]"])
def test_a_malformed_local_rank_list_fails_the_launch_naming_the_value(tmp_path, capsys, clean_env, simulate, value):
    """Catches a pod whose LOCAL_RANK is not the operator's list reaching torchrun or ``import lightning`` (a bare
    ``int()`` ValueError in torchmetrics) instead of a launcher error naming the value and the form it must have."""
    simulate(2)
    for name, setting in _pod_env(0, free_port(), **{names.LOCAL_RANK: value, names.LOCAL_WORLD_SIZE: "2",
                                                      names.WORLD_SIZE: "2"}).items():
        clean_env.setenv(name, setting)
    status = main(["run", str(SCRIPTS / "cluster_train.py"), "fit", "--model.out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2
    assert f"lightning-npu run: error: LOCAL_RANK={value!r} is not the Ascend Operator's list" in err, err
    assert "'{0,1,2,3}'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "options", "message"),
    [
        ({names.WORLD_SIZE: "3", names.LOCAL_WORLD_SIZE: "2", names.LOCAL_RANK: "{0,1}"}, [],
         "WORLD_SIZE=3 (the job's NPUs) is not a multiple of LOCAL_WORLD_SIZE=2"),
        ({names.WORLD_SIZE: "4", names.LOCAL_WORLD_SIZE: "2", names.LOCAL_RANK: "{0,1}"}, [],
         "LOCAL_WORLD_SIZE=2 (the pod's NPUs): devices=2 asks for more NPUs than are visible: 1 NPU(s) visible"),
        ({names.LOCAL_RANK: "{0,1}"}, [], "LOCAL_RANK='{0,1}' lists NPU ids [0, 1], but LOCAL_WORLD_SIZE=1"),
        ({names.RANK: "2"}, [], "RANK=2 (the pod's rank) must lie in 0 .. 1: the job has 2 pod(s)"),
        ({}, ["--num-nodes", "3"], "--num-nodes 3 disagrees with the Ascend Operator pod, which gives 2"),
        ({names.MASTER_ADDR: ""}, [], "the Ascend Operator pod variables MASTER_ADDR are not set"),
    ],
)
def test_pod_variables_that_disagree_with_the_devices_fail_before_anything_starts(
        tmp_path, capsys, clean_env, simulate, overrides, options, message):
    """Catches a WORLD_SIZE / LOCAL_WORLD_SIZE that does not match the pods or this pod's NPUs (each pod would wait
    at the rendezvous for ranks that never come), and a launcher option silently overriding the pod's."""
    simulate(1)
    for name, setting in _pod_env(0, free_port(), **overrides).items():
        clean_env.setenv(name, setting)
    status = main(["run", *options, str(SCRIPTS / "cluster_train.py"), "fit", "--model.out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_cluster_ascend_operator_outside_a_pod_is_refused(tmp_path, capsys, clean_env, simulate):
    simulate(1)
    status = main(["run", "--cluster", "ascend-operator", str(SCRIPTS / "cluster_train.py")])
    assert status == 2
    assert "--cluster ascend-operator: MINDX_TASK_ID is not set" in capsys.readouterr().err


# ---- detection by the Trainer and Fabric ---------------------------------------------------------------------


def test_the_trainer_and_fabric_detect_the_ascend_environments_in_lightnings_order(clean_env, simulate):
    """Catches the Ascend environments missing from Lightning's detection, or tried in the wrong place: torchrun's
    processes in a pod must be AscendOperatorEnvironment (before TorchElastic), a ModelArts card ModelArtsEnvironment
    unless torchrun started it, and an environment given in ``plugins`` must still win."""
    simulate(2)
    for name, setting in _card_env(1, 29555, Path("unused")).items():
        clean_env.setenv(name, setting)
    clean_env.delenv(names.RANK_TABLE_FILE)
    for build in (lambda **kw: Trainer(accelerator="npu", devices=2, logger=False, **kw),
                  lambda **kw: Fabric(accelerator="npu", devices=2, **kw)):
        environment = build().strategy.cluster_environment
        assert isinstance(environment, ModelArtsEnvironment)
        assert (environment.global_rank(), environment.local_rank(), environment.world_size()) == (1, 1, 2)
        assert (environment.main_address, environment.main_port, environment.creates_processes_externally) == (
            "127.0.0.1", 29555, True)
        given = LightningEnvironment()
        assert build(plugins=[given]).strategy.cluster_environment is given

    # torchrun's workers (as `lightning-npu run` starts them in a pod): ranks from torchrun, the pod's task id kept.
    for name, setting in {names.TORCHELASTIC_RUN_ID: "x", names.RANK: "1", names.LOCAL_RANK: "1",
                          names.WORLD_SIZE: "2", names.LOCAL_WORLD_SIZE: "2", "GROUP_RANK": "0",
                          names.MASTER_ADDR: "127.0.0.1", names.MASTER_PORT: "29555"}.items():
        clean_env.setenv(name, setting)
    assert type(Trainer(accelerator="npu", devices=2, logger=False).strategy.cluster_environment) is TorchElasticEnvironment
    clean_env.setenv(names.MINDX_TASK_ID, "job")
    for build in (lambda: Trainer(accelerator="npu", devices=2, logger=False), lambda: Fabric(accelerator="npu", devices=2)):
        assert type(build().strategy.cluster_environment) is AscendOperatorEnvironment


def test_devices_or_num_nodes_other_than_the_jobs_fail_with_the_settings_to_use(clean_env, simulate):
    """Catches a Trainer whose devices x num_nodes differ from the cluster's processes (ranks that never meet, or a
    process group of the wrong size) getting through with Lightning's bare 'WORLD_SIZE' message or none at all
    (ModelArts: Lightning never checks, each card would just wait)."""
    simulate(2)
    for name, setting in _card_env(0, 29555, Path("unused")).items():
        clean_env.setenv(name, setting)
    clean_env.delenv(names.RANK_TABLE_FILE)
    with pytest.raises(ValueError, match=r"devices=1, num_nodes=1 is not this ModelArts job: 1 host\(s\) x 2 card\(s\)"
                                         r" .*set devices=2 and num_nodes=1"):
        ModelArtsEnvironment().validate_settings(num_devices=1, num_nodes=1)
    for name, setting in {names.TORCHELASTIC_RUN_ID: "x", names.RANK: "0", names.LOCAL_RANK: "0",
                          names.WORLD_SIZE: "4", names.LOCAL_WORLD_SIZE: "2", names.MINDX_TASK_ID: "job"}.items():
        clean_env.setenv(name, setting)
    with pytest.raises(ValueError, match=r"devices=2, num_nodes=1 is not this Ascend Operator job: 2 pod\(s\) x 2"
                                         r" NPU\(s\) .*set devices=2 and num_nodes=2"):
        AscendOperatorEnvironment().validate_settings(num_devices=2, num_nodes=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({names.RANK_ID: "2"}, "RANK_ID=2 is not a rank of host VC_TASK_INDEX=0, which holds ranks 0 .. 1"),
        ({names.ASCEND_DEVICE_ID: "3"}, "ASCEND_DEVICE_ID=3 is not one of this host's 2 card(s)"),
        ({names.RANK_SIZE: "3", names.MA_NUM_HOSTS: "2"}, "RANK_SIZE=3 cards on MA_NUM_HOSTS=2 host(s)"),
        ({names.VC_WORKER_HOSTS: "a,b"}, "VC_WORKER_HOSTS='a,b' names 2 host(s), but MA_NUM_HOSTS=1"),
        ({names.RANK_ID: "x"}, "RANK_ID='x' (this card's global rank) is not an integer"),
    ],
)
def test_modelarts_variables_that_disagree_fail_naming_the_variable(overrides, message):
    with pytest.raises(SettingError) as error:
        modelarts.ModelArtsCard.from_env({**_card_env(0, 29555, Path("unused")), **overrides})
    assert message in str(error.value)


# ---- rank tables -------------------------------------------------------------------------------------------------


def test_rank_tables_of_each_version_are_read_with_their_layout(tmp_path):
    """Catches a valid A3 (1.2, super pods) or Atlas 950 (2.0, flat rank list) table refused, or a layout misread."""
    a2 = rank_table.load(str(_write(tmp_path / "a2.json", _table(2, 8))))
    assert (a2.version, a2.ranks, a2.servers, a2.devices_per_server) == ("1.0", 16, 2, 8)
    a3 = _table(1, 2, version="1.2", super_pod_list=[{"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.1"}]}])
    for device in a3["server_list"][0]["device"]:
        device["super_device_id"] = device["device_id"]
    assert rank_table.load(str(_write(tmp_path / "a3.json", a3))).ranks == 2
    flat = {"status": "completed", "version": "2.0", "rank_count": "2", "rank_list": [
        {"rank_id": str(r), "local_id": str(r), "device_id": str(r), "level_list": []} for r in range(2)]}
    assert rank_table.load(str(_write(tmp_path / "v2.json", flat))).ranks == 2


def _broken(change):
    table = _table(1, 2)
    change(table)
    return table


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (_broken(lambda t: t.update(status="initializing")), "status='initializing' is not 'completed'"),
        (_broken(lambda t: t.update(server_count="2")), "server_count='2' disagrees with server_list, which has 1"),
        (_broken(lambda t: t["server_list"][0]["device"][1].update(rank_id="0")),
         "server_list[*].device[*].rank_id=[0, 0] are not the ranks 0 .. 1, each once"),
        (_broken(lambda t: t["server_list"][0]["device"][1].update(device_id="0")),
         "server_list[0].device[*].device_id=[0, 0] lists a device more than once"),
        (_broken(lambda t: t["server_list"][0]["device"][0].update(device_ip="192.168.0.300")),
         "server_list[0].device[0].device_ip='192.168.0.300' is not an IP address"),
        (_broken(lambda t: t["server_list"][0]["device"][0].update(rank_id=0)),
         "server_list[0].device[0].rank_id=0 is not a non-negative integer (as a string)"),
        (_broken(lambda t: t.update(version="3.0")), "version='3.0' is not a version this reads (1.0, 1.2, 2.0)"),
        (_broken(lambda t: t["server_list"][0]["device"][0].pop("device_ip")), "server_list[0].device[0] has no"
                                                                              " 'device_ip'"),
    ],
)
def test_a_malformed_rank_table_fails_naming_the_file_the_field_and_the_value(tmp_path, table, message):
    path = _write(tmp_path / "hccl.json", table)
    with pytest.raises(SettingError) as error:
        rank_table.load(str(path))
    assert f"RANK_TABLE_FILE={path}: {message}" in str(error.value)
    assert error.value.problem.fix


def test_a_missing_rank_table_or_one_that_disagrees_with_the_run_fails_before_workers_start(
        tmp_path, capsys, clean_env, simulate):
    """Catches a RANK_TABLE_FILE that is missing, or describes another job (torch_npu fails only at the first
    collective, on every rank, or hangs), getting past the Trainer, Fabric or the launcher."""
    simulate(2)
    missing = tmp_path / "missing.json"
    clean_env.setenv(names.RANK_TABLE_FILE, str(missing))
    with pytest.raises(SettingError, match=f"RANK_TABLE_FILE={missing} does not exist; point it at the hccl.json"):
        Trainer(accelerator="npu", devices=2, logger=False)
    one_card = _write(tmp_path / "one.json", _table(1, 1))
    clean_env.setenv(names.RANK_TABLE_FILE, str(one_card))
    with pytest.raises(SettingError, match=r"rank count is 1, but the job runs 1 node\(s\) x 2 device\(s\)"):
        Fabric(accelerator="npu", devices=2)
    two_servers = _write(tmp_path / "two.json", _table(2, 1))
    clean_env.setenv(names.RANK_TABLE_FILE, str(two_servers))
    with pytest.raises(SettingError, match="server_count is 2, but the job runs 1 node"):
        Trainer(accelerator="npu", devices=2, logger=False)
    assert Trainer(accelerator="cpu", devices=1, logger=False)  # not an NPU run: the table is not its concern

    status = main(["run", "--devices", "2", "--main-port", str(free_port()), str(SCRIPTS / "cluster_train.py")])
    assert status == 2
    assert "server_count is 2, but the job runs 1 node(s) x 2 device(s)" in capsys.readouterr().err


def test_the_doctor_reports_the_rank_table_and_the_pod(tmp_path):
    """Catches a doctor that shows RANK_TABLE_FILE without reading it, passes a table that disagrees with the pod's
    job, or says nothing about how a pod's processes must start."""
    table = _write(tmp_path / "hccl.json", _table(2, 1))
    env = {**_pod_env(0, 2222), names.RANK_TABLE_FILE: str(table)}
    _, findings = rules.check_environment(env)
    by_subject = {finding.subject: finding for finding in findings}
    assert by_subject[names.RANK_TABLE_FILE].level == "note"
    assert "2 server(s) x 1 device(s) (matches this job)" in by_subject[names.RANK_TABLE_FILE].cause
    assert "lightning-npu run train.py" in by_subject["Ascend Operator pod"].fix

    _, findings = rules.check_environment({**env, names.WORLD_SIZE: "4", names.LOCAL_WORLD_SIZE: "2",
                                           names.LOCAL_RANK: "{0,1}"})
    (finding,) = [f for f in findings if f.subject == names.RANK_TABLE_FILE]
    assert finding.level == "error" and "rank count is 2, but the job runs 2 node(s) x 2 device(s)" in finding.cause


# ---- the example job files -------------------------------------------------------------------------------------


def _job_command() -> list[str]:
    job = yaml.safe_load(JOB_YAML.read_text())
    commands = [replica["template"]["spec"]["containers"][0]["command"] for replica in job["spec"]["replicaSpecs"].values()]
    assert all(command == commands[0] for command in commands)
    return commands[0]


def test_the_ascend_job_runs_the_documented_command_with_the_configs_layout():
    """Catches an AscendJob that the operator rejects (apiVersion, kind, the fixed container name), that starts the
    recipe other than as the docs say (not through `lightning-npu run`: `import lightning` fails in the pod), whose
    pods x NPUs differ from the config's num_nodes x devices, or whose port is not the one the pods' MASTER_PORT
    defaults to; and docs that stopped showing the file."""
    job = yaml.safe_load(JOB_YAML.read_text())
    assert (job["apiVersion"], job["kind"], job["spec"]["schedulerName"]) == ("mindxdl.gitee.com/v1", "AscendJob",
                                                                              "volcano")
    replicas = job["spec"]["replicaSpecs"]
    containers = [replica["template"]["spec"]["containers"][0] for replica in replicas.values()]
    assert {container["name"] for container in containers} == {"ascend"}
    command = _job_command()
    assert command[:2] == ["lightning-npu", "run"] and command[2:4] == ["recipes/train.py", "fit"]
    config = yaml.safe_load((REPO / command[command.index("--config") + 1]).read_text())["trainer"]
    npus = {container["resources"]["limits"]["huawei.com/Ascend910"] for container in containers}
    assert npus == {config["devices"]}
    assert sum(replica["replicas"] for replica in replicas.values()) == config["num_nodes"]
    assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == config["num_nodes"]
    assert {container["ports"][0]["containerPort"] for container in containers} == {pod.DEFAULT_PORT}
    # The variables the pod spec relies on are the ones AscendPod reads; the docs show the file and the command.
    docs = (REPO / "docs" / "clusters.md").read_text()
    assert '--8<-- "recipes/cluster/ascend_job.yaml"' in docs
    assert shlex.join(["lightning-npu", "run", "train.py"]) in docs


def test_the_modelarts_boot_file_passes_the_cards_layout_the_environment_checks():
    """Catches a boot file whose Trainer devices / num_nodes are not what ModelArtsEnvironment checks (cards per host,
    hosts), or that the docs stopped showing."""
    text = BOOT.read_text()
    assert '--trainer.devices "$(( RANK_SIZE / ${MA_NUM_HOSTS:-1} ))" --trainer.num_nodes "${MA_NUM_HOSTS:-1}"' in text
    assert '--8<-- "recipes/cluster/modelarts_boot.sh"' in (REPO / "docs" / "clusters.md").read_text()


# ---- two pods and two cards on one machine ----------------------------------------------------------------------


def _start_all(commands: list[list[str]], envs: list[dict[str, str]], simulate: int) -> tuple[list[int], list[str]]:
    base = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARIABLES and k != names.SIMULATE_ENV}
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{base['PATH']}")
    base[names.SIMULATE_ENV] = str(simulate)
    procs = [subprocess.Popen(command, cwd=REPO, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for command, env in zip(commands, envs)]
    return outputs_of(procs)


@pytest.mark.slow
def test_two_pods_and_two_modelarts_cards_with_a_rank_table_form_one_group_of_two_and_train_alike(tmp_path):
    """Two Ascend Operator "pods" (1 simulated NPU each, the operator's variables, started by the AscendJob's own
    command) and two ModelArts "cards" (the boot file run once per card, with a rank table of 2 devices on 1 server).
    Catches pods that train alone (two groups of 1), ranks taken from the pod-level RANK, a launch that fails at
    `import lightning` on LOCAL_RANK='{0}', the Ascend environments not detected, and cards that disagree with the
    pods' run: both launches must give world size 2, ranks 0 and 1, an all-reduce of rank + 1 of 3, and the same
    losses (the same data on the same two ranks)."""
    command = _job_command()[:2]  # lightning-npu run, as the AscendJob starts the recipe
    pods_out, port = tmp_path / "pods", free_port()
    args = [SCRIPT, "fit", "--model.out", str(pods_out), "--trainer.devices", "1", "--trainer.num_nodes", "2"]
    codes, outputs = _start_all([[*command, *args]] * 2, [_pod_env(rank, port) for rank in range(2)], simulate=1)
    shown = "\n".join(output[-3000:] for output in outputs)
    assert codes == [0, 0], shown
    assert "Ascend Operator pod 1 of 2 (MINDX_TASK_ID=test-job-uid)" in outputs[1]
    assert "the pod's RANK=1, LOCAL_RANK={0} replaced by each process's own (torchrun)" in outputs[1]
    pods = [read_json(pods_out / f"rank{rank}.json") for rank in range(2)]

    table = _write(tmp_path / "hccl.json", _table(1, 2))
    cards_out, port = tmp_path / "cards", free_port()
    codes, outputs = _start_all([["bash", str(BOOT), SCRIPT, "fit", "--model.out", str(cards_out)]] * 2,
                                [_card_env(rank, port, table) for rank in range(2)], simulate=2)
    shown = "\n".join(output[-3000:] for output in outputs)
    assert codes == [0, 0], shown
    assert f"RANK_TABLE_FILE={table}: hccl.json version 1.0, 1 server(s) x 2 device(s), matches the run" in outputs[0]
    cards = [read_json(cards_out / f"rank{rank}.json") for rank in range(2)]

    for reports, environment, node_ranks, local_ranks in ((pods, "AscendOperatorEnvironment", [0, 1], [0, 0]),
                                                          (cards, "ModelArtsEnvironment", [0, 0], [0, 1])):
        assert [r["global_rank"] for r in reports] == [0, 1]
        assert [r["node_rank"] for r in reports] == node_ranks
        assert [r["local_rank"] for r in reports] == local_ranks
        assert {r["cluster_environment"] for r in reports} == {environment}
        assert {r["world_size"] for r in reports} == {2}
        assert {r["rank_sum"] for r in reports} == {3.0}
        assert len(reports[0]["losses"]) == 3 and reports[0]["losses"] == reports[1]["losses"]
    assert cards[0]["losses"] == pytest.approx(pods[0]["losses"], abs=1e-6)
