"""DeepSeek's Multi-head Latent Attention under ``mla_attention_plan`` on two gloo ranks: one MLAttention in a block
of the recipe's arrangement (``x + attention(attention_norm(x), ...)``; with sequence parallelism the norm
``SequenceParallel`` and the attention's input gathered by ``PrepareModuleInput``, as ``decoder_plan`` does) runs one
forward and backward on the input an unsplit copy runs, for each query path (``q_lora_rank`` None and set), rotary
layout (interleaved or not) and ``sequence_parallel``. Two more runs swap wkv_a's style: no gradient sum over the
ranks, and a sum over all its channels (latent included).

Rank 0 prints one JSON object per run: the largest difference from the unsplit block, over both ranks, of the output,
the input's gradient and each parameter's gradient (a split one gathered whole, a plain one as each rank holds it)."""

from __future__ import annotations

import copy
import json
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

from lightning_npu.parallel.tensor import ReplicatedParallel
from lightning_npu.strategies.clean_exit import destroy_at_exit, destroy_process_groups
from recipes.decoder.transformer import RMSNorm
from recipes.models.deepseek.config import DeepSeekConfig
from recipes.models.deepseek.model import MLAttention, yarn_frequencies
from recipes.models.deepseek.tensor_parallel import mla_attention_plan
from tests.helpers import free_port

TP = 2
BATCH, SEQ = 2, 8
#: v_head_dim differs from the query/key head width (nope + rope), so a split by the wrong width shows.
SHAPE = dict(dim=32, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10)


class Block(nn.Module):
    """The attention half of ``DecoderBlock``, calling the attention with the same 7 positional arguments."""

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = MLAttention(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x + self.attention(self.attention_norm(x), cos, sin, None, 0, 0, None)


def block_plan(block: Block, *, sequence_parallel: bool) -> dict:
    plan = mla_attention_plan("attention.", block.attention, sequence_parallel=sequence_parallel)
    if sequence_parallel:  # decoder_plan's arrangement around the attention
        plan["attention_norm"] = SequenceParallel()
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * 6,
                                               desired_input_layouts=(Replicate(),) + (None,) * 6)
    return plan


def rotary(config: DeepSeekConfig) -> tuple[Tensor, Tensor]:
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), yarn_frequencies(config))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * config.rope_attention_factor, angles.sin() * config.rope_attention_factor


def check(mesh, *, q_lora_rank, interleaved: bool, sequence_parallel: bool, wkv_a=None) -> dict:
    rank = dist.get_rank()
    config = DeepSeekConfig.from_preset("tiny", q_lora_rank=q_lora_rank, rope_interleave=interleaved, **SHAPE)
    torch.manual_seed(0)
    reference = Block(config)
    with torch.no_grad():  # weights of unit-scale outputs and gains away from one: gradients far above 1e-5
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))
    split = copy.deepcopy(reference)
    plan = block_plan(split, sequence_parallel=sequence_parallel)
    if wkv_a is not None:
        plan["attention.wkv_a"] = wkv_a
    parallelize_module(split, mesh, plan)

    cos, sin = rotary(config)
    x = torch.randn(BATCH, SEQ, config.dim, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(BATCH, SEQ, config.dim, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref, cos, sin)
    ((out_ref * weight).sum() / (BATCH * SEQ)).backward()  # a mean over tokens, as a language model's loss

    # Under sequence parallelism each rank holds its part of the sequence, in and out; the loss is the sum of the
    # ranks' parts. Otherwise every rank holds the whole sequence and the whole loss.
    mine = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP) if sequence_parallel else slice(None)
    x_split = x[:, mine].clone().requires_grad_()
    out_split = split(x_split, cos, sin)
    ((out_split * weight[:, mine]).sum() / (BATCH * SEQ)).backward()

    differences = {
        "output": (out_split - out_ref[:, mine]).abs().max().item(),
        "input_grad": (x_split.grad - x_ref.grad[:, mine]).abs().max().item(),
    }
    params = dict(split.named_parameters())
    for name, param in reference.named_parameters():
        grad = params[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        differences[name] = (grad - param.grad).abs().max().item()
    everyone = [None] * TP
    dist.all_gather_object(everyone, differences)
    worst = {name: max(d[name] for d in everyone) for name in differences}
    grads = {name: value for name, value in worst.items() if name not in ("output", "input_grad")}
    return {
        "q_lora_rank": q_lora_rank, "interleaved": interleaved, "sequence_parallel": sequence_parallel,
        "wkv_a": None if wkv_a is None else repr(wkv_a),
        "output": worst["output"], "input_grad": worst["input_grad"], "grads": grads,
        "split": sorted(name for name, p in split.named_parameters()
                        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)),
        "plain": sorted(name for name, p in split.named_parameters() if not isinstance(p, DTensor)),
    }


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    runs = [dict(q_lora_rank=q_lora_rank, interleaved=interleaved, sequence_parallel=sequence_parallel)
            for q_lora_rank in (None, 24) for interleaved in (True, False) for sequence_parallel in (True, False)]
    rotary_key = slice(SHAPE["kv_lora_rank"], SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"])
    for sequence_parallel in (True, False):
        for wkv_a in (ReplicatedParallel(), ReplicatedParallel(partial_grad_channels=slice(0, rotary_key.stop))):
            runs.append(dict(q_lora_rank=24, interleaved=True, sequence_parallel=sequence_parallel, wkv_a=wkv_a))
    for run in runs:
        result = check(mesh, **run)
        if rank == 0:
            print(json.dumps(result), flush=True)
    dist.barrier()
    destroy_at_exit(mesh)  # torch's DTensor caches keep the mesh's group alive: released with the others
    destroy_process_groups()


if __name__ == "__main__":
    # Forked: the ranks keep this interpreter's imports (torch, the recipe) instead of importing them again.
    mp.start_processes(worker, args=(free_port(),), nprocs=TP, start_method="fork")
