"""npu_fsdp's policies: which modules are sharded or recomputed, on which mesh, with which settings."""

import json

import pytest
import torch
from torch import nn

from lightning_npu import NPUFSDPStrategy
from lightning_npu.facts.options import FSDPOptions, evenly_spaced
from lightning_npu.parallel.checkpointing import apply_activation_checkpointing
from lightning_npu.parallel.fsdp import repeated_block_class, resolve_module_classes
from tests.helpers import room_scripts, run_python
from tests.strategies.scripts.trainer_run import Block, Net

SCRIPTS = room_scripts("parallel")


@pytest.mark.parametrize(
    ("count", "ratio", "expected"),
    [(4, 1.0, [0, 1, 2, 3]), (4, 0.5, [1, 3]), (4, 0.0, []), (32, 0.25, [3, 7, 11, 15, 19, 23, 27, 31]), (3, 0.34, [2])],
)
def test_activation_checkpointing_ratio_is_evenly_spaced(count, ratio, expected):
    assert evenly_spaced(count, ratio) == expected


def test_activation_checkpointing_keeps_parameter_names():
    net = Net()
    names = [name for name, _ in net.named_parameters()]
    chosen = apply_activation_checkpointing([net], (Block,), 0.5)
    assert chosen == ["blocks.1", "blocks.3"]
    assert [name for name, _ in net.named_parameters()] == names  # checkpoints stay loadable


class Counted(nn.Module):
    """Counts its forward calls: once in forward, once more per recomputation in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x))


class CountedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Counted(), Counted()

    def forward(self, x):
        return x + self.second(self.first(x))


@pytest.fixture
def checkpoint_on_the_cpu(monkeypatch):
    """torch.utils.checkpoint picks its default device once per process from torch.accelerator; after the strict
    fake renamed PrivateUse1 to "npu" in this process (for good) that is "npu", which has no torch.npu here."""
    from torch.utils.checkpoint import DefaultDeviceType

    monkeypatch.setattr(DefaultDeviceType, "_default_device_type", "cpu")


def _forward_calls_in_one_step(blocks: nn.Sequential) -> list[tuple[int, int]]:
    blocks(torch.randn(2, 4)).sum().backward()
    # A CheckpointWrapper forwards attribute lookups to the module inside.
    return [(block.first.calls, block.second.calls) for block in blocks]


def test_modules_checkpointed_by_hand_are_recomputed_once_not_twice(checkpoint_on_the_cpu):
    """Catches a policy checkpointing again what the user checkpointed: a block around a layer given the composable
    checkpoint() or wrapped by torch's apply_activation_checkpointing had that layer recomputed twice in backward
    (3 forward calls), and a block inside torch's checkpoint_wrapper was checkpointed a second time."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as torch_apply_activation_checkpointing,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = nn.Sequential(checkpoint_wrapper(CountedBlock()), CountedBlock(), CountedBlock(), CountedBlock())
    checkpoint(blocks[1].first)
    torch_apply_activation_checkpointing(blocks[2], check_fn=lambda module: module is blocks[2].first)
    with pytest.warns(UserWarning, match=r"already contains checkpointed layers \(0, 1.first, 2.first; .*the 3"
                                          r" modules of the policy inside or around them are not checkpointed again"):
        chosen = apply_activation_checkpointing([blocks], (CountedBlock,), 1.0)
    assert chosen == ["3"]
    # Each checkpointed layer runs twice (forward, one recomputation); a layer nobody checkpointed runs once.
    assert _forward_calls_in_one_step(blocks) == [(2, 2), (2, 1), (2, 1), (2, 2)]


def test_a_module_given_checkpoint_by_hand_is_not_given_it_again(checkpoint_on_the_cpu):
    """Catches torch's "can only be applied to a module once" AssertionError when the policy names a module the
    user already gave the composable checkpoint()."""
    from torch.distributed._composable import checkpoint

    blocks = nn.Sequential(CountedBlock(), CountedBlock())
    checkpoint(blocks[0])
    with pytest.warns(UserWarning, match="already contains checkpointed layers"):
        assert apply_activation_checkpointing([blocks], (CountedBlock,), 1.0) == ["1"]
    assert _forward_calls_in_one_step(blocks) == [(2, 2)] * 2


def test_module_classes_by_class_path_and_name():
    net = Net()
    assert resolve_module_classes([Block], net, "p") == (Block,)
    assert resolve_module_classes(["Block"], net, "p") == (Block,)
    assert resolve_module_classes(["tests.strategies.scripts.trainer_run.Block"], net, "p") == (Block,)
    with pytest.raises(ValueError, match="auto_wrap_policy: no module class named 'Blok' in the model; .*Block"):
        resolve_module_classes(["Blok"], net, "auto_wrap_policy")
    with pytest.raises(ValueError, match="cannot import 'nowhere.Block'"):
        resolve_module_classes(["nowhere.Block"], net, "auto_wrap_policy")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 1}, "zero_stage=1 is not supported; use 3"),
        ({"sharding": "ddp"}, "sharding='ddp' is not supported"),
        ({"activation_checkpointing_ratio": 1.5}, r"activation_checkpointing_ratio=1.5 must lie in \[0, 1\]"),
        ({"memory_fraction": 0.0}, r"memory_fraction=0.0 must lie in \(0, 1\]"),
        ({"state_dict_type": "consolidated"}, "state_dict_type='consolidated' is not supported"),
        ({"timeout": -5}, "timeout=-5 must be a positive number of seconds"),
    ],
)
def test_bad_fsdp_options_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NPUFSDPStrategy(**kwargs)


def test_the_repeated_block_is_the_outermost_repeated_class_holding_most_parameters():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    assert repeated_block_class(Net()) is Block  # not the Linear inside it, although Linear has more instances
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))
    assert repeated_block_class(gpt2) is GPT2Block
    assert repeated_block_class(nn.Sequential(nn.Linear(2, 2))) is None
    # Containers (ModuleList / ModuleDict have no forward) are never candidates.
    assert repeated_block_class(nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))) is nn.Linear


@pytest.mark.slow
def test_sharding_layouts_for_eight_ranks_on_two_nodes():
    out = run_python([str(SCRIPTS / "parallelize_check.py")], simulate=None)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    full = result["full_zero3"]
    assert full["mesh"] == [8] and full["placements"] == ["S(0)"] and full["local_rows"] == 4
    assert full["reshard_after_forward"] is True
    assert full["sharded"] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    hybrid = result["hybrid_zero2"]
    # Replicated across the 2 nodes, sharded over the 4 devices of a node: 32 rows / 4 = 8 per rank.
    assert hybrid["mesh"] == [2, 4] and hybrid["placements"] == ["R", "S(0)"] and hybrid["local_rows"] == 8
    assert hybrid["reshard_after_forward"] is False
    # Hybrid sharding with tensor_parallel_size=2: rank 5 of (2 nodes, dp_shard 2, tp 2; no cp dimension at size 1)
    # holds a quarter of the split columns (32 rows / tp 2 / dp_shard 2), replicated across nodes, and reads
    # data-parallel batch 5 // 2.
    hybrid_tp = result["hybrid_tp"]
    assert hybrid_tp["mesh"] == [2, 2, 2] and hybrid_tp["dims"] == ["dp_replicate", "dp_shard", "tp"]
    assert hybrid_tp["placements"] == ["R", "_S(0, 2)", "S(0)"] and hybrid_tp["local_rows"] == 8
    assert hybrid_tp["sharded"] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert hybrid_tp["sampler_rank"] == 2
    assert result["offload"]["offload"] == "CPUOffloadPolicy"
    assert result["user_sharded"] == {"block1_reshard": False, "block0_reshard": True}
    assert result["mixed_precision"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32",
                                         "master_dtype": "torch.float32"}
    assert result["auto"] == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert result["one_unit"] == [""]
    assert result["tied"] == {"sharded": ["", "blocks.0", "blocks.1", "blocks.3"], "same_parameter": True}


def test_options_are_shared_by_trainer_and_fabric_strategies():
    from lightning_npu import NPUFabricFSDPStrategy

    kwargs = {"auto_wrap_policy": [Block], "zero_stage": 2, "activation_checkpointing_ratio": 0.5}
    assert NPUFSDPStrategy(**kwargs).options == NPUFabricFSDPStrategy(**kwargs).options == FSDPOptions(**kwargs)


def test_buffers_outside_every_pipeline_stage_move_to_the_device_and_stay_registered():
    """Under pipeline parallelism FSDP moves only what its stage units hold: a buffer on the LightningModule itself
    (or on a parameter-free module beside the pipelined one) would stay on the host while the stages compute on the
    NPU. parallelize moves them (the meta device stands for the NPU here; the simulated NPU is the CPU)."""
    from lightning_npu.parallel.parallelize import move_buffers

    owner = nn.Module()
    owner.register_buffer("scale", torch.ones(3))
    owner.register_buffer("cache", torch.zeros(2), persistent=False)
    owner.inner = nn.BatchNorm1d(4)
    move_buffers(owner, torch.device("meta"))
    assert all(buffer.is_meta for buffer in owner.buffers())
    assert dict(owner.named_buffers()).keys() == {"scale", "cache", "inner.running_mean", "inner.running_var",
                                                   "inner.num_batches_tracked"}
    assert "cache" not in owner.state_dict() and "scale" in owner.state_dict()
