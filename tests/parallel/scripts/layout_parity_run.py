"""Layouts against plain npu_fsdp with as many data-parallel replicas, from one first-weights checkpoint and the same
8 rows a step (``expert_parallel_run.fit``: gradient clipping, half the blocks recomputed), in three launches:

- ``--stage plain`` (2 simulated NPUs, 2 replicas): the first weights of each model (``init_<model>.ckpt``: FSDP
  shards drawn shard by shard differ between layouts, whatever the seed); ``moe_all``: the tiny MoE (8 experts,
  the load-balancing loss and the balancing bias on) with every token routed to all 8 experts for 20 steps, a
  sharded checkpoint after epoch 0; ``moe_top2``: top-2 routing, 20 steps; ``qwen3``: the tiny Qwen3 (q/k norms, tied
  embeddings) and ``deepseek``: the tiny DeepSeek (MLA, DeepSeekMoE with every token to all 8 routed experts), 10
  steps each;
- ``--stage mesh`` (4 simulated NPUs): tensor_parallel_size 2 (2 replicas of a tensor-parallel pair):
  ``moe_tp2_all`` / ``moe_tp2_ep2_all`` (and expert_parallel_size 2: the pair splits the experts; a sharded
  checkpoint after epoch 0), ``moe_tp2_top2`` / ``moe_tp2_ep2_top2``, ``qwen3_tp2``, ``deepseek_tp2``; plain
  ``deepseek_plain4`` and ``deepseek_ep2`` (4 replicas); ``moe_plain_to_tp2_ep2``: ``moe_all``'s checkpoint resumed
  under tp 2 x ep 2;
- ``--stage resume`` (2 simulated NPUs): ``moe_tp2_ep2_to_plain``: ``moe_tp2_ep2_all``'s checkpoint resumed under
  plain sharding.

Each stage's results go to ``<out>/<stage>.json`` (rank 0): per run the per-step losses, the first MoE layer's
experts' placements and the balancing biases after the first step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from tests.parallel.scripts.expert_parallel_mesh_run import BALANCING
from tests.parallel.scripts.expert_parallel_run import fit as fit_from, save_first_weights

#: Each model: (family, config fields over the family's runs' model).
MODELS = {
    "moe_all": ("moe", {**BALANCING, "top_k": 8}),
    "moe_top2": ("moe", {**BALANCING, "top_k": 2}),
    "qwen3": ("qwen", {}),
    "deepseek": ("deepseek", {"top_k": 8, "n_group": 1, "topk_group": 1}),
}
TP2 = {"tensor_parallel_size": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", choices=("plain", "mesh", "resume"), required=True)
    args = parser.parse_args()
    out = Path(args.out)
    if args.stage == "plain":
        for model, (family, config) in MODELS.items():
            save_first_weights(out / f"init_{model}.ckpt", family, **config)

    def fit(name: str, model: str, ep: int = 1, **kwargs) -> dict:
        family, config = MODELS[model]
        return fit_from(out, name, ep, config=config, family=family, init_from=str(out / f"init_{model}.ckpt"),
                        **kwargs)

    if args.stage == "plain":
        results = {
            "moe_all": fit("moe_all", "moe_all", devices=2),
            "moe_top2": fit("moe_top2", "moe_top2", devices=2, state_dict_type="full"),
            "qwen3": fit("qwen3", "qwen3", devices=2, state_dict_type="full", epochs=1),
            "deepseek": fit("deepseek", "deepseek", devices=2, state_dict_type="full", epochs=1),
        }
    elif args.stage == "mesh":
        results = {
            "moe_tp2_all": fit("moe_tp2_all", "moe_all", state_dict_type="full", **TP2),
            "moe_tp2_ep2_all": fit("moe_tp2_ep2_all", "moe_all", 2, **TP2),
            "moe_tp2_top2": fit("moe_tp2_top2", "moe_top2", state_dict_type="full", **TP2),
            "moe_tp2_ep2_top2": fit("moe_tp2_ep2_top2", "moe_top2", 2, state_dict_type="full", **TP2),
            "moe_plain_to_tp2_ep2": fit("moe_plain_to_tp2_ep2", "moe_all", 2, resume=str(out / "moe_all_epoch0"),
                                        **TP2),
            "qwen3_tp2": fit("qwen3_tp2", "qwen3", state_dict_type="full", epochs=1, **TP2),
            "deepseek_tp2": fit("deepseek_tp2", "deepseek", state_dict_type="full", epochs=1, **TP2),
            "deepseek_plain4": fit("deepseek_plain4", "deepseek", state_dict_type="full", epochs=1),
            "deepseek_ep2": fit("deepseek_ep2", "deepseek", 2, state_dict_type="full", epochs=1),
        }
    else:
        results = {"moe_tp2_ep2_to_plain": fit("moe_tp2_ep2_to_plain", "moe_all", devices=2,
                                               resume=str(out / "moe_tp2_ep2_all_epoch0"))}
    if dist.get_rank() == 0:
        (out / f"{args.stage}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
