"""Lightning's own sharded strategies, built as projects build them, train end to end on 2 simulated NPUs under the
Trainer and Fabric (one torchrun launch, tests/strategies/scripts/lightning_strategies_run.py): each runs as npu_fsdp and
trains as npu_ddp does from the same seed and data; the Trainer's checkpoints test as npu_ddp's."""

import pytest

from tests.helpers import read_json, room_scripts, run_python

SCRIPTS = room_scripts("strategies")

SHARDED = {
    "trainer": ("fsdp_strategy", "fsdp_string", "model_parallel"),
    "fabric": ("fsdp_strategy", "fsdp_string", "model_parallel"),
}


@pytest.mark.slow
def test_lightnings_fsdp_and_model_parallel_strategies_train_as_npu_ddp(tmp_path):
    """Breakage caught: FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy=...),
    strategy="fsdp" or ModelParallelStrategy() (Fabric's with a parallelize_fn) refused on accelerator='npu', not
    running as npu_fsdp, or changing the training (weights, gradient averaging, data split, steps), or the
    Trainer's checkpoint (full file, or sharded directory) not testing as npu_ddp's."""
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "lightning_strategies_run.py"), str(tmp_path)], timeout=400)
    for rank in range(2):
        result = read_json(tmp_path / f"rank{rank}.json")
        for api, runs in SHARDED.items():
            reference = result[f"{api}_npu_ddp"]
            assert len(reference["losses"]) == 4, reference
            for name in runs:
                run = result[f"{api}_{name}"]
                assert run["strategy"] == ("NPUFSDPStrategy" if api == "trainer" else "NPUFabricFSDPStrategy"), name
                assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), (api, name, run, reference)
                if api == "trainer":
                    assert run["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5), (name, run)
