"""Lightning's own FSDPStrategy / "fsdp" / ModelParallelStrategy on accelerator='npu': each option becomes npu_fsdp's
where the mapping is exact, and fails naming the option and the nearest setting where it is not."""

import logging
from datetime import timedelta

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from lightning_npu import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.strategies.from_lightning import TRANSLATIONS, porting_table

TRAINER_KW = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


class Block(nn.Linear):
    pass


class Attention(nn.Linear):
    pass


def options_of(strategy, devices=2, num_nodes=1):
    trainer = Trainer(accelerator="npu", devices=devices, num_nodes=num_nodes, strategy=strategy, **TRAINER_KW)
    assert type(trainer.strategy) is NPUFSDPStrategy
    return trainer.strategy.options


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (FSDPStrategy(auto_wrap_policy={Block, Attention}), {"auto_wrap_policy": [Attention, Block]}),
        (FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({Block})), {"auto_wrap_policy": [Block]}),
        (FSDPStrategy(), {"auto_wrap_policy": None, "state_dict_type": "full", "zero_stage": 3, "sharding": "full"}),
        (FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), {"zero_stage": 2, "sharding": "full"}),
        (FSDPStrategy(sharding_strategy="shard_grad_op"), {"zero_stage": 2}),
        (FSDPStrategy(sharding_strategy=ShardingStrategy.FULL_SHARD), {"zero_stage": 3, "sharding": "full"}),
        (FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block}), {"sharding": "hybrid", "zero_stage": 3}),
        (FSDPStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2", auto_wrap_policy={Block}),
         {"sharding": "hybrid", "zero_stage": 2}),
        (FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2)), {"sharding": "hybrid"}),
        (FSDPStrategy(state_dict_type="sharded"), {"state_dict_type": "sharded"}),
        (FSDPStrategy(activation_checkpointing_policy={Block}), {"activation_checkpointing_policy": [Block]}),
        (FSDPStrategy(activation_checkpointing=[Block, Attention]),
         {"activation_checkpointing_policy": [Attention, Block]}),
        (FSDPStrategy(cpu_offload=True), {"cpu_offload": True}),
        (FSDPStrategy(cpu_offload=CPUOffload(offload_params=True)), {"cpu_offload": True}),
        (FSDPStrategy(cpu_offload=False), {"cpu_offload": False}),
        (FSDPStrategy(limit_all_gathers=True, use_orig_params=True, sync_module_states=True), {}),
        (FSDPStrategy(timeout=timedelta(seconds=90)), {"timeout": timedelta(seconds=90)}),
        (FSDPStrategy(), {"timeout": None}),
        (FSDPStrategy(process_group_backend="gloo"), {"process_group_backend": "gloo"}),
        ("fsdp", {"state_dict_type": "full", "cpu_offload": False, "zero_stage": 3}),
        ("fsdp_cpu_offload", {"cpu_offload": True}),
        (ModelParallelStrategy(), {"tensor_parallel_size": 1, "state_dict_type": "sharded"}),
        (ModelParallelStrategy(tensor_parallel_size=2), {"tensor_parallel_size": 2}),
        (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), {"tensor_parallel_size": 1}),
        (ModelParallelStrategy(data_parallel_size=1), {"tensor_parallel_size": 2}),
        (ModelParallelStrategy(save_distributed_checkpoint=False), {"state_dict_type": "full"}),
        (ModelParallelStrategy(timeout=timedelta(seconds=60)), {"timeout": timedelta(seconds=60)}),
    ],
    ids=lambda value: None,
)
def test_each_exact_option_becomes_the_npu_fsdp_option(simulate, given, expected):
    simulate(2)
    options = options_of(given)
    assert {name: getattr(options, name) for name in expected} == expected


def test_hybrid_sharding_on_two_nodes_takes_the_node_mesh(simulate):
    simulate(2)
    options = options_of(FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)), num_nodes=2)
    assert options.sharding == "hybrid"
    assert options.layout(2, 2).sizes["dp_replicate"] == 2


@pytest.mark.parametrize(
    ("given", "option", "reason", "nearest"),
    [
        (FSDPStrategy(sharding_strategy="NO_SHARD"), "sharding_strategy='NO_SHARD'", "which is DDP",
         "strategy='npu_ddp'"),
        (FSDPStrategy(auto_wrap_policy=size_based_auto_wrap_policy), "auto_wrap_policy=", "no wrap-policy functions",
         r"auto_wrap_policy=\{Block\}"),
        (FSDPStrategy(activation_checkpointing_policy=lambda module, recurse, nonwrapped_numel: True),
         "activation_checkpointing_policy=", "no wrap-policy functions", r"activation_checkpointing_policy=\{Block\}"),
        (FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), "mixed_precision=",
         "takes its dtypes from the run's precision", "precision='bf16-mixed'"),
        (FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float16)), "mixed_precision=",
         "takes its dtypes from the run's precision", "precision='16-mixed'"),
        (FSDPStrategy(limit_all_gathers=False), "limit_all_gathers=False", "always bounds",
         "leave limit_all_gathers out"),
        (FSDPStrategy(use_orig_params=False), "use_orig_params=False", "no flat parameters",
         "leave use_orig_params out"),
        (FSDPStrategy(sync_module_states=False), "sync_module_states=False", "rank 0's weights",
         "leave sync_module_states out"),
        (FSDPStrategy(forward_prefetch=True), "forward_prefetch=True", "no counterpart", "remove it"),
        (FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1)), r"device_mesh=\(2, 1\)",
         r"builds its own mesh.*\(1, 2\)", r"sharding_strategy='HYBRID_SHARD' with device_mesh=\(1, 2\)"),
        (ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), "data_parallel_size=1",
         "does not cover the 2 devices", "data_parallel_size='auto'"),
    ],
    ids=lambda value: None,
)
def test_an_option_without_an_exact_counterpart_fails_naming_it_and_the_nearest(simulate, given, option, reason,
                                                                                nearest):
    simulate(2)
    with pytest.raises(ValueError, match=f"{option}.*no exact counterpart.*{reason}.*Nearest setting: {nearest}"):
        Trainer(accelerator="npu", devices=2, strategy=given, **TRAINER_KW)


def test_process_group_is_refused_with_the_nearest_setting(simulate):
    simulate(2)
    strategy = FSDPStrategy()
    strategy.kwargs["process_group"] = object()  # a real group needs init_process_group; the check reads only this
    with pytest.raises(ValueError, match="process_group=.*builds its process groups.*Nearest setting: .*HYBRID_SHARD"):
        Trainer(accelerator="npu", devices=2, strategy=strategy, **TRAINER_KW)


def test_fabric_fsdp_strategy_becomes_npu_fsdp_with_fabrics_defaults(simulate):
    simulate(2)
    fabric = Fabric(accelerator="npu", devices=2, strategy=FabricFSDPStrategy(auto_wrap_policy={Block}))
    assert type(fabric.strategy) is NPUFabricFSDPStrategy
    assert fabric.strategy.options.auto_wrap_policy == [Block]
    assert fabric.strategy.options.state_dict_type == "sharded"  # Fabric's FSDPStrategy default, kept
    assert type(Fabric(accelerator="npu", devices=2, strategy="fsdp").strategy) is NPUFabricFSDPStrategy


def _shard_it_myself(model, device_mesh):
    return model


def test_fabric_model_parallel_strategy_becomes_npu_fsdp_running_its_parallelize_fn(simulate, caplog):
    simulate(2)
    with caplog.at_level(logging.INFO):
        fabric = Fabric(accelerator="npu", devices=2, strategy=FabricModelParallelStrategy(
            _shard_it_myself, data_parallel_size=2, tensor_parallel_size=1))
    assert type(fabric.strategy) is NPUFabricFSDPStrategy
    assert fabric.strategy.options.parallelize_fn is _shard_it_myself
    assert fabric.strategy.options.tensor_parallel_size == 1
    assert "parallelize_fn=_shard_it_myself -> parallelize_fn=_shard_it_myself (called with the module" in caplog.text, caplog.text


def test_the_log_says_what_each_option_became(simulate, caplog):
    simulate(2)
    with caplog.at_level(logging.INFO):
        options_of(FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="SHARD_GRAD_OP"))
        options_of(ModelParallelStrategy())
    text = caplog.text
    assert ("strategy=FSDPStrategy(...) on accelerator='npu' runs as strategy='npu_fsdp'" in text
            and "auto_wrap_policy=ModuleWrapPolicy({Block}) -> auto_wrap_policy=[Block]" in text
            and "sharding_strategy='SHARD_GRAD_OP' -> sharding='full', zero_stage=2" in text
            and "state_dict_type='full' -> state_dict_type='full'" in text), text
    assert "tensor_parallel_size='auto' -> tensor_parallel_size=1 (Lightning's own 'auto' would be 2" in text, text


def test_other_lightning_strategies_and_subclasses_are_still_refused(simulate):
    simulate(2)

    class MyFSDP(FSDPStrategy):
        pass

    with pytest.raises(ValueError, match="'MyFSDP' cannot run on accelerator='npu'"):
        Trainer(accelerator="npu", devices=2, strategy=MyFSDP(), **TRAINER_KW)


def test_lightnings_strategies_are_untouched_off_the_npu():
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), **TRAINER_KW)
    assert type(trainer.strategy) is ModelParallelStrategy


def test_the_porting_table_has_a_row_per_translation():
    table = porting_table()
    assert [line.split("|")[1].strip(" `") for line in table.splitlines()[2:]] == [t.option for t in TRANSLATIONS]
