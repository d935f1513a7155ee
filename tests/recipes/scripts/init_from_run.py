"""``init_from`` on 2 ranks (torchrun, gloo).

From a recipe checkpoint only rank 0 reads the weights and every rank gets its shard: rank 1 is given a path that
does not exist, so the run fails if rank 1 reads anything. From the Hugging Face directory ``<out>/hf`` (written by
the test) every rank reads only the slices of its own shards. Writes ``<out>/rank<r>.json``: whether the sharded
model now holds the saved weights exactly, the message of a load whose config does not match (which must reach
both ranks), and for the HF load the bytes this rank read and its peak host memory above its memory before
(``VmHWM`` reset through ``/proc/self/clear_refs``), in bytes. The FP8 DeepSeek-V3 directory ``<out>/fp8`` (per-expert
tensors, block scales) is read into DTensors sharded on dim 0, on dim 1 and replicated: whether each equals the
whole read. The same HF directory into a pipeline stage of 2 (rank r holds stage r: ``parallel.pipeline.split``)
and into a LoRA model with an int8 and an NF4 base sharded on dim 0: the bytes each rank read, and whether what it
holds is the whole read's (its stage's tensors; the codes and scales ``quantized_base_state`` gives the whole
weights, bit for bit).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_npu.parallel.pipeline import split
from recipes.decoder.hf_checkpoint import HFWeights, load_hf_checkpoint, open_hf_checkpoint, read_into
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from recipes.decoder.lora import add_lora, quantized_base_state
from recipes.decoder.lora_config import LoRAConfig
from recipes.decoder.pretrained import load_pretrained, read_pretrained
from recipes.decoder.tensor_parallel import PIPELINE


def sharded_model(config: LLaMAConfig, lora: LoRAConfig | None = None) -> LLaMA:
    with torch.device("meta"):
        model = LLaMA(config)
        if lora is not None:
            add_lora(model, lora)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():  # touched, as a run started from scratch initialises them: its own memory is resident
        for tensor in model.state_dict().values():
            tensor.to_local().zero_()
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
    result.update(hf_load(out / "hf"))
    result["fp8_equal"] = fp8_load(out / "fp8")
    result.update(stage_load(out / "hf"))
    for scheme in ("int8", "nf4"):
        result.update(quantized_load(out / "hf", scheme))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def vm_bytes(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def fp8_load(hf_dir: Path) -> dict:
    _, weights, plan = open_hf_checkpoint(hf_dir)
    whole = load_hf_checkpoint(hf_dir)[1]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    equal = {}
    for dim in (0, 1, None):
        tensors = {name: distribute_tensor(torch.zeros_like(tensor), mesh,
                                           [Replicate() if dim is None or tensor.dim() <= dim else Shard(dim)])
                   for name, tensor in whole.items()}
        read_into(tensors, weights, plan)
        equal[str(dim)] = all(torch.equal(tensors[name].full_tensor(), whole[name]) for name in whole)
    return equal


def measured_load(model, hf_dir: Path, config, **lora) -> dict:
    """``load_pretrained`` of ``hf_dir`` into ``model``: the bytes this rank read and its peak above its memory
    before."""
    read = [0]
    plain_read = HFWeights.read

    def counted(self, name, index):
        tensor = plain_read(self, name, index)
        read[0] += tensor.numel() * tensor.element_size()
        return tensor

    HFWeights.read = counted
    before = vm_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    try:
        load_pretrained(model, str(hf_dir), config, **lora)
    finally:
        HFWeights.read = plain_read
    return {"peak_above": vm_bytes("VmHWM") - before, "read": read[0]}


def stage_load(hf_dir: Path) -> dict:
    config = open_hf_checkpoint(hf_dir)[0]
    with torch.device("meta"):
        model = LLaMA(config)
    split(model, PIPELINE, [dist.get_rank()], dist.get_world_size())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    measured = measured_load(model, hf_dir, config)
    reference = load_hf_checkpoint(hf_dir)[1]
    held = model.state_dict()
    return {"stage_read": measured["read"], "stage_keys": len(held),
            "stage_equal": all(torch.equal(tensor, reference[name]) for name, tensor in held.items())}


def quantized_load(hf_dir: Path, scheme: str) -> dict:
    config = open_hf_checkpoint(hf_dir)[0]
    lora = LoRAConfig(rank=4, targets=("q", "v", "down"), base_quantization=scheme)
    model = sharded_model(config, lora)
    measured = measured_load(model, hf_dir, config, lora=lora, fresh_adapters=True)
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = {f"{scheme}_read": measured["read"]}
    if dist.get_rank() == 0:
        reference = quantized_base_state(read_pretrained(str(hf_dir), config), config, lora)
        result[f"{scheme}_equal"] = reference.keys() <= loaded.keys() and all(
            torch.equal(loaded[k], reference[k].to(loaded[k].dtype)) for k in reference)
        result[f"{scheme}_codes"] = sum(k.endswith("weight_codes") for k in reference)
    return result


def hf_load(hf_dir: Path) -> dict:
    config = open_hf_checkpoint(hf_dir)[0]
    model = sharded_model(config)
    measured = measured_load(model, hf_dir, config)
    result = {"hf_peak_above": measured["peak_above"], "hf_read": measured["read"]}
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        reference = load_hf_checkpoint(hf_dir)[1]
        result["hf_equal"] = loaded.keys() == reference.keys() and all(
            torch.equal(loaded[k], reference[k]) for k in loaded)
    smaller = LLaMAConfig.from_dict({**config.to_dict(), "n_layers": 1})
    try:
        load_pretrained(sharded_model(smaller), str(hf_dir), smaller)
        result["hf_mismatch"] = "no error"
    except ValueError as error:
        result["hf_mismatch"] = str(error)
    return result


if __name__ == "__main__":
    main()
