"""The FSDP2 replay: one training step of a PlanSpec as the allocations and frees FSDP2 (``fully_shard``),
autograd and AdamW make, in their order; the peak of the running total is the estimate, itemised as it was then.

- parameters, gradients and AdamW's two moments are sharded over the shard group (all devices, or one node's
  devices under hybrid sharding), each tensor padded to a multiple of the group size along dim 0, as FSDP2 does;
  they stay in the master dtype (fp32 unless the precision is ``*-true`` half precision); only the parameters the
  profile's ``trainable_parameters`` names get gradients, reduce-scatters and moments (a LoRA run: the adapters),
  frozen ones are sharded and gathered all the same; a LoRA base stored quantized (``block_storage``) is sharded
  and gathered as its codes (one byte per stored element, never cast) and its scales (like any float parameter),
  and each matmul decodes one weight at a time into a short-lived copy in the working dtype;
- each FSDP unit (a block, and the root: embeddings, final norm, output) is all-gathered in the parameter dtype
  (bf16 under ``bf16-mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``); ZeRO-3 frees a block's copy
  after its forward and gathers it again for backward, one unit ahead (prefetch), and the flat all-gather buffer
  of the previous unit lives until the next copy-out; ZeRO-2 keeps every unit gathered from its forward to the
  end of its backward; the root unit stays gathered from its forward to the end of its backward under both stages
  (npu_fsdp shards it with reshard_after_forward=False); under expert parallelism each layer's experts are a unit of
  their own nested in the block's (on the experts' mesh), gathered when the MLP reaches them, and backward's
  prefetch follows FSDP2's reverse post-forward order (a block, its experts, the block before);
- unsharded gradients of a unit live until its reduce-scatter, whose fp32 input buffer is kept until the next
  unit's reduce-scatter starts; the root's are reduced last;
- activations are the tensors autograd saves, as the spec's profile counts them (the first block's apart: after a
  frozen embedding its input needs no gradient, nor that of any block before the first that trains); checkpointed
  blocks keep only their input until backward recomputes them;
- logits are fp32 ``[batch, seq, vocab]``; cross-entropy saves its log-softmax, and its backward briefly holds
  three such tensors;
- multi-token prediction (``DecoderProfile.mtp_depths``) runs after the trunk, before the final norm: each depth's
  way into its block, its block (an FSDP unit after the trunk's), its head and fp32 logits, kept until its
  cross-entropy after the main loss. Autograd runs the newest nodes first, so backward starts with the depths'
  cross-entropies, whose logits' gradients wait while the main loss and head run backward; then each depth
  backward (last first), whose embedding gradient lives from there to the root's reduce-scatter; then the trunk;
- under tensor and context parallelism (``PlanSpec.parallel``) every count is one rank's: its tensor-parallel slice of
  each parameter (the profile's shapes), sharded by FSDP over the ``dp_shard x cp`` ranks (``shard_group``); its
  ``seq_len / cp`` tokens of each sequence; the residual stream split over the tensor-parallel ranks with sequence
  parallelism; the logits' vocabulary split with loss_parallel, whose log-softmax holds a shifted copy of them and
  whose fused backward an exp beside its two tensors; the collectives' and attention's buffers the profile names
  (``DecoderProfile.parallel_scratch``);
- HCCL keeps ``2 x HCCL_BUFFSIZE`` per communicator (tensor and context parallelism add the tensor-parallel group,
  FSDP's own group and the context-parallel group), and a fixed workspace plus a share of the peak is set aside
  for operator workspaces and allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

from lightning_npu.facts import optim8bit, weight_quant
from lightning_npu.plan.decoder import FP32_BYTES, INT64_BYTES, DecoderProfile, RankLocalShape
from lightning_npu.plan.shape import Parallelism
from lightning_npu.plan.posttrain import reference_bytes
from lightning_npu.plan.spec import GIB, ITEMS, MIB, Estimate, PlanSpec

#: HCCL holds two buffers of HCCL_BUFFSIZE per communicator.
HCCL_BUFFERS_PER_COMMUNICATOR = 2
#: Communicators npu_fsdp opens: one for full sharding; the shard, replicate and global groups under hybrid
#: sharding across nodes.
COMMUNICATORS_FULL, COMMUNICATORS_HYBRID = 1, 3
#: The step's batch and the next one (Lightning prefetches a batch), each input_ids and labels, int64.
BATCHES_HELD, TENSORS_PER_BATCH = 2, 2
#: Cross-entropy's backward holds the gradient of the loss w.r.t. the log-probabilities and that of the logits.
CROSS_ENTROPY_BACKWARD_TENSORS = 2
#: AdamW's per-tensor loop holds a scratch of its largest two tensors; foreach holds sqrt(v) for every tensor.
PER_TENSOR_SCRATCH_TENSORS = 2
#: AdamW8bit's loop holds, for its largest tensor, fp32 copies of both moments, the denominator and the scaled block
#: values while re-quantizing, plus their new codes (``optim8bit.CODE_BYTES`` each; the encoder works in chunks).
ADAMW8BIT_SCRATCH_TENSORS = 4
#: The largest micro-batch ``max_micro_batch`` searches up to.
MAX_MICRO_BATCH = 1 << 16


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
    #: The part of ``shard`` whose AdamW8bit moments are 8-bit (``facts.optim8bit.quantizes``).
    quantized_shard: int
    #: Bytes of a quantized base's codes: per device, and gathered (their scales count in ``shard`` / ``padded``).
    code_shard_bytes: int = 0
    code_padded_bytes: int = 0
    #: The numel of the unit's largest quantized weight (the copy one matmul decodes).
    decoded: int = 0
    #: The ranks it is sharded over (a group of one all-gathers nothing: the shard is the parameter).
    group: int = 1

    @property
    def gathers(self) -> bool:
        return self.group > 1


def _unit(name: str, shapes: Iterable[tuple[int, ...]], group: int,
          schemes: Optional[Iterable[Optional[str]]] = None) -> _Unit:
    """The unit of ``shapes``, stored as ``schemes`` says (None: the master dtype; ``int8`` / ``nf4``: quantized).
    Rank-local shapes (``RankLocalShape``: an expert-parallel rank's experts) form a unit of their own, sharded over
    the ranks of the experts' mesh that hold the same part; ``group`` is then the block's shard group."""
    shard = padded = exact = largest = quantized = codes = decoded = 0
    shapes = list(shapes)
    unit_group = group
    for shape, scheme in zip(shapes, schemes if schemes is not None else [None] * len(shapes)):
        shape_group = shape.shard_group(group) if isinstance(shape, RankLocalShape) else group
        unit_group = shape_group
        if scheme is not None:
            code_shape, shape = weight_quant.stored_shapes(shape, scheme)  # the scales count as a float tensor
            codes += -(-code_shape[0] // shape_group) * code_shape[1]
            decoded = max(decoded, math.prod(code_shape) * (2 if scheme == "nf4" else 1))
        rows, rest = shape[0], math.prod(shape[1:])
        local = -(-rows // shape_group) * rest  # FSDP2 pads dim 0 to a multiple of the group size
        shard, padded, exact = shard + local, padded + local * shape_group, exact + rows * rest
        largest = max(largest, local)
        quantized += local if optim8bit.quantizes(tuple(shape), shape_group) else 0
    return _Unit(name, shard, padded, exact, largest, quantized, codes, codes * group, decoded, unit_group)


@dataclass(frozen=True)
class _Units:
    """A model's FSDP units: the root, the blocks (none without an auto-wrap policy: the root holds them), and per
    layer the experts' nested unit (None where a layer has no rank-local parameters)."""

    root: _Unit
    blocks: list[_Unit]
    experts: list[Optional[_Unit]]

    @property
    def all(self) -> list[_Unit]:
        return [self.root, *self.blocks, *(unit for unit in self.experts if unit is not None)]


def _units(spec: PlanSpec, trainable: bool = False) -> _Units:
    """The model's units, of all their parameters or (``trainable``) of those that get gradients. Without an
    auto-wrap policy the whole model but the experts' units is the root unit."""
    group, profile = spec.shard_group, spec.profile
    layers = range(profile.n_blocks)
    if trainable:
        root = list(profile.trainable_parameters().root)
        stored = [[(shape, None) for shape in _split(profile.block_profile(i), spec.parallel)
                   .trainable_parameters().block.shapes] for i in layers]
    else:
        root = profile.root_parameters().shapes
        stored = [_split(profile.block_profile(i), spec.parallel).block_storage() for i in layers]
    blocks, experts = [], []
    for layer in stored:
        own = [(shape, scheme) for shape, scheme in layer if not isinstance(shape, RankLocalShape)]
        local = [shape for shape, _ in layer if isinstance(shape, RankLocalShape)]
        blocks.append(own)
        experts.append(_unit("experts", local, group) if local else None)
    if spec.wrap_blocks:
        return _Units(_unit("root", root, group),
                      [_unit("block", [shape for shape, _ in own], group, [scheme for _, scheme in own])
                       for own in blocks], experts)
    every = None if trainable else [None] * len(root) + [scheme for own in blocks for _, scheme in own]
    return _Units(_unit("root", root + [shape for own in blocks for shape, _ in own], group, every), [], experts)


def state_bytes(spec: PlanSpec) -> dict[str, float]:
    """Per-device bytes of the sharded parameters, and of the gradients and AdamW's two moments of the trainable
    ones (in host memory instead under ``cpu_offload``)."""
    return state_bytes_of(spec, _units(spec), _units(spec, trainable=True))


def state_bytes_of(spec: PlanSpec, units: _Units, train: _Units) -> dict[str, float]:
    """``state_bytes`` of the device's ``units`` (``train``: their trainable parameters)."""
    shards = sum(unit.shard * spec.bytes.master + unit.code_shard_bytes for unit in units.all)
    trainable = sum(unit.shard * spec.bytes.master + unit.code_shard_bytes for unit in train.all)
    optimizer = 2 * trainable
    if spec.optimizer == "adamw8bit":
        optimizer = sum(optim8bit.state_bytes(unit.quantized_shard, True)
                        + optim8bit.state_bytes(unit.shard - unit.quantized_shard, False, spec.bytes.master)
                        for unit in train.all)
    return {"parameters": shards, "gradients": trainable, "optimizer": optimizer}


class _StepReplay:
    """One steady-state step at a ZeRO stage and micro-batch, replayed phase by phase onto a timeline."""

    def __init__(self, spec: PlanSpec, stage: int, batch: int) -> None:
        self.spec, self.stage, self.batch = spec, stage, batch
        self.profile = spec.profile
        sizes = spec.bytes
        self.act, self.param, self.master, self.reduced = sizes.activation, sizes.param, sizes.master, sizes.reduce
        self.tokens = batch * spec.local_seq_len  # this rank's part of each sequence (all of it without cp)
        self.parallel = spec.parallel
        units = _units(spec)
        self.root, self.blocks, self.experts = units.root, units.blocks, units.experts
        #: The same units' trainable parameters: what gets gradients, reduce-scatters and AdamW moments.
        self.trainable = spec.profile.trainable_parameters()
        self.train = _units(spec, trainable=True)
        self.train_root, self.train_blocks = self.train.root, self.train.blocks
        self.shard_total = sum(unit.shard for unit in self.train.all)
        #: The units in the order backward reaches them (FSDP2's reverse post-forward order: a block, then the
        #: experts nested in it, then the block before), each of which prefetches the next under ZeRO-3.
        self.backward_order = [unit for i in reversed(range(self.profile.n_blocks))
                               for unit in (self.blocks[i] if self.blocks else None, self.experts[i])
                               if unit is not None]
        self.checkpointed = set(spec.checkpointed_layers)
        self.timeline = _Timeline()
        self.host = 0.0
        shape = spec.model
        # One [batch, seq, dim] activation of the residual stream (split by sequence over tp under SP).
        self.residual = self.act * shape.dim * self.tokens / self.parallel.between_blocks
        vocab = shape.vocab_size // (self.parallel.tensor if self.parallel.split_vocabulary else 1)
        self.logits = self.act * vocab * self.tokens
        self.logits_fp32 = FP32_BYTES * vocab * self.tokens
        #: Each layer's profile (``DecoderProfile.block_profile``), split as the run is.
        self.layers = [_split(self.profile.block_profile(i), self.parallel) for i in range(self.profile.n_blocks)]
        #: (all, MLP half) of what each block saves, in bytes.
        self.saved = []
        # A block's input needs a gradient once something before it trains: the embedding, or an earlier block
        # (under LoRA the blocks before the first adapted one keep only what their input-less backward needs).
        upstream_trains = self.trainable.embedding > 0
        for layer in self.layers:
            count = layer.saved_by_block if upstream_trains else layer.saved_by_first_block
            kept = count(spec.kernels, self.act, spec.seq_len)
            self.saved.append((sum(kept.all.values()) * self.tokens, sum(kept.mlp.values()) * self.tokens))
            upstream_trains = upstream_trains or bool(layer.trainable_parameters().block.shapes)
        self.final_saved = self.profile.saved_by_final_norm(spec.kernels, self.act) * self.tokens
        #: What each multi-token-prediction depth keeps outside its block: (on its way into it, into its head).
        self.depth_saved = tuple(sum(kept.values()) * self.tokens
                                 for kept in self.profile.saved_by_mtp_depth(spec.kernels, self.act))
        #: Whether the embedding's unsharded gradient exists (a depth's backward makes it before the trunk's).
        self.embedding_grad = False
        #: The flat all-gather buffer of the last unit gathered in forward (freed after the next copy-out).
        self.retained_gather = 0.0
        #: The last reduce-scatter's input buffer (freed when the next reduce-scatter starts).
        self.retained_reduce = 0.0
        #: Sharded gradient bytes alive now (the previous step's, or those reduced so far in this one).
        self.gradients = 0.0

    def run(self) -> Estimate:
        self.persistent_state()
        self.forward()
        self.backward()
        self.optimizer_step()
        return self.result()

    def result(self) -> Estimate:
        """The peak of the replayed timeline, itemised, with the allowance on top."""
        items = {key: max(self.timeline.at_peak.get(key, 0.0), 0.0) for key in ITEMS if key != "allowance"}
        tensors = sum(items.values())
        items["allowance"] = self.spec.workspace_gib * GIB + self.spec.fragmentation * tensors
        return Estimate(self.stage, self.batch, items, self.timeline.phase, self.host,
                        self.spec.device_memory_gib * GIB)

    def persistent_state(self) -> None:
        """Shards, gradients and optimizer states (the previous step's gradients are alive during forward: Lightning
        zeroes them, set to None, between forward and backward, and only on the first micro-batch of an
        accumulation window), communication buffers, the batch and the rotary tables."""
        spec, t = self.spec, self.timeline
        state = self.state()
        if spec.cpu_offload:
            self.host = sum(state.values())
        else:
            for item, nbytes in state.items():
                t.alloc(item, nbytes, "start")
            t.alloc("reference", reference_bytes(spec.post_training, state["parameters"]), "start")
            self.gradients = state["gradients"]
        if spec.world_size > 1:
            hybrid = spec.sharding == "hybrid" and spec.nodes > 1
            communicators = COMMUNICATORS_HYBRID if hybrid else COMMUNICATORS_FULL
            communicators += self.profile.expert_parallel_size > 1  # the expert group's all-to-alls
            # FSDP over the experts' own mesh (the ranks holding the same experts), where it is more than one rank.
            communicators += any(unit is not None and unit.gathers for unit in self.experts)
            communicators += _parallel_communicators(self.parallel)
            t.alloc("comm", communicators * HCCL_BUFFERS_PER_COMMUNICATOR * spec.hccl_buffsize_mb * MIB, "start")
        t.alloc("inputs", self.inputs_bytes(self.tokens), "start")

    def state(self) -> dict[str, float]:
        """The device's shards, gradients and optimizer states (``state_bytes``)."""
        return state_bytes(self.spec)

    def inputs_bytes(self, tokens: int) -> float:
        """The batches Lightning holds (``tokens`` each) and the rotary tables."""
        return BATCHES_HELD * TENSORS_PER_BATCH * tokens * INT64_BYTES + self.profile.rotary_table_bytes(self.act)

    def gathered_bytes(self, unit: _Unit) -> float:
        """The unit's unsharded parameters: the working dtype's, plus a quantized base's codes as they are."""
        return unit.padded * self.param + unit.code_padded_bytes

    def decoded_bytes(self, i: int) -> float:
        """The decoded copy of block ``i``'s largest quantized weight, alive during its matmul (0 without one)."""
        unit = self.blocks[i] if self.blocks else self.root
        return unit.decoded * self.param

    def gather(self, unit: _Unit, phase: str, flat_ready: bool = False) -> None:
        """All-gather ``unit`` into a flat buffer (unless prefetched), copy out into the unsharded parameters."""
        t, nbytes = self.timeline, self.gathered_bytes(unit)
        forward = phase.startswith("forward")
        if unit.gathers and not flat_ready:
            t.alloc("gathered", nbytes, phase + " all-gather")
        if forward:
            t.free("gathered", self.retained_gather)
            self.retained_gather = nbytes if unit.gathers else 0.0
        t.alloc("gathered", nbytes, phase + " copy-out")
        if unit.gathers and not forward:
            t.free("gathered", nbytes)

    def prefetch_after(self, unit: _Unit, phase: str) -> None:
        """ZeRO-3's backward prefetch at ``unit``'s pre-backward: the flat all-gather buffer of the unit backward
        reaches next (``backward_order``), if any."""
        order = self.backward_order
        index = next((k for k, other in enumerate(order) if other is unit), len(order) - 1)
        if index + 1 < len(order) and order[index + 1].gathers:
            self.timeline.alloc("gathered", self.gathered_bytes(order[index + 1]), phase + " prefetch")

    def forward(self) -> None:
        spec, t = self.spec, self.timeline
        self.gather(self.root, "forward: root")
        t.alloc("temporaries", self.residual, "forward: embedding")  # the residual stream
        for i in range(spec.model.n_layers):
            self.block_forward(i, f"forward: layer {i}")
        self.mtp_forward()
        t.free("gathered", self.retained_gather)  # the root's post-forward frees the last flat buffer
        self.retained_gather = 0.0
        # The root unit stays gathered until its backward ends (reshard_after_forward=False).
        self.loss_forward("forward")
        if spec.accumulate_grad_batches == 1 and not spec.cpu_offload:
            t.free("gradients", self.gradients)  # zero_grad(set_to_none) before the backward
            self.gradients = 0.0

    def block_forward(self, i: int, phase: str, gather: bool = True) -> None:
        """Block ``i``'s forward: gather it and its experts' unit (``gather``: not gathered yet), run it, keep what
        it saves (or, checkpointed, its input), reshard under ZeRO-3."""
        spec, t = self.spec, self.timeline
        if gather and self.blocks:
            self.gather(self.blocks[i], phase)
        if gather and self.experts[i] is not None:  # the experts' own unit, gathered when the MLP reaches them
            self.gather(self.experts[i], phase + " experts")
        checkpointed = i in self.checkpointed
        saved = self.saved_by(i)[0]
        scratch = (self.layers[i].forward_scratch(spec.kernels, self.act, spec.seq_len, checkpointed)
                   + self.layers[i].parallel_scratch(spec.kernels, self.act, spec.seq_len)[0]) * self.tokens
        t.moment("temporaries", scratch + (0 if checkpointed else saved) + self.decoded_bytes(i), phase)
        t.alloc("activations", self.residual if checkpointed else saved, phase)
        if self.stage == 3:
            for unit in (self.experts[i], self.blocks[i] if self.blocks else None):
                if unit is not None:
                    t.free("gathered", self.gathered_bytes(unit))

    def loss_forward(self, phase: str) -> None:
        """The final norm, the output projection and the loss (then the depths' losses): the norm's saved tensors
        and cross-entropy's log-softmax stay for the backward; the residual stream ends here."""
        t = self.timeline
        t.alloc("activations", self.final_saved, f"{phase}: final norm")
        t.free("temporaries", self.residual)  # the last residual is now saved by the final norm, or dead
        self.head_forward(phase)
        # loss_parallel's log-softmax keeps the shifted logits while it makes the result.
        shifted = self.logits_fp32 if self.parallel.split_vocabulary else 0.0
        t.alloc("logits", shifted, f"{phase}: shifted logits (loss_parallel)")
        t.alloc("logits", self.logits_fp32, f"{phase}: log-softmax")
        t.free("logits", self.logits_fp32 + shifted)  # the fp32 logits die with the loss function's frame
        depths = self.profile.mtp_depths
        for depth in range(1, depths + 1):  # the depths' losses, after the main one
            t.alloc("logits", self.logits_fp32, f"{phase}: multi-token prediction {depth} log-softmax")
        t.free("logits", depths * self.logits_fp32)  # the model holds every depth's logits until the last loss
    def head_forward(self, phase: str) -> None:
        """The output head: the logits in the working dtype, then the fp32 copy the model returns (kept)."""
        t = self.timeline
        t.alloc("logits", self.logits, phase + ": output projection")
        if self.act != FP32_BYTES:  # the model returns fp32 logits
            t.alloc("logits", self.logits_fp32, phase + ": logits to fp32")
            t.free("logits", self.logits)

    def mtp_forward(self) -> None:
        """The multi-token-prediction depths, after the trunk (whose last output stays for the final norm): each
        one's way into its block, the block, its head; the stream of hidden states lives until the last depth."""
        depths, t = self.profile.mtp_depths, self.timeline
        if not depths:
            return
        into_block, into_head = self.depth_saved
        scratch = self.profile.mtp_forward_scratch(self.spec.kernels, self.act) * self.tokens
        t.alloc("temporaries", self.residual, "forward: multi-token prediction")  # the depths' hidden state
        for depth in range(1, depths + 1):
            phase = f"forward: multi-token prediction {depth}"
            t.moment("temporaries", scratch + into_block, phase)
            t.alloc("activations", into_block, phase)
            self.block_forward(self.spec.model.n_layers + depth - 1, phase + " block")
            t.alloc("activations", into_head, phase + " norm")
            self.head_forward(phase)
        t.free("temporaries", self.residual)

    def saved_by(self, i: int) -> tuple[float, float]:
        """(all, MLP half) of the bytes block ``i`` saves for backward."""
        return self.saved[i]

    def reduce(self, unit: _Unit, phase: str) -> None:
        """Copy the unit's unsharded gradients (``unit``: its trainable parameters) into an fp32 reduce-scatter
        input (kept until the next unit's), free them, and add the reduced shard to the sharded gradients. A unit
        with nothing trainable reduces nothing."""
        t = self.timeline
        if not unit.exact:
            return
        t.free("unsharded_grads", self.retained_reduce)
        t.alloc("unsharded_grads", unit.padded * self.reduced, phase)
        t.free("unsharded_grads", unit.exact * self.unsharded_grad_bytes)
        self.keep_reduced(unit, phase)
        self.retained_reduce = unit.padded * self.reduced

    @property
    def unsharded_grad_bytes(self) -> float:
        """Bytes per element of a unit's unsharded gradients when they are reduced: the working dtype's."""
        return self.param

    def keep_reduced(self, unit: _Unit, phase: str) -> None:
        """Where a unit's reduced shard goes: added into the sharded gradients (accumulated, or offloaded to the
        host: only briefly on the device), or new ones."""
        t = self.timeline
        if self.spec.cpu_offload or self.gradients >= self.shard_total * self.master:  # offloaded, or accumulated
            t.moment("unsharded_grads", unit.shard * self.reduced, phase)
        else:
            t.alloc("gradients", unit.shard * self.master, phase)
            self.gradients += unit.shard * self.master

    def backward(self) -> None:
        self.loss_backward()
        self.mtp_backward()
        for i in reversed(range(self.spec.model.n_layers)):
            self.block_backward(i)
        t = self.timeline
        self.embedding_backward("backward: embedding")
        t.free("temporaries", self.residual)
        self.reduce(self.train_root, "backward: root reduce-scatter")
        t.free("unsharded_grads", self.retained_reduce)
        t.free("gathered", self.gathered_bytes(self.root))

    def loss_backward(self, head_grads: bool = True) -> None:
        """Cross-entropy's and the output projection's backward (the depths' cross-entropies first, their logits'
        gradients then waiting for their heads); the root's gradients are reduced last (``head_grads``: the head's
        unsharded gradients are allocated here, not accumulated into)."""
        t = self.timeline
        for depth in reversed(range(1, self.profile.mtp_depths + 1)):
            self.cross_entropy_backward(f"backward: multi-token prediction {depth}")
        self.cross_entropy_backward("backward")
        self.logits_gradient_to_working_dtype("backward")
        order = self.backward_order
        if self.stage == 3 and order and order[0].gathers:  # the root's pre-backward prefetches the last block
            t.alloc("gathered", self.gathered_bytes(order[0]), "backward: root prefetch")
        t.alloc("temporaries", self.residual, "backward: output projection")  # the residual stream's gradient
        self.gradient("unsharded_grads", self.trainable.head * self.param, "backward: output projection", head_grads)
        t.free("logits", self.logits)
        t.free("activations", self.final_saved)

    def gradient(self, item: str, nbytes: float, phase: str, new: bool) -> None:
        """Unsharded gradients computed in a backward: ``new`` ones stay, others are added into them and die."""
        (self.timeline.alloc if new else self.timeline.moment)(item, nbytes, phase)

    def cross_entropy_backward(self, phase: str) -> None:
        """A cross-entropy's backward: the gradients of its log-softmax and of its logits, after which the first and
        the saved log-softmax are released; the logits' (fp32) stays for the head's backward."""
        t = self.timeline
        t.alloc("logits", self.logits_fp32, phase + ": nll_loss")
        t.alloc("logits", self.logits_fp32, phase + ": log-softmax")
        if self.parallel.split_vocabulary:  # loss_parallel's fused backward: exp(log-softmax) beside the two
            t.moment("logits", self.logits_fp32, phase + ": nll_loss + log-softmax (loss_parallel)")
        t.free("logits", CROSS_ENTROPY_BACKWARD_TENSORS * self.logits_fp32)

    def logits_gradient_to_working_dtype(self, phase: str) -> None:
        """The backward of the model's fp32 cast: the logits' gradient in the working dtype replaces the fp32 one."""
        if self.act != FP32_BYTES:
            self.timeline.alloc("logits", self.logits, phase + ": logits to bf16")
            self.timeline.free("logits", self.logits_fp32)

    def mtp_backward(self) -> None:
        """The multi-token-prediction depths' backward, the last first: the head's (its weight's gradient summed into
        the head's), the depth's block, its way into the block (its own parameters' gradients; the embedding's
        gradient, made here before the trunk's backward)."""
        depths, t = self.profile.mtp_depths, self.timeline
        if not depths:
            return
        into_block, into_head = self.depth_saved
        for depth in reversed(range(1, depths + 1)):
            phase = f"backward: multi-token prediction {depth}"
            self.logits_gradient_to_working_dtype(phase)
            t.alloc("temporaries", self.residual, phase + " head")  # the gradient of the depth's hidden state
            t.moment("unsharded_grads", self.trainable.head * self.param, phase + " head")
            t.free("logits", self.logits)
            t.free("activations", into_head)
            self.block_backward(self.spec.model.n_layers + depth - 1)
            t.alloc("unsharded_grads", self.trainable.mtp // depths * self.param, phase + " eh_proj and norms")
            t.free("activations", into_block)
            self.embedding_backward(phase + " embedding")
            t.free("temporaries", self.residual)

    def embedding_backward(self, phase: str) -> None:
        """An embedding lookup's backward: the embedding's gradient, or a second one summed into it in place."""
        nbytes = self.trainable.embedding * self.param
        if self.embedding_grad:
            self.timeline.moment("unsharded_grads", nbytes, phase)
        else:
            self.timeline.alloc("unsharded_grads", nbytes, phase)
            self.embedding_grad = True

    def block_backward(self, i: int, phase: str = "", new_grads: bool = True, last: bool = True) -> None:
        """Block ``i``'s backward: regather (ZeRO-3) and prefetch the next, recompute if checkpointed, the MLP's
        gradients (w_down's first), then attention's, then (``last``: the last backward before the optimizer step)
        the reduce-scatter. ``new_grads``: the unsharded gradients are made here, not accumulated into."""
        spec, t, layer = self.spec, self.timeline, self.layers[i]
        phase = phase or f"backward: layer {i}"
        if self.blocks and self.stage == 3:
            self.gather(self.blocks[i], phase, flat_ready=True)
            self.prefetch_after(self.blocks[i], phase)  # the next unit of the backward pass
        checkpointed = i in self.checkpointed
        saved, mlp_saved = self.saved_by(i)
        if checkpointed:
            t.alloc("activations", saved, phase + " recompute")
        params = layer.trainable_parameters().block
        mlp_scratch, attention_scratch = (
            per_token * self.tokens for per_token in layer.backward_scratch(spec.kernels, self.act, spec.seq_len))
        experts = self.experts[i]
        if experts is not None and self.stage == 3:  # the experts' unit, prefetched at the block's pre-backward
            self.gather(experts, phase + " experts", flat_ready=True)
            self.prefetch_after(experts, phase + " experts")
        self.gradient("unsharded_grads", _numel(params.mlp_output) * self.param, phase + " (MLP)", new_grads)
        t.moment("temporaries", mlp_scratch + self.decoded_bytes(i), phase + " (MLP)")
        self.gradient("unsharded_grads", _numel(params.mlp_input) * self.param, phase + " (MLP)", new_grads)
        if experts is not None and last:  # their post-backward: reduce-scatter over the experts' mesh, reshard
            if self.train.experts[i] is not None:
                self.reduce(self.train.experts[i], phase + " experts reduce-scatter")
            t.free("gathered", self.gathered_bytes(experts))
        t.free("activations", mlp_saved)
        self.gradient("unsharded_grads", _numel(params.attention) * self.param, phase + " (attention)", new_grads)
        parallel_scratch = layer.parallel_scratch(spec.kernels, self.act, spec.seq_len)[1] * self.tokens
        t.moment("temporaries", attention_scratch + parallel_scratch, phase + " (attention)")
        t.free("activations", saved - mlp_saved + (self.residual if checkpointed else 0))
        if self.blocks and last:
            self.reduce(self.train_blocks[i], phase + " reduce-scatter")
            t.free("gathered", self.gathered_bytes(self.blocks[i]))

    def optimizer_step(self) -> None:
        """Fused AdamW updates in place; foreach holds sqrt(v) for every tensor; the per-tensor loop only for its
        largest two; AdamW8bit's loop the working set of its largest (ADAMW8BIT_SCRATCH_TENSORS)."""
        if self.spec.cpu_offload or self.spec.optimizer == "fused":
            return
        largest = max(unit.largest_shard for unit in self.train.all)
        if self.spec.optimizer == "foreach":
            scratch = self.shard_total * self.master
        elif self.spec.optimizer == "adamw8bit":
            scratch = largest * (ADAMW8BIT_SCRATCH_TENSORS * FP32_BYTES + optim8bit.CODE_BYTES)
        else:
            scratch = PER_TENSOR_SCRATCH_TENSORS * largest * self.master
        self.timeline.moment("temporaries", scratch, "optimizer step")


def _numel(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _split(layer: DecoderProfile, parallel: Parallelism) -> DecoderProfile:
    """A layer's profile (``block_profile``: the model's own, or another for a differing layer) under the run's
    tensor and context parallelism."""
    return layer if layer.parallel == parallel else dataclasses.replace(layer, parallel=parallel)


def _parallel_communicators(parallel: Parallelism) -> int:
    """The communicators tensor and context parallelism add: the tensor-parallel group and FSDP's own
    ``dp_shard x cp`` group (no longer the world's), the context-parallel group."""
    return 2 * (parallel.tensor > 1) + (parallel.context > 1)
