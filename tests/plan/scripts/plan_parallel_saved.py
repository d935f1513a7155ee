"""What autograd keeps from one forward of the recipe's LLaMA block under tensor and context parallelism, per token of
the rank's own, next to what the planner's profile counts (``DecoderProfile.saved_by_block``).

One process poses as rank 0 of 2 over torch's fake process group (the collectives move no data and allocate nothing
of their own, as in benchmarks/plan_accuracy.py), so the block runs as one rank of a TP or CP pair would: under
tensor parallelism the recipe's plan (``decoder_plan``) applied with ``parallelize_module`` on a 2-rank mesh, its
input this rank's sequence shard with sequence parallelism; under context parallelism ``Attention.context_parallel``
set to a ``ContextParallel`` of the pair, the input and rotary tables this rank's part of each sequence. Prints a JSON
list of ``{"case", "measured", "predicted"}`` (bytes per token, from two batch sizes so constants cancel).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_npu.kernels import rotary_tables
from lightning_npu.parallel.context import ContextParallel
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.plan import Parallelism
from recipes.decoder.tensor_parallel import decoder_plan
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.memory_profile import lightning_npu_memory_profile
from recipes.models.llama.model import LLaMA

SEQ, BATCHES, WORLD = 32, (2, 4), 2
CASES = {
    "tp2": Parallelism(FSDPOptions(tensor_parallel_size=2)),
    "tp2_no_sp": Parallelism(FSDPOptions(tensor_parallel_size=2, sequence_parallel=False)),
    "cp2_ulysses": Parallelism(FSDPOptions(context_parallel_size=2, context_parallel_algo="ulysses")),
    "cp2_ring": Parallelism(FSDPOptions(context_parallel_size=2, context_parallel_algo="ring")),
}


def saved_per_token(parallel: Parallelism) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig.from_preset("tiny", n_layers=1))
    block = model.layers[0]
    mesh = init_device_mesh("cpu", (WORLD,))
    if parallel.tensor > 1:
        plan = decoder_plan(model, sequence_parallel=parallel.sequence_parallel, loss_parallel=True)
        parallelize_module(model, mesh, {k: v for k, v in plan.items() if k.startswith("layers.")})
    positions = torch.arange(SEQ)
    tokens = SEQ  # of each sequence this rank's block sees as its input
    if parallel.context > 1:
        cp = ContextParallel(mesh.get_group(), parallel.context_algo)
        block.attention.context_parallel = cp
        positions = cp.positions(SEQ)
        tokens = SEQ // parallel.context
    elif parallel.sequence_parallel and parallel.tensor > 1:
        tokens = SEQ // parallel.tensor  # the residual stream's sequence shard
    cos, sin = (table[positions] for table in rotary_tables(SEQ, block.attention.head_dim))
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in block.parameters()}
    totals = []
    for batch in BATCHES:
        x = torch.randn(batch, tokens, model.config.dim, requires_grad=True)
        storages: dict[int, int] = {}

        def pack(tensor, storages=storages):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, cos, sin)
        totals.append(sum(n for ptr, n in storages.items() if ptr not in params))
    # Per token of the rank's own part of each sequence (all of it under TP, seq / cp under CP).
    own = SEQ // parallel.context
    return (totals[1] - totals[0]) / ((BATCHES[1] - BATCHES[0]) * own)


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    profile = lightning_npu_memory_profile({"preset": "tiny"})
    rows = []
    for name, parallel in CASES.items():
        split = profile.with_parallelism(parallel)
        predicted = sum(split.saved_by_block("reference", 4, SEQ).all.values())
        rows.append({"case": name, "measured": saved_per_token(parallel), "predicted": predicted})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
