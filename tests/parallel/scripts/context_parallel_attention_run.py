"""Context-parallel attention on 4 gloo processes against full causal attention in one process, forward and backward.

Every rank draws the same full q, k, v (and output weights), computes the full attention and its gradients, then
its context-parallel part: ``ContextParallel.shard`` of the inputs through ``ContextParallel.attention``, backward
from the same weights' shard. Rank 0 writes ``<out>`` (JSON): per case the largest difference of the output and of
the q/k/v gradients from the shards of the full ones, over all ranks; and the same for the tiny LLaMA's and
DeepSeek's logits and (relative) parameter gradients, packed rows included. ``--fake RELEASE`` runs the kernels' NPU
branch against the strict fake of torch_npu RELEASE (npu_fusion_attention and its grad op in the ring blocks).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port

WORLD = 4


def cases(groups):
    """(name, group, algo, batch, seq, heads, kv_heads, q/k head_dim, v head_dim, cu_seqlens)."""
    whole, pair = groups
    return [
        ("ulysses_gqa_repeat", whole, "ulysses", 2, 16, 8, 2, 8, 8, None),  # cp 4 > 2 KV heads: repeated
        ("ulysses_mha", pair, "ulysses", 2, 12, 4, 4, 8, 8, None),
        ("ulysses_packed", whole, "ulysses", 2, 16, 8, 2, 8, 8, [0, 5, 16, 19, 32]),  # samples cross the chunks
        ("ring_cp4_gqa", whole, "ring", 2, 16, 4, 2, 8, 8, None),
        ("ring_cp2", pair, "ring", 1, 12, 2, 1, 8, 8, None),
        # MLA: v heads smaller than q/k's (Dk 24, Dv 16), cp 2.
        ("ulysses_cp2_mla", pair, "ulysses", 2, 12, 4, 4, 24, 16, None),
        ("ulysses_cp2_packed_mla", pair, "ulysses", 2, 12, 4, 2, 24, 16, [0, 7, 12, 19, 24]),
        ("ring_cp2_mla", pair, "ring", 2, 12, 4, 2, 24, 16, None),
    ]


def full_attention(q, k, v, cu_seqlens):
    from lightning_npu.kernels import reference_attention, reference_packed_attention

    if cu_seqlens is None:
        return reference_attention(q, k, v)
    b, s = q.shape[:2]
    out = reference_packed_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens)
    return out.view(b, s, -1, v.shape[-1])


def run_case(case) -> dict:
    from lightning_npu.parallel.context import ContextParallel

    name, group, algo, b, s, h, hkv, d, dv, cu_seqlens = case
    generator = torch.Generator().manual_seed(hash(name) % 1000)
    q, k, v = (torch.randn(b, s, n, dim, generator=generator, dtype=torch.float64)
               for n, dim in ((h, d), (hkv, d), (hkv, dv)))
    weight = torch.randn(b, s, h, dv, generator=generator, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = full_attention(*full, cu_seqlens)
    (expected * weight).sum().backward()

    cp = ContextParallel(group, algo)
    local = [cp.shard(t.float()).detach().requires_grad_(True) for t in (q, k, v)]
    out = cp.attention(*local, cu_seqlens=cu_seqlens)
    (out * cp.shard(weight.float())).sum().backward()
    errors = {"out": (out.double() - cp.shard(expected.detach())).abs().max()}
    for label, mine, whole in zip("qkv", local, full):
        errors[f"d{label}"] = (mine.grad.double() - cp.shard(whole.grad)).abs().max()
    stacked = torch.stack(list(errors.values()))
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return dict(zip(errors, stacked.tolist()))


def model_case(group, algo: str, cu_seqlens, family: str = "llama") -> dict:
    """The tiny model of ``family`` (2 layers; DeepSeek's MLA: q/k heads 48 wide, v 32, the first layer dense, then
    DeepSeekMoE) on token ids [2, 32], whole on every rank and under context parallelism (the strategy's
    ``apply_context_parallel``, the ids sharded by sequence): logits and summed parameter gradients."""
    from lightning_npu.parallel.context import ContextParallel
    from lightning_npu.parallel.context import apply_context_parallel
    from recipes import families
    from recipes.decoder.transformer import positions_in_samples

    config_class, model_class = (getattr(families.get(family), name) for name in ("config_class", "model_class"))
    torch.manual_seed(0)
    model = model_class(config_class.from_preset("tiny", n_layers=2))
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 32, vocab, generator=torch.Generator().manual_seed(2))
    expected = model(tokens, cu_seqlens=cu_seqlens)
    (expected * weight).sum().backward()
    whole = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    cp = ContextParallel(group, algo)
    apply_context_parallel(model, model.context_parallel_modules(), cp)
    # The positions of this rank's part come in with it: the trunk cannot tell them from its input.
    positions = (torch.arange(32).expand(2, -1) if cu_seqlens is None else
                 positions_in_samples(cu_seqlens).view(2, 32))
    logits = model(cp.shard(tokens), cu_seqlens=cu_seqlens, position_ids=cp.shard(positions))
    (logits * cp.shard(weight)).sum().backward()
    errors = {"logits": (logits - cp.shard(expected.detach())).abs().max()}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # each rank's tokens' share of the gradient
    errors["grads"] = max((p.grad - whole[name]).abs().max() / whole[name].abs().max()
                          for name, p in model.named_parameters())
    stacked = torch.stack(list(errors.values()))
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return dict(zip(errors, stacked.tolist()))


def token_mean_case(group) -> dict:
    """A loss over labelled tokens that fall unevenly on the ranks (SFT labels): the group's average of
    ``token_mean`` against the mean over the whole sequences."""
    from lightning_npu.parallel.context import ContextParallel

    losses = torch.rand(2, 32, generator=torch.Generator().manual_seed(3))
    labelled = torch.zeros(2, 32, dtype=torch.bool)
    labelled[0, 20:] = True  # the tail only: ranks holding the head chunks count none of row 0
    labelled[1, 3:9] = True
    cp = ContextParallel(group, "ring")
    mine = cp.token_mean((cp.shard(losses) * cp.shard(labelled)).sum(), cp.shard(labelled).sum())
    dist.all_reduce(mine, group=group)
    return {"error": abs(float(mine) / cp.size - float(losses[labelled].mean()))}


def refusals(groups) -> dict:
    from lightning_npu.parallel.context import ContextParallel

    whole, _ = groups
    found = {}
    for name, call in {
        "ulysses_heads": lambda: ContextParallel(whole, "ulysses").attention(*(torch.randn(1, 4, 6, 8),) * 3),
        "ring_packed": lambda: ContextParallel(whole, "ring").attention(*(torch.randn(1, 4, 2, 8),) * 3,
                                                                       cu_seqlens=[0, 16]),
        "ring_split": lambda: ContextParallel(whole, "ring").shard(torch.zeros(1, 12)),
    }.items():
        try:
            call()
            found[name] = None
        except ValueError as error:
            found[name] = str(error)
    return found


def worker(rank: int, out: str, fake: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["CP_TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = (dist.group.WORLD, pairs[rank // 2])
    patch = None
    if fake:
        import pytest

        from tests.kernels.test_kernels import _take_npu_branch

        patch = pytest.MonkeyPatch()
        npu = _take_npu_branch(patch, release=fake)
    results = {case[0]: run_case(case) for case in cases(groups)}
    if not fake:  # the recipe's model through the same context (its kernels' NPU branch is tested above)
        results["model_ulysses_packed"] = model_case(groups[0], "ulysses", [0, 5, 16, 19, 40, 64])
        results["model_ring"] = model_case(groups[1], "ring", None)
        results["deepseek_ulysses_packed"] = model_case(groups[0], "ulysses", [0, 5, 16, 19, 40, 64], "deepseek")
        results["deepseek_ring"] = model_case(groups[1], "ring", None, "deepseek")
        results["token_mean"] = token_mean_case(groups[0])
    results["refusals"] = refusals(groups)
    if fake:
        ops = ("npu_fusion_attention", "npu_fusion_attention_grad")
        results["npu_calls"] = {op: len(npu.calls_to(op)) for op in ops}
        patch.undo()
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    dist.all_reduce(torch.zeros(1))  # not dist.barrier(): the fake's device rename leaves it no accelerator hooks
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fake", default=None, help="torch_npu release whose strict fake runs the NPU branch")
    args = parser.parse_args()
    os.environ["CP_TEST_PORT"] = str(free_port())
    mp.start_processes(worker, args=(args.out, args.fake), nprocs=WORLD, start_method="fork")


if __name__ == "__main__":
    main()
