"""AdamW with 8-bit moments: ``torch.optim.AdamW``'s update in fp32, its two moments stored blockwise-quantized
(``blockwise``: uint8 codes plus one fp32 absmax scale per ``block_size`` elements), about 2.03 bytes of state per
parameter instead of 8.

Why in the plugin: torch_npu's int8 matmuls have no backward, so on Ascend 910B the memory int8 can save in training
is the optimizer state; torchao's AdamW8bit needs ``torch.compile`` (unverified on NPUs) and cannot load a full
optimizer state dict under FSDP2. This one is eager torch ops only, on every chip and on the simulated runtime.

Which tensors are quantized is decided from the global shape and the dim-0 shard count alone, so every rank decides
alike (``facts.optim8bit.quantizes``: at least 4096 elements, a multiple of ``block_size``, and under FSDP2 every
rank's shard made of whole blocks). Blocks are then the same row-major blocks of the whole tensor however it is
sharded: each rank quantizes its local shard, and the codes (shaped like the parameter) and the scales (one per
block) are DTensors sharded like it, which DCP saves as plain uint8 / fp32 shards and reshards on load (2 ranks -> 1
included) without re-quantizing. A layout whose shards would cut a tensor's blocks keeps that tensor fp32, so it cannot
read the tensor's codes from a sharded checkpoint: load the consolidated file (``lightning-npu consolidate``) there.
The others keep fp32 ``exp_avg`` / ``exp_avg_sq`` as torch's AdamW does; the first step logs how many.

Full (unsharded) checkpoints hold the moments dequantized to fp32 under torch's names (``to_full_state``, on
``full_state``), which ``torch.optim.AdamW`` loads; a torch AdamW state loads back here re-quantized
(``load_state_dict``, ``from_full_state``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
from lightning.fabric.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_npu.facts import optim8bit as rules
from lightning_npu.quant import blockwise

#: The moments, and whether each one's map is signed (exp_avg) or not (exp_avg_sq, never negative).
MOMENTS = {"exp_avg": True, "exp_avg_sq": False}


def codes_key(moment: str) -> str:
    return f"{moment}_codes"


def scales_key(moment: str) -> str:
    return f"{moment}_scales"


class AdamW8bit(Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay) with blockwise 8-bit moments.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        amsgrad, foreach, capturable, differentiable, fused: accepted for signature compatibility; anything but the
            default raises (the max of past second moments would need its own 8-bit state, and the update runs as
            eager per-tensor ops).
        block_size: elements per fp32 scale (256: 2 + 8/256 = 2.03 bytes of state per quantized parameter).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        block_size: int = rules.DEFAULT_BLOCK_SIZE,
    ) -> None:
        unsupported = {"amsgrad": amsgrad, "foreach": foreach, "capturable": capturable,
                       "differentiable": differentiable, "fused": fused}
        for name, value in unsupported.items():
            if value:
                raise ValueError(
                    f"AdamW8bit does not support {name}={value!r}: its moments are 8-bit blocks updated by eager"
                    f" per-tensor ops{' (amsgrad would need a third, 8-bit max state)' if name == 'amsgrad' else ''}."
                    f" Leave {name} at its default, or use torch.optim.AdamW (fp32 moments) for it"
                )
        if isinstance(lr, Tensor) or not lr >= 0.0:
            raise ValueError(f"AdamW8bit lr={lr!r} must be a float >= 0")
        if not eps >= 0.0:
            raise ValueError(f"AdamW8bit eps={eps!r} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"AdamW8bit betas={betas!r} must be two values in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW8bit weight_decay={weight_decay!r} must be >= 0")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"AdamW8bit block_size={block_size!r} must be a positive int (e.g. 256)")
        # torch.optim.AdamW's group keys, so a full checkpoint's param groups load into it as they are.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=True, block_size=block_size)
        super().__init__(params, defaults)
        self._reported = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a torch AdamW state's groups have no block size
            group.setdefault("block_size", self.defaults["block_size"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[param]
                if not state:
                    state.update(_fresh_state(param, group["block_size"]))
                state["step"] += 1
                _update(_local(param), _local(param.grad), state, group)
        if not self._reported:
            self._reported = True
            self._report()
        return loss

    def _report(self) -> None:
        """Log once how many parameter tensors hold 8-bit moments and how many stayed fp32."""
        quantized = [p for p, s in self.state.items() if codes_key("exp_avg") in s]
        kept = [p for p, s in self.state.items() if codes_key("exp_avg") not in s]
        share = sum(p.numel() for p in quantized) / max(sum(p.numel() for p in self.state), 1)
        rank_zero_info(
            f"AdamW8bit: {len(quantized)} parameter tensors hold 8-bit moments ({100 * share:.1f}% of the elements),"
            f" {len(kept)} keep fp32 moments (under {rules.MIN_QUANTIZED_NUMEL} elements, not a multiple of block_size="
            f"{self.defaults['block_size']}, or sharded off block boundaries)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this optimizer's own state (codes and scales as saved) or fp32 moments (torch AdamW's, or a full
        checkpoint's), which are re-quantized for the tensors this optimizer quantizes."""
        state_dict = {**state_dict, "state": {k: dict(v) for k, v in state_dict["state"].items()}}
        # torch's load casts every floating state to the parameter's dtype: keep the codes and scales out of it.
        quantized = {
            index: {key: values.pop(key) for key in list(values) if key.endswith(("_codes", "_scales"))}
            for index, values in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        # As torch matches them: the saved groups' parameter keys (indices, or names from DCP) by position.
        params = dict(zip((key for group in state_dict["param_groups"] for key in group["params"]),
                          (p for group in self.param_groups for p in group["params"])))
        for key, values in quantized.items():
            param = params[key]
            state = self.state[param]
            state.update({name: value.to(param.device) for name, value in values.items()})
            _settle_format(param, state, self._block_size(param))

    def _block_size(self, param: Tensor) -> int:
        return next(g["block_size"] for g in self.param_groups if any(p is param for p in g["params"]))

    def to_full_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """What a full (unsharded) checkpoint holds of this optimizer's gathered ``state_dict``: the moments
        dequantized to fp32 under torch's names (``full_state``), which ``torch.optim.AdamW`` loads. The checkpoint
        code calls it on any optimizer that has it (``strategies.checkpoints.optimizer_state``)."""
        return full_state(state_dict)

    def from_full_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A full (unsharded) state dict with fp32 moments, as ``to_full_state`` writes it, turned into the codes and
        scales of the whole tensors this optimizer quantizes: what a full-state load under FSDP2 needs, since it
        shards the saved tensors onto the live state's keys. Parameters are matched by position in the groups."""
        saved_groups = state_dict.get("param_groups", [])
        keys = [key for group in saved_groups for key in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for key, values in state_dict.get("state", {}).items():
            values = dict(values)
            param = params[keys.index(key)]
            block_size = self._block_size(param)
            if quantizes(param, block_size):
                for moment, signed in MOMENTS.items():
                    if moment in values:
                        values[codes_key(moment)], values[scales_key(moment)] = blockwise.quantize(
                            values.pop(moment), block_size, signed)
            state[key] = values
        return {**state_dict, "state": state}


def full_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A full (unsharded) optimizer state dict with every quantized moment dequantized to fp32 under torch's names
    (``exp_avg``, ``exp_avg_sq``): what ``torch.optim.AdamW`` loads. Other optimizers' states come back unchanged."""
    state = {}
    for key, values in state_dict.get("state", {}).items():
        values = dict(values)
        for moment, signed in MOMENTS.items():
            if codes_key(moment) in values:
                values[moment] = blockwise.dequantize(values.pop(codes_key(moment)), values.pop(scales_key(moment)),
                                                      signed)
        state[key] = values
    return {**state_dict, "state": state}


def quantizes(param: Tensor, block_size: int) -> bool:
    """Whether ``param``'s moments are 8-bit: ``facts.optim8bit.quantizes`` on its global shape and its dim-0
    shard count (tensors sharded otherwise, or on several mesh dimensions, keep fp32 moments)."""
    shards = [(dim, p) for dim, p in enumerate(getattr(param, "placements", ())) if not p.is_replicate()]
    if len(shards) > 1 or (shards and not shards[0][1].is_shard(0)):
        return False
    count = param.device_mesh.size(shards[0][0]) if shards else 1
    return rules.quantizes(tuple(param.shape), count, block_size)


def _local(tensor: Tensor) -> Tensor:
    """The rank's own elements of a DTensor (shares storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _like(param: Tensor, local: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``local`` as the rank's shard of a ``shape`` DTensor placed as ``param`` (plain when ``param`` is)."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=shape, stride=stride)


def _fresh_state(param: Tensor, block_size: int) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {"step": torch.tensor(0.0)}
    if not quantizes(param, block_size):
        for moment in MOMENTS:
            state[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
    local = _local(param)
    for moment in MOMENTS:
        state[codes_key(moment)] = _like(param, torch.zeros(local.shape, dtype=blockwise.CODES_DTYPE,
                                                            device=local.device), tuple(param.shape))
        state[scales_key(moment)] = _like(param, torch.zeros(local.numel() // block_size, device=local.device,
                                                             dtype=blockwise.SCALES_DTYPE),
                                          (param.numel() // block_size,))
    return state


def _settle_format(param: Tensor, state: dict[str, Tensor], block_size: int) -> None:
    """Store a loaded state the way this optimizer keeps it for ``param``: codes and scales if it quantizes it
    (fp32 moments get quantized), fp32 moments otherwise (codes and scales get dequantized)."""
    for moment, signed in MOMENTS.items():
        if quantizes(param, block_size) and moment in state:
            values = _local(state.pop(moment)).float()
            codes, scales = blockwise.quantize(values, block_size, signed)
            state[codes_key(moment)] = _like(param, codes, tuple(param.shape))
            state[scales_key(moment)] = _like(param, scales, (param.numel() // block_size,))
        elif not quantizes(param, block_size) and codes_key(moment) in state:
            values = blockwise.dequantize(_local(state.pop(codes_key(moment))), _local(state.pop(scales_key(moment))),
                                          signed)
            state[moment] = _like(param, values.to(param.dtype), tuple(param.shape))


def _update(param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> None:
    """One AdamW step on the rank's local shard, in fp32 (torch's single-tensor AdamW, moment by moment)."""
    beta1, beta2 = group["betas"]
    lr, eps, block_size = group["lr"], group["eps"], group["block_size"]
    step = state["step"].item()  # a CPU tensor, as in torch's non-capturable AdamW: no device sync
    grad = grad.float()
    if group["maximize"]:
        grad = -grad
    master = param if param.dtype == torch.float32 else param.float()
    master.mul_(1 - lr * group["weight_decay"])
    quantized = codes_key("exp_avg") in state
    if quantized:
        exp_avg, exp_avg_sq = (blockwise.dequantize(_local(state[codes_key(m)]), _local(state[scales_key(m)]), signed)
                               for m, signed in MOMENTS.items())
    else:
        exp_avg, exp_avg_sq = (_local(state[m]) for m in MOMENTS)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    if master is not param:
        param.copy_(master)
    if quantized:
        for (moment, signed), values in zip(MOMENTS.items(), (exp_avg, exp_avg_sq)):
            codes, scales = blockwise.quantize(values, block_size, signed)
            _local(state[codes_key(moment)]).copy_(codes)
            _local(state[scales_key(moment)]).copy_(scales)
