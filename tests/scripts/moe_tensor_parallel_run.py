"""MoE under tensor parallelism, against plain npu_fsdp with as many data-parallel replicas: the tiny MoE recipe
model of ``expert_parallel_run`` (8 experts, the load-balancing loss and the balancing bias on, gradient clipping,
half the blocks recomputed), the same 8 rows a step and the same first weights (``init_<routing>.ckpt``, written by
the first launch: FSDP shards drawn shard by shard differ between layouts) on every layout, in three launches:

- ``--stage plain`` (2 simulated NPUs): ``plain_all`` (every token routed to all 8 experts) for 20 steps, a sharded
  checkpoint after epoch 0; ``plain_top2`` (top-2 routing) for ``TOP2_STEPS``;
- ``--stage mesh`` (4 simulated NPUs: 2 data-parallel replicas of a tensor-parallel pair): ``tp2_all`` and
  ``tp2_ep2_all`` (tensor_parallel_size 2, and with expert_parallel_size 2: the pair splits the experts) for 20 steps,
  ``tp2_ep2_all`` writing a sharded checkpoint after epoch 0; ``tp2_top2`` and ``tp2_ep2_top2``; ``plain_to_tp2_ep2``:
  ``plain_all``'s checkpoint resumed under tp 2 x ep 2;
- ``--stage resume`` (2 simulated NPUs): ``tp2_ep2_to_plain``: ``tp2_ep2_all``'s checkpoint resumed under plain
  sharding.

Each run's results go to ``<out>/<stage>.json`` (rank 0): per-step losses, layer 0's experts' placements and the
balancing biases after the first step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from tests.scripts.expert_parallel_mesh_run import BALANCING
from tests.scripts.expert_parallel_run import fit as fit_from, save_first_weights

ALL_EXPERTS = {**BALANCING, "top_k": 8}
TOP2 = {**BALANCING, "top_k": 2}
ROUTINGS = {"all": ALL_EXPERTS, "top2": TOP2}
TOP2_STEPS = 20
TP2 = {"tensor_parallel_size": 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", choices=("plain", "mesh", "resume"), required=True)
    args = parser.parse_args()
    out = Path(args.out)
    if args.stage == "plain":
        for routing, config in ROUTINGS.items():
            save_first_weights(out / f"init_{routing}.ckpt", **config)

    def fit(out: Path, name: str, ep: int, *, config: dict, **kwargs) -> dict:
        routing = next(routing for routing, fields in ROUTINGS.items() if fields == config)
        return fit_from(out, name, ep, config=config, init_from=str(out / f"init_{routing}.ckpt"), **kwargs)

    if args.stage == "plain":
        results = {
            "plain_all": fit(out, "plain_all", 1, config=ALL_EXPERTS, devices=2),
            "plain_top2": fit(out, "plain_top2", 1, config=TOP2, devices=2, state_dict_type="full"),
        }
    elif args.stage == "mesh":
        results = {
            "tp2_all": fit(out, "tp2_all", 1, config=ALL_EXPERTS, state_dict_type="full", **TP2),
            "tp2_ep2_all": fit(out, "tp2_ep2_all", 2, config=ALL_EXPERTS, **TP2),
            "tp2_top2": fit(out, "tp2_top2", 1, config=TOP2, state_dict_type="full", **TP2),
            "tp2_ep2_top2": fit(out, "tp2_ep2_top2", 2, config=TOP2, state_dict_type="full", **TP2),
            "plain_to_tp2_ep2": fit(out, "plain_to_tp2_ep2", 2, config=ALL_EXPERTS,
                                    resume=str(out / "plain_all_epoch0"), **TP2),
        }
    else:
        results = {"tp2_ep2_to_plain": fit(out, "tp2_ep2_to_plain", 1, config=ALL_EXPERTS, devices=2,
                                           resume=str(out / "tp2_ep2_all_epoch0"))}
    if dist.get_rank() == 0:
        (out / f"{args.stage}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
