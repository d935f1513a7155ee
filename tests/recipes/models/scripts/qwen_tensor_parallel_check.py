"""The recipe's tensor-parallel plan on Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, head_dim != dim / heads):
two gloo ranks split a tiny model with ``decoder_plan`` (sequence parallelism on) and run one forward and backward
on the batch an unsplit copy runs. Rank 0 prints one JSON object per architecture: the largest difference of the
logits and of every parameter's gradient (whole, gathered from its shards) from the unsplit model's."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_npu.strategies.clean_exit import destroy_at_exit, destroy_process_groups
from recipes.decoder.tensor_parallel import decoder_plan
from recipes.models.qwen.config import QwenConfig
from recipes.models.qwen.model import Qwen
from tests.helpers import free_port

SHAPE = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, ffn_hidden_dim=48,
             max_seq_len=32, tie_embeddings=False)


def check(architecture: str, mesh) -> dict:
    torch.manual_seed(0)
    reference = Qwen(QwenConfig(architecture=architecture, **SHAPE))
    with torch.no_grad():  # biases and norm gains away from their zero / one init, so they move the logits
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    split = Qwen(reference.config)
    split.load_state_dict(reference.state_dict())
    parallelize_module(split, mesh, decoder_plan(split, sequence_parallel=True, loss_parallel=False))
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    out = {"arch": architecture}
    for model in (reference, split):
        logits = model(tokens)
        logits.square().mean().backward()
        out.setdefault("logits", []).append(logits.detach())
    out["logits"] = (out["logits"][0] - out["logits"][1]).abs().max().item()
    grads = dict(split.named_parameters())
    differences = {}
    for name, param in reference.named_parameters():
        grad = grads[name].grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        differences[name] = (grad - param.grad).abs().max().item()
    out["grad"] = max(differences.values())
    out["worst"] = max(differences, key=differences.get)
    out["split"] = sorted(name for name, p in split.named_parameters() if isinstance(p, DTensor) and
                          any(pl.is_shard() for pl in p.placements))
    return out


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for architecture in ("qwen2", "qwen3"):
        result = check(architecture, mesh)
        if rank == 0:
            print(json.dumps(result), flush=True)
    dist.barrier()
    destroy_at_exit(mesh)  # torch's DTensor caches keep the mesh's group alive: released with the others
    destroy_process_groups()


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(),), nprocs=2)
