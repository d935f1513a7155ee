"""``init_from`` on 2 ranks (torchrun, gloo): only rank 0 reads the weights, every rank gets its shard.

Rank 1 is given a path that does not exist, so the run fails if rank 1 reads anything. Writes
``<out>/rank<r>.json``: whether the sharded model now holds the saved weights exactly, and the message of a
load whose config does not match (which must reach both ranks).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from recipes.decoder.module import load_pretrained


def sharded_model(config: LLaMAConfig) -> LLaMA:
    with torch.device("meta"):
        model = LLaMA(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LLaMAConfig.from_preset("tiny")
    checkpoint = out / "weights.ckpt"
    if rank == 0:
        torch.manual_seed(0)
        saved = LLaMA(config).state_dict()
        torch.save({"state_dict": {f"model.{k}": v for k, v in saved.items()},
                    "hyper_parameters": {"config": config.to_dict()}}, checkpoint)
    dist.barrier()
    path = str(checkpoint) if rank == 0 else "/nonexistent/only-rank-0-reads"

    model = sharded_model(config)
    load_pretrained(model, path, config)
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = {}
    if rank == 0:
        reference = torch.load(checkpoint)["state_dict"]
        result["equal"] = all(torch.equal(loaded[k], reference[f"model.{k}"]) for k in loaded)
        result["keys"] = len(loaded)
    try:
        load_pretrained(sharded_model(LLaMAConfig.from_preset("tiny", n_layers=1)), path, LLaMAConfig.from_preset("tiny", n_layers=1))
        result["mismatch"] = "no error"
    except ValueError as error:
        result["mismatch"] = str(error)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
