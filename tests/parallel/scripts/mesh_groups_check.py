"""The process groups npu_fsdp's mesh creates, counted on one rank of a larger world through torch's fake process
group (no peers run): rank 5 of 8, for several layouts, the groups its setup views create (``fsdp``,
``data_parallel``, Lightning's ``lightning``) and those its mechanisms' views add (``tp``, ``cp``, the experts').

Prints one JSON object: per layout, the groups created at setup, the groups after every mechanism's view, the
groups after a module reads Lightning's ``tensor_parallel`` dimension, each view's size, and the warnings raised.
"""

import json
import warnings

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_npu.facts.options import FSDPOptions
from lightning_npu.parallel.mesh import ParallelMesh

WORLD, RANK = 8, 5

LAYOUTS = {
    "plain": ({}, 1),
    "hybrid": ({"sharding": "hybrid"}, 2),
    "tp2": ({"tensor_parallel_size": 2}, 1),
    "cp2": ({"context_parallel_size": 2}, 1),
    "tp2_cp2": ({"tensor_parallel_size": 2, "context_parallel_size": 2}, 1),
    "ep4": ({"expert_parallel_size": 4}, 1),
    "tp2_ep2": ({"tensor_parallel_size": 2, "expert_parallel_size": 2}, 1),
}


def groups() -> int:
    return len(distributed_c10d._world.pg_map)


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    results = {}
    for name, (kwargs, nodes) in LAYOUTS.items():
        options = FSDPOptions(**kwargs)
        before = groups()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = ParallelMesh("cpu", options.layout(nodes, WORLD // nodes), sharding=options.sharding,
                                expert_parallel_size=options.expert_parallel_size)
            lightning = mesh.lightning  # what the strategy hands the module at setup (fsdp and data_parallel too)
            views = {"fsdp": mesh.fsdp.size(), "data_parallel": mesh.data_parallel.size(),
                     "lightning": list(lightning.shape)}
            at_setup = groups() - before
            for view in ("tp", "cp"):
                views[view] = None if getattr(mesh, view) is None else getattr(mesh, view).size()
            views["expert_fsdp"] = mesh.expert_fsdp.size()
            if options.expert_parallel_size > 1:
                views["ep"] = mesh.experts["ep"].size()
            with_mechanisms = groups() - before
            # A module written for Lightning's ModelParallelStrategy reads its dimensions.
            sizes = [lightning["data_parallel"].size(), lightning["tensor_parallel"].get_group().size()]
            after_lightning = groups() - before
        results[name] = {"at_setup": at_setup, "with_mechanisms": with_mechanisms, "after_lightning": after_lightning,
                         "views": views, "lightning_sizes": sizes, "warnings": [str(w.message) for w in caught]}
    print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
