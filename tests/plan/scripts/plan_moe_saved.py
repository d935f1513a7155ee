"""What autograd keeps from one forward of the MoE and DeepSeek recipes' blocks under context parallelism, per token of
the rank's own, next to what the planner's profiles count (``saved_by_block``).

One process poses as rank 0 of 2 over torch's fake process group (as tests/plan/scripts/plan_parallel_saved.py does for
LLaMA): the block's attention gets a ``ContextParallel`` of the pair, its input and rotary tables are this rank's part
of each sequence. Only what the graph still holds when the forward returns counts (``tests.plan.test_plan``'s rule). Prints
a JSON list of ``{"case", "measured", "predicted"}`` (bytes per token, from two batch sizes so constants cancel).
"""

from __future__ import annotations

import json
import weakref

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_npu.parallel.context import ContextParallel
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.plan import Parallelism

SEQ, BATCHES, WORLD = 32, (2, 4), 2
#: (family, model config overrides, layer, precision, context_parallel_algo)
CASES = [
    (family, overrides, layer, precision, algo)
    for family, overrides, layers in (("deepseek", {}, (0, 1)), ("deepseek", {"q_lora_rank": None}, (1,)),
                                      ("moe", {}, (1,)))
    for layer in layers for precision in ("32-true", "bf16-mixed") for algo in ("ulysses", "ring")
]


def _family(name: str):
    if name == "deepseek":
        from recipes.models.deepseek.config import DeepSeekConfig as Config
        from recipes.models.deepseek.memory_profile import lightning_npu_memory_profile as profile
        from recipes.models.deepseek.model import DeepSeek as Model
    else:
        from recipes.models.moe.config import MoEConfig as Config
        from recipes.models.moe.memory_profile import lightning_npu_memory_profile as profile
        from recipes.models.moe.model import MoE as Model
    return Config, Model, profile


def saved_per_token(family: str, overrides: dict, layer: int, precision: str, algo: str, mesh) -> float:
    Config, Model, _ = _family(family)
    torch.manual_seed(0)
    model = Model(Config.from_preset("tiny", **overrides))
    block, dtype = model.layers[layer], torch.float32
    if precision == "bf16-mixed":
        block, dtype = block.to(torch.bfloat16), torch.bfloat16
    cp = ContextParallel(mesh.get_group(), algo)
    block.attention.context_parallel = cp
    cos, sin = (table[cp.positions(SEQ)].to(dtype) for table in model.rotary_cos_sin())
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    own = SEQ // WORLD
    totals = []
    for batch in BATCHES:
        x = torch.randn(batch, own, model.config.dim, dtype=dtype, requires_grad=True)
        saved: list[weakref.ref] = []

        def pack(tensor, saved=saved):
            saved.append(weakref.ref(tensor))
            return tensor

        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            out = block(x, cos, sin)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (ref() for ref in saved) if t is not None}
        totals.append(sum(n for ptr, n in storages.items() if ptr not in params))
        del out
    measured = (totals[1] - totals[0]) / ((BATCHES[1] - BATCHES[0]) * own)
    if layer in model.config.moe_layers:
        measured += 4 * model.config.n_experts  # router_logits, kept by the layer
    return measured


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = []
    for family, overrides, layer, precision, algo in CASES:
        profile = _family(family)[2]({"family": family, "preset": "tiny", "config": overrides})
        split = profile.with_parallelism(
            Parallelism(FSDPOptions(context_parallel_size=WORLD, context_parallel_algo=algo)))
        act_bytes = 4 if precision == "32-true" else 2
        predicted = sum(split.block_profile(layer).saved_by_block("reference", act_bytes, SEQ).all.values())
        rows.append({"case": f"{family}{'_no_q_lora' if overrides else ''}_layer{layer}_{precision}_{algo}",
                     "measured": saved_per_token(family, overrides, layer, precision, algo, mesh),
                     "predicted": predicted})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
