"""FSDP1's static APIs given a model FSDP2 sharded (as npu_fsdp shards Lightning's FSDPStrategy projects) fail naming
the FSDP2 replacement, instead of silently finding no FSDP1 unit; FSDP1 models are untouched."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType, fully_shard

from lightning_npu.strategies.fsdp1 import FSDP1_APIS, refuse_fsdp1_apis

#: What each API's replacement is named by, in its error.
REPLACEMENTS = {
    "summon_full_params": "get_model_state_dict", "state_dict_type": "set_model_state_dict",
    "set_state_dict_type": "set_model_state_dict", "get_state_dict_type": "get_model_state_dict",
    "full_optim_state_dict": "get_optimizer_state_dict", "sharded_optim_state_dict": "get_optimizer_state_dict",
    "optim_state_dict": "get_optimizer_state_dict", "optim_state_dict_to_load": "set_optimizer_state_dict",
    "shard_full_optim_state_dict": "set_optimizer_state_dict",
    "scatter_full_optim_state_dict": "set_optimizer_state_dict",
    "flatten_sharded_optim_state_dict": "set_optimizer_state_dict",
}


@pytest.fixture
def fsdp2_model():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        refuse_fsdp1_apis()
        yield model
    finally:
        dist.destroy_process_group()


def _arguments(name, model, optimizer):
    """Positional arguments for ``FullyShardedDataParallel.<name>``: the model and optimizer where it takes them."""
    given = {"module": model, "model": model, "optim": optimizer, "state_dict_type": StateDictType.FULL_STATE_DICT}
    parameters = inspect.signature(getattr(FullyShardedDataParallel, name)).parameters.values()
    return [given.get(p.name, {}) for p in parameters if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_every_fsdp1_api_is_covered():
    assert sorted(REPLACEMENTS) == sorted(FSDP1_APIS)


@pytest.mark.parametrize("name", sorted(REPLACEMENTS))
def test_an_fsdp1_api_given_an_fsdp2_model_fails_naming_its_replacement(fsdp2_model, name):
    optimizer = torch.optim.AdamW(fsdp2_model.parameters())
    with pytest.raises(TypeError, match=rf"FullyShardedDataParallel.{name}\(\) is an FSDP1 API, and FSDPSequential is"
                                        rf" sharded with FSDP2 .*silently do nothing. Use .*{REPLACEMENTS[name]}"):
        result = getattr(FullyShardedDataParallel, name)(*_arguments(name, fsdp2_model, optimizer))
        if hasattr(result, "__enter__"):  # the context managers check when entered
            with result:
                pass


def test_an_unsharded_model_is_left_to_fsdp1(fsdp2_model):
    plain = nn.Linear(2, 2)
    with FullyShardedDataParallel.summon_full_params(plain):  # no FSDP unit at all: FSDP1's own no-op, as before
        pass
