"""A skewed router under expert parallelism on 2 simulated NPUs (Fabric): every token goes to the experts of rank 0,
so rank 1 receives no rows, yet runs its experts and every collective.

Cases: ``one_per_rank``: 2 experts, top-1, every token to expert 0 (one expert per rank, E / ep = 1);
``two_per_rank``: 4 experts, top-2, every token to experts 0 and 1. Each trains 3 steps with expert_parallel_size
1 and 2, its gradients clipped to a norm of ``CLIP``. Rank 0 writes ``<out>/result.json``: per case and size the
losses, the gradient norms before clipping and, after the first backward, the whole gradient of ``w_gate_up`` (so
its idle experts' rows can be checked to be zero).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric, seed_everything
from torch import nn
from torch.nn import functional as F

import lightning_npu
from lightning_npu.kernels import permute_tokens, unpermute_tokens
from lightning_npu.parallel import ParallelPlan
from recipes.decoder.moe import Experts

DIM, HIDDEN, VOCAB, TOKENS = 16, 8, 32, 12
CLIP = 0.05
CASES = {"one_per_rank": (2, [0]), "two_per_rank": (4, [0, 1])}


class Skewed(nn.Module):
    """Embedding, the recipe's experts behind a router fixed to ``chosen`` (every token, weights 1 / top_k), head."""

    def __init__(self, n_experts: int, chosen: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.experts = Experts(n_experts, DIM, HIDDEN)
        self.head = nn.Linear(DIM, VOCAB)
        self.n_experts, self.chosen = n_experts, chosen

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(experts=("experts",))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        expert_ids = torch.tensor(self.chosen, device=x.device).expand(x.shape[0], -1).contiguous()
        probs = torch.full(expert_ids.shape, 1 / len(self.chosen), device=x.device)
        permuted, counts, permutation = permute_tokens(x, expert_ids, probs, self.n_experts)
        return self.head(x + unpermute_tokens(self.experts(permuted, counts), permutation))


def train(case: str, ep: int) -> dict:
    n_experts, chosen = CASES[case]
    seed_everything(0)
    fabric = Fabric(accelerator="npu", devices=2, precision="32-true",
                    strategy=lightning_npu.NPUFabricFSDPStrategy(expert_parallel_size=ep, timeout=120))
    fabric.launch()
    model = fabric.setup(Skewed(n_experts, chosen))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses, norms, first_grad = [], [], None
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
        loss = F.cross_entropy(model(ids), torch.roll(ids, 1))
        fabric.backward(loss)
        if first_grad is None:
            first_grad = model.experts.w_gate_up.grad.full_tensor().tolist()
        # Small enough to clip every step: the experts' gradients lie on another mesh than the rest under ep=2.
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "grad_norms": norms, "w_gate_up_grad": first_grad}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {case: {f"ep{ep}": train(case, ep) for ep in (1, 2)} for case in CASES}
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
