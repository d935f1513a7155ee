"""Will a LLaMA-2 recipe config fit in NPU memory? Per-device peak memory of one training step under npu_fsdp,
itemised, for ZeRO-2 and ZeRO-3, with the verdict against the device memory and the largest micro-batch that fits.

    lightning-npu plan --config recipes/llama2/configs/llama2_7b.yaml --devices 8 --device-memory 64

The YAML is read, never run: no data, tokenizer or weights are touched (placeholder paths are fine), and nothing
here imports torch. Flags override the YAML.

How the estimate is made. One training step is replayed as a sequence of allocations and frees, in the order
FSDP2 (``fully_shard``), autograd and AdamW make them, and the peak of the running total is reported with what made
it up at that moment:

- parameters, gradients and AdamW's two moments are sharded over the shard group (all devices, or one node's
  devices under hybrid sharding), each tensor padded to a multiple of the group size along dim 0, as FSDP2 does;
  they stay in the master dtype (fp32 unless the precision is ``*-true`` half precision);
- each FSDP unit (a ``TransformerBlock``, and the root: embeddings, final norm, output) is all-gathered in the
  parameter dtype (bf16 under ``bf16-mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``); ZeRO-3 frees a
  block's copy after its forward and gathers it again for backward, one unit ahead (prefetch), and the flat
  all-gather buffer of the previous unit lives until the next copy-out; ZeRO-2 keeps every unit gathered from its
  forward to the end of its backward; the root unit (embeddings, final norm, output) stays gathered from its forward
  to the end of its backward under both stages (npu_fsdp shards it with reshard_after_forward=False);
- unsharded gradients of a unit live until its reduce-scatter, whose fp32 input buffer is kept until the next
  unit's reduce-scatter starts; the root's are reduced last;
- activations are the tensors autograd saves, counted tensor by tensor from the LLaMA block (see
  ``block_activations``); checkpointed blocks keep only their input until backward recomputes them;
- logits are fp32 ``[batch, seq, vocab]``; cross-entropy saves its log-softmax, and its backward briefly holds three
  such tensors;
- HCCL keeps ``2 x HCCL_BUFFSIZE`` (200 MB by default) per communicator, and a fixed workspace plus a share of the
  peak is set aside for operator workspaces and allocator fragmentation.

``benchmarks/plan_accuracy.py`` checks the replay against the measured peak of real training steps on the CPU (PyTorch
reference kernels, 1 to 8 simulated devices, ZeRO-2/3, checkpointing, fp32/bf16): within 5%, except gradient
accumulation (6.7% low; probably the unsharded gradients npu_fsdp keeps between non-stepping micro-batches).
The ``fused`` activation counts (the NPU default) follow from which tensors each torch_npu backward takes
(``npu_*_backward`` signatures, checked in tests/test_plan.py) and have not been measured on an NPU.

Exit status: 0 when the configured zero_stage fits, 1 when it does not, 2 for a configuration it cannot plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

GIB = 1024**3
MIB = 1024**2

#: Device memory in GiB of each chip (HBM per device as the runtime sees it). A name matches by prefix.
CHIP_MEMORY_GIB = {
    "Ascend910B1": 64.0,
    "Ascend910B2": 64.0,
    "Ascend910B3": 64.0,
    "Ascend910B4": 32.0,
    "Ascend910_93": 64.0,
    "Ascend910A": 32.0,
    "Ascend910ProA": 32.0,
    "Ascend910ProB": 32.0,
}
DEFAULT_CHIP = "Ascend910B2"
#: HCCL's default per-communicator buffer (HCCL_BUFFSIZE, in MB, taken as MiB); each communicator holds two.
DEFAULT_HCCL_BUFFSIZE_MB = 200.0
#: What the NPU runtime, operator workspaces and the caching allocator's fragmentation take on top of tensors.
DEFAULT_WORKSPACE_GIB = 1.0
DEFAULT_FRAGMENTATION = 0.05
#: ``--kernels``: torch_npu fused kernels (the NPU default); the PyTorch reference paths of lightning_npu.kernels
#: (SDPA without an S x S matrix; what CPUs and fallbacks run); or attention that materialises S x S probabilities.
KERNELS = ("fused", "reference", "eager")
#: Devices per server HCCL accepts for collectives on the Atlas training series (first-generation 910, whose 8
#: chips form two 4-chip rings). CANN's distributed-training notes name that series alone: "针对Atlas 训练系列产品，
#: 如果使用1台训练服务器(Server)，要求实际参与集合通信的昇腾AI处理器数目只能为1/2/4/8，且0-3卡和4-7卡各为一个组网"
#: (and 1*n/2*n/4*n/8*n across n servers), while Atlas A2 takes "(1~8)*n" (HCCL create_group: no limit in
#: one A2 server). torch_npu's API support list (Ascend/pytorch docs/zh/native_apis/pytorch_2-10-0/
#: torch-distributed.md, all_gather_into_tensor / reduce_scatter_tensor: "world size不支持3，5，6，7") names no
#: chip; it is that first-generation rule, so it is applied to those chips only.
ATLAS_TRAINING_DEVICES_PER_SERVER = (1, 2, 4, 8)
MAX_MICRO_BATCH = 1 << 16


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element: sharded master parameters (and their gradients and AdamW states), the all-gathered
    working copy, activations, and the gradient reduce-scatter."""

    master: int
    param: int
    activation: int
    reduce: int


PRECISIONS = {
    "32-true": PrecisionBytes(master=4, param=4, activation=4, reduce=4),
    "bf16-mixed": PrecisionBytes(master=4, param=2, activation=2, reduce=4),
    "16-mixed": PrecisionBytes(master=4, param=2, activation=2, reduce=4),
    "bf16-true": PrecisionBytes(master=2, param=2, activation=2, reduce=2),
    "16-true": PrecisionBytes(master=2, param=2, activation=2, reduce=2),
}
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}

#: Row order and labels of the itemised table; ``{m}``/``{p}`` become the master / working dtype names.
ITEMS = {
    "parameters": "parameters ({m} shards)",
    "gradients": "gradients ({m} shards)",
    "optimizer": "optimizer states (AdamW 2 x {m} shards)",
    "gathered": "gathered parameters ({p} copy + all-gather buffers)",
    "unsharded_grads": "unsharded gradients + reduce-scatter buffers",
    "activations": "activations saved for backward",
    "logits": "logits + cross-entropy (fp32)",
    "temporaries": "temporaries (residual stream, op and optimizer scratch)",
    "inputs": "batch + rotary tables",
    "comm": "communication buffers (HCCL)",
    "allowance": "workspace + fragmentation allowance",
}


class PlanError(ValueError):
    """A configuration the planner cannot model; the message names the value, why, and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The LLaMA-2 dimensions the estimate needs (any LLaMAConfig-like object provides them)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def of(cls, config: Any) -> "ModelShape":
        return cls(**{f.name: int(getattr(config, f.name)) for f in dataclasses.fields(cls)})

    def block_shapes(self) -> list[tuple[int, ...]]:
        """Parameter shapes of one TransformerBlock (norms, wq, wk, wv, wo, fused gate/up, down)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return [(self.dim,), (q, self.dim), (kv, self.dim), (kv, self.dim), (self.dim, q), (self.dim,),
                (2 * self.ffn_hidden_dim, self.dim), (self.dim, self.ffn_hidden_dim)]

    def root_shapes(self) -> list[tuple[int, ...]]:
        """Parameters outside the blocks: token embeddings, final norm, output projection."""
        return [(self.vocab_size, self.dim), (self.dim,), (self.vocab_size, self.dim)]

    def num_params(self) -> int:
        block = sum(math.prod(shape) for shape in self.block_shapes())
        return sum(math.prod(shape) for shape in self.root_shapes()) + self.n_layers * block


@dataclass(frozen=True)
class PlanSpec:
    """Everything the estimate depends on. Memory sizes in GiB; ``devices`` is per node, as in Lightning."""

    model: ModelShape
    seq_len: int
    micro_batch: int
    devices: int = 1
    nodes: int = 1
    precision: str = "bf16-mixed"
    accumulate_grad_batches: int = 1
    zero_stage: int = 3
    sharding: str = "full"
    wrap_blocks: bool = True
    ac_ratio: float = 0.0
    cpu_offload: bool = False
    kernels: str = "fused"
    #: AdamW's foreach implementation (the default on NPUs) holds one extra copy of the moments while stepping.
    foreach_optimizer: bool = True
    hccl_buffsize_mb: float = DEFAULT_HCCL_BUFFSIZE_MB
    workspace_gib: float = DEFAULT_WORKSPACE_GIB
    fragmentation: float = DEFAULT_FRAGMENTATION
    device_memory_gib: float = CHIP_MEMORY_GIB[DEFAULT_CHIP]
    chip: str = DEFAULT_CHIP
    preset: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "devices", "nodes", "accumulate_grad_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} is invalid: it must be a positive integer")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} cannot be planned; use one of {', '.join(PRECISIONS)}")
        if self.zero_stage not in (2, 3):
            raise PlanError(f"zero_stage={self.zero_stage!r} is not supported by npu_fsdp; use 2 or 3")
        if self.sharding not in ("full", "hybrid"):
            raise PlanError(f"sharding={self.sharding!r} is not supported by npu_fsdp; use 'full' or 'hybrid'")
        if not 0.0 <= self.ac_ratio <= 1.0:
            raise PlanError(f"activation_checkpointing_ratio={self.ac_ratio!r} must lie in [0, 1]")
        if self.kernels not in KERNELS:
            raise PlanError(f"kernels={self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.device_memory_gib <= 0:
            raise PlanError(f"device memory {self.device_memory_gib!r} GiB must be positive")
        if self.seq_len > self.model.max_seq_len:
            raise PlanError(
                f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}; lower data.seq_len"
                f" (or --seq-len) or set model.config.max_seq_len >= {self.seq_len}"
            )
        from lightning_npu.facts.chips import chip_series  # pure Python: planning needs no torch

        if chip_series(self.chip) == "training" and self.devices not in ATLAS_TRAINING_DEVICES_PER_SERVER:
            raise PlanError(
                f"devices={self.devices} per node cannot run HCCL collectives on {self.chip}: the Atlas training series"
                f" (first-generation 910) takes {', '.join(map(str, ATLAS_TRAINING_DEVICES_PER_SERVER))} devices per"
                " server (two or four from the same half, 0-3 or 4-7); use 1, 2, 4 or 8 devices per node"
            )

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def shard_group(self) -> int:
        """Devices each parameter is sharded over: all of them, or one node's under hybrid sharding."""
        return self.devices if self.sharding == "hybrid" else self.world_size

    @property
    def checkpointed_layers(self) -> list[int]:
        """Which blocks recompute their activations: the strategy's evenly spaced choice for the ratio."""
        n, r = self.model.n_layers, self.ac_ratio
        return [i for i in range(n) if int((i + 1) * r) > int(i * r)]

    @property
    def bytes(self) -> PrecisionBytes:
        return PRECISIONS[self.precision]


@dataclass
class Estimate:
    """Per-device peak of one training step (steady state, after the first optimizer step). Bytes throughout."""

    zero_stage: int
    micro_batch: int
    items: dict[str, float]
    peak_phase: str
    host_bytes: float
    device_bytes: float

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def headroom(self) -> float:
        return self.device_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes


# ---------------------------------------------------------------------------------------------------- activations


def block_activations(model: ModelShape, kernels: str, act_bytes: int, seq_len: int) -> dict[str, float]:
    """Bytes per token that one TransformerBlock's forward leaves saved for its backward.

    Each entry is a tensor autograd (or a fused kernel's backward) keeps, from the block's code:
    RMSNorm -> wq/wk/wv -> rotary -> causal attention -> wo -> residual -> RMSNorm -> w_gate_up -> SwiGLU -> w_down.
    ``reference``: the PyTorch paths of lightning_npu.kernels; RMSNorm upcasts its input and keeps the fp32 copy and
    the fp32 normalised tensor; rotary keeps nothing but the tables (its multiplicands need no gradient);
    grouped-query keys/values are expanded to all heads before SDPA, which keeps q, k, v, its output and an fp32
    log-sum-exp per head (no S x S matrix). ``fused``: npu_rms_norm keeps its input and an fp32 rstd,
    npu_rotary_mul its input, npu_fusion_attention q, k, v (at kv heads), its output and softmax max/sum
    (8 fp32 per head each), npu_swiglu its input. ``eager``: as reference, but attention keeps scaled fp32 q, k,
    v and the fp32 [heads, seq, seq] probabilities.
    """
    d, f, n = model.dim, model.ffn_hidden_dim, model.n_heads
    kv = model.n_kv_heads * model.head_dim
    a = act_bytes
    if kernels == "fused":
        return {
            "attention_norm input + rstd": a * d + 4,
            "wq/wk/wv input": a * d,
            "rotary inputs (q, k)": a * (d + kv),
            "attention q, k, v": a * (d + 2 * kv),
            "attention softmax max + sum": 2 * 8 * 4 * n,
            "attention output (wo input)": a * d,
            "ffn_norm input + rstd": a * d + 4,
            "w_gate_up input": a * d,
            "swiglu input (gate, up)": 2 * a * f,
            "swiglu output (w_down input)": a * f,
        }
    norm = 4 * d + 4 + 4 * d  # fp32 input copy, rstd, fp32 normalised
    saved = {
        "attention_norm (fp32 input, rstd, normalised)": norm,
        "wq/wk/wv input": a * d,
    }
    if kernels == "reference":
        saved["attention q, k, v (kv expanded to all heads)"] = 3 * a * d
        saved["attention log-sum-exp"] = 4 * n
    else:
        saved["attention scaled q, k and v (fp32)"] = 3 * 4 * d
        saved["attention probabilities (fp32, S x S)"] = 4 * n * seq_len
    saved.update({
        "attention output (wo input)": a * d,
        "ffn_norm (fp32 input, rstd, normalised)": norm,
        "w_gate_up input": a * d,
        "gate/up projection": 2 * a * f,
        "silu(gate)": a * f,
        "swiglu output (w_down input)": a * f,
    })
    return saved


def _final_norm_activations(model: ModelShape, kernels: str, act_bytes: int) -> float:
    """Bytes per token saved by the final RMSNorm and the output projection's input."""
    d = model.dim
    norm = act_bytes * d + 4 if kernels == "fused" else 4 * d + 4 + 4 * d
    return norm + act_bytes * d


def _block_forward_scratch(model: ModelShape, kernels: str, act_bytes: int, seq_len: int, checkpointed: bool) -> float:
    """Bytes per token of short-lived tensors inside one block's forward beyond what it saves."""
    d, f = model.dim, model.ffn_hidden_dim
    scratch = act_bytes * d + (0 if kernels == "fused" else 4 * d)  # the block output; RMSNorm's fp32 square
    if kernels == "eager":
        scratch += 4 * model.n_heads * seq_len  # the scores before softmax
    if checkpointed:  # nothing is kept, but the MLP's gate/up, silu and product exist together for a moment
        scratch += 4 * act_bytes * f
    return scratch


#: Entries of ``block_activations`` that belong to the MLP half of the block (freed once its backward is done).
_MLP_ENTRIES = ("ffn_norm", "w_gate_up", "gate/up", "silu", "swiglu")


def _backward_scratch(model: ModelShape, kernels: str, act_bytes: int, seq_len: int) -> tuple[float, float]:
    """Bytes per token of gradient temporaries alive together inside one block's backward, beyond its saved
    tensors: (MLP half, attention half). In the MLP the gradient of the SwiGLU output and those of its two
    inputs coexist while the saved output is already released (2 x ffn); in attention the q, k and v gradients
    (plus, for eager attention, the gradients of the probabilities and scores)."""
    a, d, f = act_bytes, model.dim, model.ffn_hidden_dim
    kv = model.n_kv_heads * model.head_dim if kernels == "fused" else d
    attention = a * (d + 2 * kv)
    if kernels == "eager":
        attention += 8 * model.n_heads * seq_len
    return 2 * a * f, attention


# ------------------------------------------------------------------------------------------------------ the replay


class _Timeline:
    """Running byte totals per item; remembers the largest total, what it consisted of and when it happened."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.peak = -1.0
        self.at_peak: dict[str, float] = {}
        self.phase = ""

    def alloc(self, item: str, nbytes: float, phase: str) -> None:
        self.now[item] += nbytes
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.at_peak, self.phase = total, dict(self.now), phase

    def free(self, item: str, nbytes: float) -> None:
        self.now[item] -= nbytes

    def moment(self, item: str, nbytes: float, phase: str) -> None:
        """A tensor that lives only inside one operation."""
        self.alloc(item, nbytes, phase)
        self.free(item, nbytes)


@dataclass(frozen=True)
class _Unit:
    """One FSDP unit: per-device shard numel, the padded numel gathered, and the exact (gradient) numel."""

    name: str
    shard: int
    padded: int
    exact: int
    largest_shard: int


def _unit(name: str, shapes: Iterable[tuple[int, ...]], group: int) -> _Unit:
    shard = padded = exact = largest = 0
    for shape in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        local = -(-rows // group) * rest  # FSDP2 pads dim 0 to a multiple of the group size
        shard, padded, exact = shard + local, padded + local * group, exact + rows * rest
        largest = max(largest, local)
    return _Unit(name, shard, padded, exact, largest)


def _units(spec: PlanSpec) -> tuple[_Unit, list[_Unit]]:
    """(root unit, block units). Without an auto-wrap policy the whole model is the root unit."""
    model, group = spec.model, spec.shard_group
    if spec.wrap_blocks:
        block = _unit("block", model.block_shapes(), group)
        return _unit("root", model.root_shapes(), group), [block] * model.n_layers
    return _unit("root", model.root_shapes() + model.block_shapes() * model.n_layers, group), []


def state_bytes(spec: PlanSpec) -> dict[str, float]:
    """Per-device bytes of the sharded parameters, their gradients and AdamW's two moments (in host memory
    instead under ``cpu_offload``)."""
    root, blocks = _units(spec)
    shard = sum(unit.shard for unit in [root] + blocks) * spec.bytes.master
    return {"parameters": shard, "gradients": shard, "optimizer": 2 * shard}


def estimate(spec: PlanSpec, zero_stage: Optional[int] = None, micro_batch: Optional[int] = None) -> Estimate:
    """Replay one steady-state training step of ``spec`` (at ``zero_stage`` / ``micro_batch`` if given) and
    return the per-device peak, itemised."""
    stage = spec.zero_stage if zero_stage is None else zero_stage
    batch = spec.micro_batch if micro_batch is None else micro_batch
    if stage not in (2, 3):
        raise PlanError(f"zero_stage={stage!r} is not supported by npu_fsdp; use 2 or 3")
    model, sizes = spec.model, spec.bytes
    tokens = batch * spec.seq_len
    a, pb, mb, rb = sizes.activation, sizes.param, sizes.master, sizes.reduce
    v, d = model.vocab_size, model.dim
    root, blocks = _units(spec)
    units = [root] + blocks
    gathered_world = spec.shard_group > 1
    checkpointed = set(spec.checkpointed_layers)
    t = _Timeline()

    # Persistent state. Gradients of the previous step are alive during forward: Lightning zeroes them (set to
    # None) between forward and backward, and only on the first micro-batch of an accumulation window.
    shard_total = sum(u.shard for u in units)
    state = state_bytes(spec)
    host = 0.0
    if spec.cpu_offload:
        host = sum(state.values())
    else:
        for item, nbytes in state.items():
            t.alloc(item, nbytes, "start")
    if spec.world_size > 1:
        communicators = 3 if spec.sharding == "hybrid" and spec.nodes > 1 else 1
        t.alloc("comm", communicators * 2 * spec.hccl_buffsize_mb * MIB, "start")
    rope = 2 * model.max_seq_len * model.head_dim * 4 * (1.5 if a == 2 else 1.0)
    # The step's batch and the next one (Lightning prefetches a batch): input_ids and labels, int64.
    t.alloc("inputs", 2 * 2 * tokens * 8 + rope, "start")

    # ---- forward
    retained_ag = 0.0  # the flat all-gather buffer of the last unit gathered in forward, freed after the next copy-out

    def gather(unit: _Unit, phase: str, flat_ready: bool = False) -> None:
        """all-gather into a flat buffer (unless prefetched), copy out into the unsharded parameters."""
        nonlocal retained_ag
        if gathered_world and not flat_ready:
            t.alloc("gathered", unit.padded * pb, phase + " all-gather")
        if phase.startswith("forward"):
            t.free("gathered", retained_ag)
            retained_ag = unit.padded * pb if gathered_world else 0.0
        t.alloc("gathered", unit.padded * pb, phase + " copy-out")
        if gathered_world and not phase.startswith("forward"):
            t.free("gathered", unit.padded * pb)

    gather(root, "forward: root")
    t.alloc("temporaries", a * d * tokens, "forward: embedding")  # the residual stream
    block_saved = sum(block_activations(model, spec.kernels, a, spec.seq_len).values()) * tokens
    for i in range(model.n_layers):
        phase = f"forward: layer {i}"
        if blocks:
            gather(blocks[i], phase)
        ckpt = i in checkpointed
        scratch = _block_forward_scratch(model, spec.kernels, a, spec.seq_len, ckpt) * tokens
        t.moment("temporaries", scratch + (0 if ckpt else block_saved), phase)
        t.alloc("activations", a * d * tokens if ckpt else block_saved, phase)
        if blocks and stage == 3:
            t.free("gathered", blocks[i].padded * pb)
    t.free("gathered", retained_ag)  # the root's post-forward frees the last flat buffer
    retained_ag = 0.0
    # npu_fsdp shards the root unit with reshard_after_forward=False: it stays gathered until its backward ends.
    final = _final_norm_activations(model, spec.kernels, a) * tokens
    t.alloc("activations", final, "forward: final norm")
    t.free("temporaries", a * d * tokens)  # the last residual is now saved by the final norm, or dead
    t.alloc("logits", a * v * tokens, "forward: output projection")
    if a != 4:  # LLaMA.forward returns fp32 logits
        t.alloc("logits", 4 * v * tokens, "forward: logits to fp32")
        t.free("logits", a * v * tokens)
    t.alloc("logits", 4 * v * tokens, "forward: log-softmax")
    t.free("logits", 4 * v * tokens)  # the fp32 logits die with the loss function's frame
    grads_now = shard_total * mb if not spec.cpu_offload else 0.0
    if spec.accumulate_grad_batches == 1 and not spec.cpu_offload:
        t.free("gradients", grads_now)
        grads_now = 0.0

    # ---- backward
    t.alloc("logits", 4 * v * tokens, "backward: nll_loss")
    t.alloc("logits", 4 * v * tokens, "backward: log-softmax")
    t.free("logits", 8 * v * tokens)
    if a != 4:
        t.alloc("logits", a * v * tokens, "backward: logits to bf16")
        t.free("logits", 4 * v * tokens)
    if stage == 3 and blocks and gathered_world:  # the root's pre-backward prefetches the last block
        t.alloc("gathered", blocks[-1].padded * pb, "backward: root prefetch")
    t.alloc("temporaries", a * d * tokens, "backward: output projection")  # the residual stream's gradient
    t.alloc("unsharded_grads", (v * d + d) * pb, "backward: output projection")  # root gradients are reduced last
    t.free("logits", a * v * tokens)
    t.free("activations", final)
    retained_rs = 0.0

    def reduce(unit: _Unit, phase: str) -> None:
        """Copy the unit's unsharded gradients into an fp32 reduce-scatter input (kept until the next unit's),
        free them, and add the reduced shard to the sharded gradients."""
        nonlocal retained_rs, grads_now
        t.free("unsharded_grads", retained_rs)
        t.alloc("unsharded_grads", unit.padded * rb, phase)
        t.free("unsharded_grads", unit.exact * pb)
        if spec.cpu_offload or grads_now >= shard_total * mb:  # offloaded, or accumulated into existing grads
            t.moment("unsharded_grads", unit.shard * rb, phase)
        else:
            t.alloc("gradients", unit.shard * mb, phase)
            grads_now += unit.shard * mb
        retained_rs = unit.padded * rb

    shapes = model.block_shapes()
    mlp_grads = sum(math.prod(shape) for shape in shapes[5:])  # ffn_norm, w_gate_up, w_down
    attention_grads = sum(math.prod(shape) for shape in shapes[:5])
    down_grads = math.prod(shapes[7])
    saved = block_activations(model, spec.kernels, a, spec.seq_len)
    mlp_saved = sum(nbytes for name, nbytes in saved.items() if name.startswith(_MLP_ENTRIES)) * tokens
    mlp_scratch, attention_scratch = (x * tokens for x in _backward_scratch(model, spec.kernels, a, spec.seq_len))
    for i in reversed(range(model.n_layers)):
        phase = f"backward: layer {i}"
        if blocks and stage == 3:
            gather(blocks[i], phase, flat_ready=True)
            if i > 0 and gathered_world:  # prefetch the next unit of the backward pass
                t.alloc("gathered", blocks[i - 1].padded * pb, phase + " prefetch")
        if i in checkpointed:
            t.alloc("activations", block_saved, phase + " recompute")
        t.alloc("unsharded_grads", down_grads * pb, phase + " (MLP)")
        t.moment("temporaries", mlp_scratch, phase + " (MLP)")
        t.alloc("unsharded_grads", (mlp_grads - down_grads) * pb, phase + " (MLP)")
        t.free("activations", mlp_saved)
        t.alloc("unsharded_grads", attention_grads * pb, phase + " (attention)")
        t.moment("temporaries", attention_scratch, phase + " (attention)")
        t.free("activations", block_saved - mlp_saved + (a * d * tokens if i in checkpointed else 0))
        if blocks:
            reduce(blocks[i], phase + " reduce-scatter")
            t.free("gathered", blocks[i].padded * pb)
    t.alloc("unsharded_grads", v * d * pb, "backward: embedding")
    t.free("temporaries", a * d * tokens)
    reduce(root, "backward: root reduce-scatter")
    t.free("unsharded_grads", retained_rs)
    t.free("gathered", root.padded * pb)

    # ---- optimizer step: foreach AdamW holds sqrt(v) for every tensor; the per-tensor loop only its largest two.
    if not spec.cpu_offload:
        scratch = shard_total * mb if spec.foreach_optimizer else 2 * max(u.largest_shard for u in units) * mb
        t.moment("temporaries", scratch, "optimizer step")

    items = {key: max(t.at_peak.get(key, 0.0), 0.0) for key in ITEMS if key != "allowance"}
    tensors = sum(items.values())
    items["allowance"] = spec.workspace_gib * GIB + spec.fragmentation * tensors
    return Estimate(stage, batch, items, t.phase, host, spec.device_memory_gib * GIB)


def max_micro_batch(spec: PlanSpec, zero_stage: Optional[int] = None, limit: int = MAX_MICRO_BATCH) -> int:
    """The largest micro-batch (samples per device) whose estimate fits the device memory; 0 if not even 1 fits."""
    def fits(batch: int) -> bool:
        return estimate(spec, zero_stage, batch).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):  # memory grows with the batch, so double, then bisect
        low, high = high, high * 2
    if high > limit:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ---------------------------------------------------------------------------------------------- reading the YAML


def _find_recipe_config() -> Any:
    """recipes.llama2.config (pure Python): importable from a checkout's root, or found next to this package."""
    try:
        from recipes.llama2 import config
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "recipes" / "llama2" / "config.py").is_file():
            raise PlanError(
                "cannot import recipes.llama2.config, which defines the LLaMA presets; run from the lightning-npu"
                " checkout's root (or put it on PYTHONPATH)"
            ) from None
        sys.path.insert(0, str(root))
        from recipes.llama2 import config
    return config


def _section(document: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = document.get(name) or {}
    if not isinstance(value, Mapping):
        raise PlanError(f"'{name}:' in the config must be a mapping, not {type(value).__name__} ({value!r})")
    return value


def _devices(value: Any) -> int:
    if isinstance(value, bool):
        raise PlanError(f"trainer.devices={value!r} is not a device count; give a number such as 8")
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, (list, tuple)) and value:
        return len(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit() and int(text) >= 1:
            return int(text)
        ids = [part for part in text.rstrip(",").split(",") if part.strip()]
        if "," in text and all(part.strip().isdigit() for part in ids):
            return len(ids)
    raise PlanError(
        f"trainer.devices={value!r} depends on the machine the run starts on; pass --devices N (devices per node)"
    )


def _precision(value: Any) -> str:
    text = str(value)
    text = _PRECISION_ALIASES.get(text, text)
    if text not in PRECISIONS:
        raise PlanError(f"trainer.precision={value!r} cannot be planned for NPUs; use one of {', '.join(PRECISIONS)}")
    return text


def _class_names(policy: Any, option: str) -> list[str]:
    if policy is None:
        return []
    entries = [policy] if isinstance(policy, str) else list(policy)
    names = [str(entry).rpartition(".")[2] for entry in entries]
    unknown = [name for name in names if name != "TransformerBlock"]
    if unknown:
        raise PlanError(
            f"{option}={policy!r}: the planner models the LLaMA recipe's TransformerBlock units only, not"
            f" {', '.join(unknown)}; use [recipes.llama2.model.TransformerBlock]"
        )
    return names


def _strategy(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """npu_fsdp init args from ``trainer.strategy`` (a registered name or class_path + init_args)."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, Mapping):
        class_path = str(strategy.get("class_path", ""))
        if class_path.rpartition(".")[2] != "NPUFSDPStrategy":
            raise PlanError(
                f"trainer.strategy.class_path={class_path!r}: the planner models npu_fsdp (FSDP2) only; use"
                " class_path: lightning_npu.NPUFSDPStrategy"
            )
        args = strategy.get("init_args") or {}
        if not isinstance(args, Mapping):
            raise PlanError(f"trainer.strategy.init_args must be a mapping, not {args!r}")
        return dict(args)
    if strategy == "npu_fsdp":
        return {}
    raise PlanError(
        f"trainer.strategy={strategy!r}: the planner models npu_fsdp (FSDP2) only; set trainer.strategy to"
        " npu_fsdp or to class_path: lightning_npu.NPUFSDPStrategy with init_args"
    )


def chip_memory_gib(chip: str) -> float:
    """Device memory of ``chip`` in GiB (longest matching name prefix)."""
    matches = [name for name in CHIP_MEMORY_GIB if chip.startswith(name)]
    if not matches:
        raise PlanError(
            f"chip {chip!r} is unknown; use one of {', '.join(CHIP_MEMORY_GIB)} or pass --device-memory GiB"
        )
    return CHIP_MEMORY_GIB[max(matches, key=len)]


def load_spec(
    path: str | os.PathLike,
    *,
    devices: Optional[int] = None,
    nodes: Optional[int] = None,
    micro_batch: Optional[int] = None,
    seq_len: Optional[int] = None,
    precision: Optional[str] = None,
    zero_stage: Optional[int] = None,
    ac_ratio: Optional[float] = None,
    device_memory_gib: Optional[float] = None,
    chip: Optional[str] = None,
    kernels: str = "fused",
    hccl_buffsize_mb: Optional[float] = None,
) -> PlanSpec:
    """A PlanSpec from a recipe YAML (LightningCLI layout: model / data / trainer), keyword arguments winning."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise PlanError(
            f"config {str(path)!r} does not exist; give a recipe YAML such as recipes/llama2/configs/tiny.yaml"
        )
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise PlanError(f"config {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(document, Mapping):
        raise PlanError(f"config {str(path)!r} must be a mapping with model:, data: and trainer: sections")
    model_section, data, trainer = (_section(document, name) for name in ("model", "data", "trainer"))
    recipe = _find_recipe_config()
    preset = str(model_section.get("preset", "tiny"))
    overrides = model_section.get("config") or {}
    if not isinstance(overrides, Mapping):
        raise PlanError(f"model.config must be a mapping of LLaMAConfig fields, not {overrides!r}")
    try:
        config = recipe.LLaMAConfig.from_preset(preset, **dict(overrides))
    except (ValueError, TypeError) as error:
        raise PlanError(f"model: {error}") from None
    strategy = _strategy(trainer)
    ac_policy = _class_names(strategy.get("activation_checkpointing_policy"), "activation_checkpointing_policy")
    wrap = _class_names(strategy.get("auto_wrap_policy"), "auto_wrap_policy")
    ratio = float(strategy.get("activation_checkpointing_ratio", 1.0)) if ac_policy else 0.0
    notes = []
    if ac_ratio is not None:
        ratio = float(ac_ratio)
        if ratio > 0 and not ac_policy:
            notes.append("--ac-ratio applies activation checkpointing to TransformerBlock, which the YAML does not")
    memory = device_memory_gib if device_memory_gib is not None else chip_memory_gib(chip or DEFAULT_CHIP)
    buffsize = hccl_buffsize_mb
    if buffsize is None:
        buffsize = float(os.environ.get("HCCL_BUFFSIZE", DEFAULT_HCCL_BUFFSIZE_MB))
    try:
        return PlanSpec(
            model=ModelShape.of(config),
            seq_len=int(seq_len if seq_len is not None else data.get("seq_len", 256)),
            micro_batch=int(micro_batch if micro_batch is not None else data.get("batch_size", 8)),
            devices=devices if devices is not None else _devices(trainer.get("devices", 1)),
            nodes=int(nodes if nodes is not None else trainer.get("num_nodes", 1)),
            precision=_precision(precision if precision is not None else trainer.get("precision", "32-true")),
            accumulate_grad_batches=int(trainer.get("accumulate_grad_batches", 1)),
            zero_stage=int(zero_stage if zero_stage is not None else strategy.get("zero_stage", 3)),
            sharding=str(strategy.get("sharding", "full")),
            wrap_blocks=bool(wrap),
            ac_ratio=ratio,
            cpu_offload=bool(strategy.get("cpu_offload", False)),
            kernels=kernels,
            hccl_buffsize_mb=buffsize,
            device_memory_gib=float(memory),
            chip=chip or DEFAULT_CHIP,
            preset=preset,
            notes=tuple(notes),
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, PlanError):
            raise
        raise PlanError(f"config {str(path)!r}: {error}") from None


# ------------------------------------------------------------------------------------------------------ the report


def _dtype_name(nbytes: int, precision: str) -> str:
    if nbytes == 4:
        return "fp32"
    return "fp16" if precision.startswith("16") else "bf16"


def report(spec: PlanSpec) -> dict[str, Any]:
    """The plan as plain data: ZeRO-2 and ZeRO-3 estimates (GiB), verdicts and largest micro-batches."""
    stages = {}
    for stage in (2, 3):
        result = estimate(spec, stage)
        stages[str(stage)] = {
            "items_gib": {key: value / GIB for key, value in result.items.items()},
            "total_gib": result.total / GIB,
            "headroom_gib": result.headroom / GIB,
            "fits": result.fits,
            "peak_phase": result.peak_phase,
            "max_micro_batch": max_micro_batch(spec, stage),
            "host_gib": result.host_bytes / GIB,
        }
    per_layer = block_activations(spec.model, spec.kernels, spec.bytes.activation, spec.seq_len)
    return {
        "model": {"preset": spec.preset, "params": spec.model.num_params(), **dataclasses.asdict(spec.model)},
        "seq_len": spec.seq_len,
        "micro_batch": spec.micro_batch,
        "devices": spec.devices,
        "nodes": spec.nodes,
        "shard_group": spec.shard_group,
        "precision": spec.precision,
        "configured_zero_stage": spec.zero_stage,
        "checkpointed_layers": len(spec.checkpointed_layers),
        "kernels": spec.kernels,
        "device_memory_gib": spec.device_memory_gib,
        "activation_bytes_per_token_per_layer": sum(per_layer.values()),
        "stages": stages,
        "notes": list(spec.notes),
    }


def render(spec: PlanSpec, plan: Mapping[str, Any]) -> str:
    """The plan as a table for people."""
    sizes = spec.bytes
    names = {"m": _dtype_name(sizes.master, spec.precision), "p": _dtype_name(sizes.param, spec.precision)}
    model = spec.model
    layout = f"{spec.nodes} node x {spec.devices}" if spec.nodes == 1 else f"{spec.nodes} nodes x {spec.devices}"
    per_token = plan["activation_bytes_per_token_per_layer"]
    params = model.num_params()
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    lines = [
        f"LLaMA {spec.preset or 'custom'}: {size} parameters, {model.n_layers} layers, dim {model.dim},"
        f" vocab {model.vocab_size}",
        f"{spec.world_size} devices ({layout}), shard group {spec.shard_group} ({spec.sharding}), {spec.precision},"
        f" seq {spec.seq_len} x micro-batch {spec.micro_batch}, accumulate {spec.accumulate_grad_batches},"
        f" activation checkpointing {len(spec.checkpointed_layers)}/{model.n_layers} blocks, {spec.kernels} kernels",
        f"activations: {per_token / 1024:.1f} KiB per token per layer"
        f" ({per_token * spec.seq_len * spec.micro_batch / GIB:.2f} GiB per layer at this micro-batch),"
        f" {spec.bytes.activation * model.dim / 1024:.1f} KiB per token per checkpointed layer",
        "",
    ]
    label_width = max(len(label.format(**names)) for label in ITEMS.values()) + 2
    header = f"{'per-device peak (GiB)':<{label_width}}" + "".join(
        f"{'ZeRO-' + s + ('*' if int(s) == spec.zero_stage else ''):>12}" for s in ("2", "3"))
    lines += [header, "-" * len(header)]
    stages = plan["stages"]
    for key, label in ITEMS.items():
        lines.append(f"{label.format(**names):<{label_width}}" + "".join(
            f"{stages[s]['items_gib'][key]:>12.2f}" for s in ("2", "3")))
    lines.append("-" * len(header))
    rows = [
        ("total", lambda r: f"{r['total_gib']:.2f}"),
        (f"device memory ({spec.chip if spec.device_memory_gib == _default_memory(spec) else 'given'})",
         lambda r: f"{spec.device_memory_gib:.2f}"),
        ("headroom", lambda r: f"{r['headroom_gib']:+.2f}"),
        ("verdict", lambda r: "fits" if r["fits"] else "NO FIT"),
        ("largest micro-batch that fits", lambda r: str(r["max_micro_batch"])),
    ]
    for label, cell in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"{cell(stages[s]):>12}" for s in ("2", "3")))
    lines.append("")
    lines.append(f"* configured zero_stage. The peak falls in: ZeRO-2 {stages['2']['peak_phase']};"
                 f" ZeRO-3 {stages['3']['peak_phase']}.")
    if spec.cpu_offload:
        lines.append(f"cpu_offload: parameters, gradients and optimizer states ({stages['3']['host_gib']:.2f} GiB per"
                     " device) live in host memory.")
    configured = stages[str(spec.zero_stage)]
    if not configured["fits"]:
        lines.append(_advice(spec, plan))
    lines += [f"note: {note}" for note in spec.notes]
    return "\n".join(lines)


def _default_memory(spec: PlanSpec) -> Optional[float]:
    try:
        return chip_memory_gib(spec.chip)
    except PlanError:
        return None


def _advice(spec: PlanSpec, plan: Mapping[str, Any]) -> str:
    configured = plan["stages"][str(spec.zero_stage)]
    tips = []
    if configured["max_micro_batch"] > 0:
        tips.append(f"lower data.batch_size to {configured['max_micro_batch']} (raise accumulate_grad_batches to keep"
                    " the global batch)")
    if spec.zero_stage == 2 and plan["stages"]["3"]["fits"]:
        tips.append("use zero_stage: 3")
    if len(spec.checkpointed_layers) < spec.model.n_layers:
        tips.append("raise activation_checkpointing_ratio (with activation_checkpointing_policy: [TransformerBlock])")
    tips.append("add devices or nodes (parameters and optimizer states shard over them)")
    return f"does not fit with zero_stage={spec.zero_stage}: " + "; or ".join(tips) + "."


# ------------------------------------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML (model / data / trainer sections)")
    parser.add_argument("--devices", type=int, help="devices per node (overrides trainer.devices)")
    parser.add_argument("--nodes", type=int, help="number of nodes (overrides trainer.num_nodes)")
    parser.add_argument("--micro-batch", type=int, help="samples per device per step (overrides data.batch_size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (overrides data.seq_len)")
    parser.add_argument("--precision", help="overrides trainer.precision, e.g. bf16-mixed")
    parser.add_argument("--zero-stage", type=int, choices=(2, 3), help="the stage to judge (the table shows both)")
    parser.add_argument("--ac-ratio", type=float, help="share of blocks that recompute activations (0..1)")
    parser.add_argument("--device-memory", type=float, help="GiB per device (default: the chip's)")
    parser.add_argument("--chip", default=DEFAULT_CHIP,
                        help=f"chip name for the default memory and, on first-generation 910 chips, HCCL's"
                        f" 1/2/4/8 devices-per-node rule (default {DEFAULT_CHIP})")
    parser.add_argument("--kernels", choices=KERNELS, default="fused",
                        help="fused: torch_npu kernels (default); reference: PyTorch paths; eager: S x S attention")
    parser.add_argument("--hccl-buffsize", type=float, help="HCCL_BUFFSIZE in MB (default: the environment's, or 200)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(
            args.config, devices=args.devices, nodes=args.nodes, micro_batch=args.micro_batch, seq_len=args.seq_len,
            precision=args.precision, zero_stage=args.zero_stage, ac_ratio=args.ac_ratio,
            device_memory_gib=args.device_memory, chip=args.chip, kernels=args.kernels,
            hccl_buffsize_mb=args.hccl_buffsize,
        )
        plan = report(spec)
    except PlanError as error:
        print(f"lightning-npu plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render(spec, plan))
    return 0 if plan["stages"][str(spec.zero_stage)]["fits"] else 1
