"""The built-in GRPO rollout engine on a model FSDP2 shards over 2 gloo ranks: prints, from rank 0, one JSON object
with its greedy completions, generate.py's on the unsharded model, and the all-gathers each way of decoding took."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_npu.strategies.clean_exit import destroy_at_exit, destroy_process_groups
from recipes.generate import decode, generate
from lightning_npu.compat import fsdp_reshard_flags
from recipes.posttrain.rollout import PolicyRolloutEngine, SamplingOptions
from tests.helpers import free_port
from tests.recipes.test_generate import config, random_model

NEW_TOKENS = 6
PROMPTS = [[5, 9, 17], [3, 44, 12, 8, 30]]


def count_all_gathers(calls: list[int]):
    original = dist.all_gather_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return original, counted


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = random_model(config())
    prompts = [torch.tensor(p) for p in PROMPTS]
    expected = [generate(model, p, NEW_TOKENS, temperature=0.0)[p.numel():].tolist() for p in prompts]
    sharded = copy.deepcopy(model)
    for block in sharded.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    with torch.no_grad():
        sharded(prompts[0][None])  # the root's first forward (a training step's): FSDP2's lazy initialisation
    before = [fsdp_reshard_flags(block) for block in sharded.layers]

    calls: list[int] = []
    original, counted = count_all_gathers(calls)
    dist.all_gather_single = counted
    try:
        with torch.no_grad():
            per_forward = decode(sharded, prompts[0][None].expand(2, -1), NEW_TOKENS, temperature=0.0)
        per_forward_gathers = len(calls)
        calls.clear()
        rollouts = PolicyRolloutEngine().generate(sharded, prompts, SamplingOptions(2, NEW_TOKENS, temperature=0.0),
                                                  eos_id=None)
        rollout_gathers = len(calls)
    finally:
        dist.all_gather_single = original
    if rank == 0:
        print(json.dumps({
            "expected": expected, "completions": rollouts.completion_ids.tolist(),
            "plain_fsdp_completion": per_forward[0, prompts[0].numel():].tolist(),
            "per_forward_gathers": per_forward_gathers, "rollout_gathers": rollout_gathers,
            "sharded_blocks": len(sharded.layers), "flags_before": before,
            "flags_after": [fsdp_reshard_flags(block) for block in sharded.layers],
        }), flush=True)
    dist.barrier()
    destroy_at_exit(mesh)
    destroy_process_groups()


if __name__ == "__main__":
    mp.start_processes(worker, args=(free_port(),), nprocs=2, start_method="fork")
