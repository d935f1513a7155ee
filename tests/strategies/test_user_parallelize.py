"""npu_fsdp's ``parallelize_fn``: the user's function shards instead of npu_fsdp (Lightning's ModelParallelStrategy
contract); the options it replaces are refused beside it, and the first weights still reach the modules it moved."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from lightning_npu import NPUFabricFSDPStrategy, NPUFSDPStrategy
from lightning_npu.strategies.initial_state import InitialState
from lightning_npu.strategies.user_parallelize import CHOSEN_BY_NPU_FSDP, parallelize_with


def shard_it_myself(module, device_mesh):
    return module


@pytest.mark.parametrize("strategy_class", [NPUFSDPStrategy, NPUFabricFSDPStrategy])
@pytest.mark.parametrize(("option", "value"), [
    ("auto_wrap_policy", [nn.Linear]), ("zero_stage", 2), ("sharding", "hybrid"),
    ("activation_checkpointing_policy", [nn.Linear]), ("cpu_offload", True), ("context_parallel_size", 2),
    ("expert_parallel_size", 2), ("pipeline_parallel_size", 2),
])
def test_the_sharding_options_it_replaces_are_refused_beside_it(strategy_class, option, value):
    assert option in CHOSEN_BY_NPU_FSDP
    kwargs = {option: value, "pipeline_microbatches": 2} if option == "pipeline_parallel_size" else {option: value}
    with pytest.raises(ValueError, match=rf"parallelize_fn=shard_it_myself shards the model itself.*{option}="
                                         r".*would be ignored.*leave those options out, or drop parallelize_fn"):
        strategy_class(parallelize_fn=shard_it_myself, **kwargs)


def test_it_is_kept_with_the_options_it_leaves_alone():
    strategy = NPUFabricFSDPStrategy(parallelize_fn=shard_it_myself, tensor_parallel_size=2, state_dict_type="full")
    assert strategy.options.parallelize_fn is shard_it_myself


def test_what_is_not_a_function_is_refused():
    with pytest.raises(ValueError, match=r"parallelize_fn='pkg.fn' is not a function: give parallelize_fn\(module,"):
        NPUFSDPStrategy(parallelize_fn="pkg.fn")


def test_a_function_returning_another_module_is_refused():
    with pytest.raises(TypeError, match=r"returned Linear, not the module it was given: under npu_fsdp it must shard"
                                        " the module in place"):
        parallelize_with(lambda module, mesh: nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), None,
                         InitialState(frozenset()))


def test_modules_it_moves_under_wrappers_keep_their_meta_tensors_and_buffers_by_their_new_names():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    state = InitialState(frozenset({"0.weight", "0.bias"}), values={"1.weight": torch.ones(2)},
                         buffers={"1.running_mean": torch.zeros(2)})

    def wrap_children(module, mesh):
        module[0] = checkpoint_wrapper(module[0])
        module[1] = checkpoint_wrapper(module[1])
        return module

    parallelize_with(wrap_children, model, None, state)
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    assert state.meta_names == {"0._checkpoint_wrapped_module.weight", "0._checkpoint_wrapped_module.bias"} <= names
    assert set(state.buffers) == {"1._checkpoint_wrapped_module.running_mean"}
    # Values go through torch's set_model_state_dict, which names parameters without the wrappers.
    assert set(state.values) == {"1.weight"}
