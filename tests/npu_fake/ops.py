"""CPU implementations of the torch_npu fused ops, following torch_npu 2.13.0's documented semantics.

Sources: ``torch_npu/_op_plugin_docs.py`` (semantics and constraints) and
``torch_npu/op_plugin/meta/_meta_registrations.py`` (output shapes and dtypes) in the torch-npu 2.13.0 wheel.
Each op computes in fp32 and returns the documented dtype, with autograd through plain torch ops, so
forward and backward of code that calls them can be checked on CPU. Inputs the documentation rules out
raise (``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape or value); documented
features these fakes do not model raise ``NotImplementedError`` instead of computing something else.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.uint8)
_COMPRESSED = 2048
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


# ---------------------------------------------------------------- npu_fusion_attention


def npu_fusion_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    head_num: int,
    input_layout: str,
    pse: Optional[Tensor] = None,
    padding_mask: Optional[Tensor] = None,
    atten_mask: Optional[Tensor] = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Optional[Tensor] = None,
    dropout_mask: Optional[Tensor] = None,
    seed: int = 0,
    offset: int = 0,
    *,
    release: Optional[str] = None,
    cann: Optional[str] = None,
):
    """softmax(mask(scale * q k^T)) with dropout(keep_prob), times v; returns the documented 7-tuple.

    ``release`` (bound by the fake, FakeTorchNPU) selects the release's varlen rules (see _VARLEN_RULES); ``cann``
    (the fake's CANN version, None: a current one) whether Dv < Dk is taken (_check_value_head_dim).
    """
    if input_layout not in _LAYOUTS:
        raise ValueError(f"input_layout={input_layout!r} is not one of {_LAYOUTS}")
    varlen = input_layout == "TND"
    if padding_mask is not None:
        raise ValueError("padding_mask is documented as not supported by npu_fusion_attention ('暂不支持该传参')")
    unmodelled = [("pse", pse), ("prefix", prefix), ("sink", sink), ("dropout_mask", dropout_mask)]
    if not varlen:
        unmodelled += [("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)]
    for name, val in unmodelled:
        if val is not None:
            raise NotImplementedError(f"the fake does not model npu_fusion_attention's {name} argument")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"npu_fusion_attention supports float16/bfloat16/float32, got {query.dtype}")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")

    q, k, v = _inputs_to_bnsd(query, key, value, head_num, input_layout)
    b, nq, sq, d = q.shape
    bk, nkv, skv, dk = k.shape
    if q.shape[1] != head_num:
        raise ValueError(f"head_num={head_num} but query has {q.shape[1]} heads in layout {input_layout}")
    if b != bk or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {b}, key {bk}, value {v.shape[0]}")
    if k.shape[:3] != v.shape[:3] or v.shape[3] > dk:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match (Dv <= Dk)")
    if d != dk or not 1 <= d <= 768:
        raise ValueError(f"head dims must satisfy Dq == Dk in 1..768; got Dq={d}, Dk={dk}")
    _check_value_head_dim(dk, v.shape[3], cann)
    if not 1 <= nq <= 256 or nq % nkv != 0:
        raise ValueError(f"query heads ({nq}) must be in 1..256 and a multiple of key/value heads ({nkv})")

    if varlen:
        q_ends = _varlen_ends("actual_seq_qlen", actual_seq_qlen, sq, release)
        kv_ends = _varlen_ends("actual_seq_kvlen", actual_seq_kvlen, skv, release)
        if len(q_ends) != len(kv_ends):
            raise ValueError(
                f"actual_seq_qlen has {len(q_ends)} samples but actual_seq_kvlen {len(kv_ends)}:"
                " the batch sizes must be equal"
            )
        masked = _varlen_masked_positions(atten_mask, sparse_mode, q_ends, kv_ends, release)
        q_lens, kv_lens = _lengths(q_ends), _lengths(kv_ends)
        auto_invalid_rows = sparse_mode == 3 and any(a > b for a, b in zip(q_lens, kv_lens))
    else:
        masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, b, nq, sq, skv, q.device)
        auto_invalid_rows = sparse_mode == 3 and sq > skv
    dead_rows = None
    if masked is not None:
        dead_rows = masked.all(dim=-1, keepdim=True)
        # Documented: fully masked rows need inner_precise=2, which the op enables itself for sparse_mode 3, Sq > Skv.
        if bool(dead_rows.any()) and inner_precise != 2 and not auto_invalid_rows:
            raise ValueError("atten_mask masks out whole query rows; npu_fusion_attention needs inner_precise=2 for that")

    group = nq // nkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if masked is not None:
        # A dead row would be all -inf (NaN after softmax): give it finite scores and zero its output instead.
        scores = scores.masked_fill(masked & ~dead_rows, float("-inf")).masked_fill(dead_rows, 0.0)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_sum = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if dead_rows is not None:
        probs = probs.masked_fill(dead_rows, 0.0)
    numels = 0
    if keep_prob < 1.0:
        keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * keep / keep_prob
        numels = probs.numel()
    out = torch.matmul(probs, vf).to(query.dtype)

    # _meta_registrations.py: [B, N, Sq, 8], and [T, N, 8] for TND.
    stats_shape = (sq, nq, 8) if varlen else (b, nq, sq, 8)
    softmax_max = _softmax_stat(row_max, varlen).expand(stats_shape).contiguous()
    softmax_sum = _softmax_stat(row_sum, varlen).expand(stats_shape).contiguous()
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_out, 0, 0, numels


#: The first CANN release documented to take Dv < Dk (MindSpeed-LLM's --mla-fa-without-pad needs CANN >= 8.2.RC1;
#: older releases "may reject" it: the fake rejects it, so code must pad there).
_UNPADDED_DV_CANN = (8, 2)


def _check_value_head_dim(dk: int, dv: int, cann: Optional[str]) -> None:
    if dv == dk or cann is None:
        return
    match = re.match(r"(\d+)\.(\d+)", cann)
    if match is None or (int(match.group(1)), int(match.group(2))) < _UNPADDED_DV_CANN:
        raise ValueError(
            f"value head dim {dv} < query/key head dim {dk}: this fake's CANN {cann} (< 8.2.RC1) takes Dv == Dk only"
        )


def _inputs_to_bnsd(query: Tensor, key: Tensor, value: Tensor, head_num: int, layout: str):
    """Return q, k, v as [B, N, S, D]. For BSH/SBH, D = H_q / head_num and key/value heads = H_kv / D."""
    tensors = (("query", query), ("key", key), ("value", value))
    if layout == "TND":
        for name, t in tensors:
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D [T, N, D] for layout TND, got shape {tuple(t.shape)}")
        # All packed samples as one batch row; _varlen_masked_positions keeps them apart.
        return [t.transpose(0, 1)[None] for _, t in tensors]
    if layout in ("BSND", "BNSD"):
        for name, t in tensors:
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D for layout {layout}, got shape {tuple(t.shape)}")
        return [t.transpose(1, 2) if layout == "BSND" else t for _, t in tensors]
    for name, t in tensors:
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D for layout {layout}, got shape {tuple(t.shape)}")
    if query.shape[-1] % head_num != 0:
        raise ValueError(f"query hidden size {query.shape[-1]} is not divisible by head_num={head_num}")
    d = query.shape[-1] // head_num
    out = []
    for name, t in tensors:
        t = t.transpose(0, 1) if layout == "SBH" else t
        if t.shape[-1] % d != 0:
            raise ValueError(f"{name} hidden size {t.shape[-1]} is not a multiple of the head dim {d}")
        out.append(t.reshape(t.shape[0], t.shape[1], t.shape[-1] // d, d).transpose(1, 2))
    return out


def _masked_positions(mask, sparse_mode, pre, nxt, b, n, sq, skv, device) -> Optional[Tensor]:
    """Bool [B|1, N|1, Sq, Skv], True where a score is masked out; None for full attention."""
    if mask is None:
        return None  # documented: without atten_mask, sparse_mode and the tockens have no effect
    if mask.dtype not in _MASK_DTYPES:
        raise TypeError(f"atten_mask must be bool or uint8, got {mask.dtype}")
    mask = mask.bool()
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(skv, device=device)[None, :]
    if sparse_mode in (0, 1):
        allowed = {(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
        if tuple(mask.shape) not in allowed:
            raise ValueError(f"atten_mask shape {tuple(mask.shape)} is not BNSS/B1SS/11SS/SS for B={b} N={n} Sq={sq} Skv={skv}")
        full = mask.reshape((1, 1, sq, skv) if mask.dim() == 2 else mask.shape)
        if sparse_mode == 0 and (pre != 2147483647 or nxt != 2147483647):
            # Band from the top-left corner: keep keys j with -pre_tockens <= j - i <= next_tockens.
            full = full | (cols - rows > nxt) | (rows - cols > pre)
        return full
    if sparse_mode in (2, 3):
        _check_compressed_mask(mask, sparse_mode)
        shift = 0 if sparse_mode == 2 else skv - sq  # 2: left-up causal, 3: right-down causal
        return (cols > rows + shift)[None, None]
    raise NotImplementedError(f"the fake does not model sparse_mode={sparse_mode}")


def _check_compressed_mask(mask: Tensor, sparse_mode: int) -> None:
    expected = torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=mask.device), diagonal=1)
    if tuple(mask.shape) != (_COMPRESSED, _COMPRESSED) or not torch.equal(mask, expected):
        raise ValueError(
            f"sparse_mode={sparse_mode} needs the compressed mask torch.triu(torch.ones(2048, 2048, dtype=torch.bool), "
            f"diagonal=1); got a mask of shape {tuple(mask.shape)} that is not it"
        )


def npu_fusion_attention_grad(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dy: Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: Optional[Tensor] = None,
    padding_mask: Optional[Tensor] = None,
    atten_mask: Optional[Tensor] = None,
    softmax_max: Optional[Tensor] = None,
    softmax_sum: Optional[Tensor] = None,
    softmax_in: Optional[Tensor] = None,
    attention_in: Optional[Tensor] = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: Optional[Tensor] = None,
    release: Optional[str] = None,
    cann: Optional[str] = None,
):
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention from the forward's statistics, flash-attention style.

    The softmax is rebuilt from ``softmax_max`` / ``softmax_sum`` (the forward's [B, N, Sq, 8] fp32 outputs, or
    statistics merged over several blocks, as ring attention passes them): P = exp(scale * q k^T - max) / sum, and
    ``attention_in`` is the output those statistics belong to (dS = P * (dP - rowsum(dy * attention_in))). Output
    dtypes and shapes follow _meta_registrations.py (dq/dk/dv in query's dtype and the inputs' shapes; dpse None,
    dsink an empty tensor without sink; 2.6.0's schema has no sink and returns (dq, dk, dv, dpse)). Modelled: BSND
    and BNSD without dropout, pse or sink.
    """
    if input_layout not in ("BSND", "BNSD"):
        raise NotImplementedError(f"the fake models npu_fusion_attention_grad in BSND/BNSD only, not {input_layout!r}")
    if padding_mask is not None:
        raise ValueError("padding_mask is documented as not supported by npu_fusion_attention ('暂不支持该传参')")
    for name, val in (("pse", pse), ("prefix", prefix), ("sink", sink), ("softmax_in", softmax_in),
                      ("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
        if val is not None:
            raise NotImplementedError(f"the fake does not model npu_fusion_attention_grad's {name} argument")
    if keep_prob != 1.0:
        raise NotImplementedError("the fake does not model npu_fusion_attention_grad with dropout (keep_prob < 1)")
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise NotImplementedError(
            "the fake models npu_fusion_attention_grad from the forward's softmax_max, softmax_sum and attention_in only"
        )
    if not (query.dtype == key.dtype == value.dtype == dy.dtype == attention_in.dtype):
        raise TypeError(
            f"query, key, value, dy and attention_in must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype},"
            f" {dy.dtype}, {attention_in.dtype}"
        )
    q, k, v = _inputs_to_bnsd(query, key, value, head_num, input_layout)
    do, o, _ = _inputs_to_bnsd(dy, attention_in, attention_in, head_num, input_layout)
    b, nq, sq, d = q.shape
    nkv, skv = k.shape[1], k.shape[2]
    if nq != head_num or nq % nkv != 0:
        raise ValueError(f"head_num={head_num}: query has {nq} heads, key/value {nkv}; query heads must be a multiple")
    if d != k.shape[3] or k.shape[:3] != v.shape[:3] or v.shape[3] > d:
        raise ValueError(f"head dims must satisfy Dq == Dk >= Dv; got query {tuple(query.shape)}, key"
                         f" {tuple(key.shape)}, value {tuple(value.shape)}")
    _check_value_head_dim(d, v.shape[3], cann)
    out_shape = (b, nq, sq, v.shape[3])  # the forward's output: query's rows, value's head dim
    if tuple(do.shape) != out_shape or tuple(o.shape) != out_shape:
        raise ValueError(f"dy {tuple(dy.shape)} and attention_in {tuple(attention_in.shape)} must have the forward"
                         f" output's shape (query's, with value's head dim)")
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if stat.dtype != torch.float32 or tuple(stat.shape) != (b, nq, sq, 8):
            raise ValueError(
                f"{name} must be the forward's float32 [B, N, Sq, 8] = {[b, nq, sq, 8]}; got {stat.dtype} {tuple(stat.shape)}"
            )
    masked = _masked_positions(atten_mask, sparse_mode, pre_tockens, next_tockens, b, nq, sq, skv, q.device)
    group = nq // nkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    qf, dof, of = q.float(), do.float(), o.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale_value
    probs = torch.exp(scores - softmax_max[..., :1]) / softmax_sum[..., :1]
    if masked is not None:
        probs = probs.masked_fill(masked, 0.0)
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = probs * (dp - (dof * of).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale_value
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale_value

    def per_kv_head(grad: Tensor) -> Tensor:  # the query heads of one group share a key/value head
        return grad.reshape(b, nkv, group, skv, grad.shape[-1]).sum(dim=2)

    def laid_out(grad: Tensor, like: Tensor) -> Tensor:
        return (grad.transpose(1, 2) if input_layout == "BSND" else grad).to(query.dtype).reshape(like.shape)

    grads = (laid_out(dq, query), laid_out(per_kv_head(dk), key), laid_out(per_kv_head(dv), value), None)
    return grads if release == "2.6.0" else (*grads, torch.empty(0, device=query.device))


# ---------------------------------------------------------------- npu_fusion_attention, varlen (TND)
# Lines cited are torch_npu/_op_plugin_docs.py of the 2.13.0 wheel (2.14.0: the same lines, byte-identical text);
# "2.6.0:" cites that wheel's file. All three document TND with actual_seq_qlen / actual_seq_kvlen (1607; 2.6.0: 1217).


@dataclasses.dataclass(frozen=True)
class _VarlenRules:
    #: A sample of length 0 ("支持actual_seq_qlen中某个Batch上的S长度为0", 1694); 2.6.0 documents S in 1..1M only (1290).
    empty_samples: bool
    #: How many samples: "varlen场景下长度最大支持1K" (1694); 2.6.0: "varlen场景B取值范围1~2K" (1284).
    max_samples: int


_VARLEN_RULES = {
    "2.6.0": _VarlenRules(empty_samples=False, max_samples=2048),
    "2.13.0": _VarlenRules(empty_samples=True, max_samples=1024),
    "2.14.0": _VarlenRules(empty_samples=True, max_samples=1024),
}
_VARLEN_MAX_TOKENS = 1024 * 1024  # "varlen场景下: 要求T(B*S)取值范围1~1M" (1684; 2.6.0: 1292)


def _varlen_rules(release: Optional[str]) -> _VarlenRules:
    if release is None:
        raise ValueError("varlen rules differ per release: call npu_fusion_attention through install_fake_torch_npu")
    if release not in _VARLEN_RULES:
        raise NotImplementedError(
            f"the fake has not read torch_npu {release}'s varlen (TND) rules; add them to _VARLEN_RULES"
        )
    return _VARLEN_RULES[release]


def _varlen_ends(name: str, ends, total: int, release: Optional[str]) -> list[int]:
    """``ends`` checked as the documented cumulative sample ends over ``total`` tokens (1619-1622).

    "比如真正的S长度列表为: 2 2 2 2 2, 则actual_seq_qlen传: 2 4 6 8 10": the running sum of the lengths, without the
    0 that starts a cu_seqlens tensor, so the last entry is the token count T of the TND tensor.
    """
    rules = _varlen_rules(release)
    if ends is None:
        raise ValueError(f"input_layout='TND' needs {name} ('TND(actual_seq_qlen/actual_seq_kvlen需传值)', 1607)")
    if not isinstance(ends, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
        raise TypeError(f"{name} must be a host list of ints (int[]), got {type(ends).__name__}")
    ends = list(ends)
    if not 1 <= total <= _VARLEN_MAX_TOKENS:
        raise ValueError(f"TND needs T in 1..{_VARLEN_MAX_TOKENS} tokens (1684), got T={total}")
    if not 1 <= len(ends) <= rules.max_samples:
        raise ValueError(f"{name} holds {len(ends)} samples; torch_npu {release} takes 1..{rules.max_samples} in TND")
    if rules.empty_samples and len(ends) > 1 and ends[-1] == 0:
        raise NotImplementedError(f"{name}={ends}: the fake does not model trailing samples left out by 0 ends (1695)")
    previous = 0
    for i, end in enumerate(ends):
        if end < previous or (end == previous and not rules.empty_samples):
            start = " (a leading 0 is cu_seqlens' start, not a sample's end)" if i == 0 and end == 0 else ""
            kind = "non-decreasing" if rules.empty_samples else "strictly increasing (no empty sample)"
            raise ValueError(
                f"{name}={ends} is not {kind} at entry {i}{start}: torch_npu {release} takes each sample's cumulative "
                f"end, without a leading 0 (lengths 2 2 2 -> [2, 4, 6], 1620)"
            )
        previous = end
    if ends[-1] != total:
        raise ValueError(
            f"{name}={ends} ends at {ends[-1]}, but the TND tensor holds T={total} tokens: the last end must be T"
        )
    return ends


def _lengths(ends: list[int]) -> list[int]:
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def _varlen_masked_positions(
    mask, sparse_mode: int, q_ends: list[int], kv_ends: list[int], release: Optional[str]
) -> Tensor:
    """Bool [1, 1, Tq, Tkv], True where a score is masked out: always across samples, and within a sample as
    ``sparse_mode`` says (0 without a mask: full attention; 2: left-up causal; 3: right-down causal)."""
    if sparse_mode == 5:
        raise ValueError(
            "sparse_mode=5 (prefix, uncompressed) is not supported with varlen TND ('varlen场景不支持', 1632, 1693)"
        )
    if sparse_mode not in range(9):
        raise ValueError(f"sparse_mode must be one of 0..8, got {sparse_mode}")
    q_lens, kv_lens = _lengths(q_ends), _lengths(kv_ends)
    if mask is None:
        if sparse_mode != 0:
            # The op itself would run full attention ("当atten_mask输入为None时, sparse_mode...不生效,
            # 固定为全计算"), which the docs call a wrong result for modes 1..8 ("应传入对应正确的atten_mask,
            # 否则将导致计算结果错误", 1689).
            raise ValueError(
                f"sparse_mode={sparse_mode} without atten_mask: torch_npu ignores the mode and computes full attention"
                " (1689); pass the mask the mode takes (2, 3: torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))"
            )
        causal = None
    else:
        if mask.dtype not in _MASK_DTYPES:
            raise TypeError(f"atten_mask must be bool or uint8, got {mask.dtype}")
        mask = mask.bool()
        if sparse_mode in (0, 1):
            ss = (max(q_lens), max(kv_lens))
            if tuple(mask.shape) != ss:
                raise ValueError(
                    f"varlen takes an SS atten_mask of [maxSq, maxSkv] = {list(ss)} only (1610), got {tuple(mask.shape)}"
                )
            if _varlen_rules(release).empty_samples and bool(mask.all(dim=-1).any()):
                raise ValueError("varlen atten_mask must not mask a whole row ('不能存在某一行全1', 1685)")
            raise NotImplementedError("the fake does not model how a varlen SS atten_mask applies to each sample")
        if sparse_mode not in (2, 3):
            raise NotImplementedError(f"the fake does not model sparse_mode={sparse_mode} with varlen TND")
        _check_compressed_mask(mask, sparse_mode)
        causal = sparse_mode
    q_sample, q_pos = _sample_and_position(q_lens)
    kv_sample, kv_pos = _sample_and_position(kv_lens)
    masked = q_sample[:, None] != kv_sample[None, :]
    if causal is not None:
        # 2: left-up causal (key j <= query i); 3: right-down, shifted by each sample's Skv - Sq.
        shift = torch.tensor(kv_lens) - torch.tensor(q_lens)
        if causal == 2:
            shift = torch.zeros_like(shift)
        masked = masked | (kv_pos[None, :] > q_pos[:, None] + shift[q_sample][:, None])
    return masked[None, None]


def _sample_and_position(lengths: list[int]) -> tuple[Tensor, Tensor]:
    """For each packed token: its sample's index, and its position inside that sample."""
    lens = torch.tensor(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    starts = torch.cumsum(lens, 0) - lens
    return sample, torch.arange(int(lens.sum())) - starts[sample]


def _softmax_stat(stat: Tensor, varlen: bool) -> Tensor:
    """A [B, N, S, 1] softmax statistic, as [B, N, S, 1] or (TND, B == 1) [T, N, 1]."""
    stat = stat.detach()
    return stat[0].transpose(0, 1) if varlen else stat


def _from_bnsd(out: Tensor, layout: str) -> Tensor:
    if layout == "TND":
        return out[0].transpose(0, 1)
    if layout == "BNSD":
        return out
    if layout == "BSND":
        return out.transpose(1, 2)
    bsh = out.transpose(1, 2).flatten(2)
    return bsh.transpose(0, 1) if layout == "SBH" else bsh


# ---------------------------------------------------------------- npu_rms_norm

def npu_rms_norm(input: Tensor, gamma: Tensor, epsilon: float = 1e-06):
    """(y, rstd): y = x * rstd * gamma over gamma's trailing dims, rstd = 1/sqrt(mean(x^2) + eps) in fp32.

    Documented: x is float16/bfloat16/float32 with 2-8 dims, and gamma's dtype must equal x's
    ("数据类型需要和self保持一致", 2.6.0 .. 2.14.0 wheels). An older op-plugin page listed (bf16, fp32) pairs;
    the wheel's own documentation does not, so the fake refuses them.
    """
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"npu_rms_norm supports float16/bfloat16/float32 input, got {input.dtype}")
    if gamma.dtype != input.dtype:
        raise TypeError(f"npu_rms_norm needs gamma's dtype to equal x's; got x {input.dtype}, gamma {gamma.dtype}")
    if not 2 <= input.dim() <= 8:
        raise ValueError(f"npu_rms_norm supports 2-8 dimensional input, got shape {tuple(input.shape)}")
    if gamma.dim() == 0 or tuple(input.shape[-gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(input.shape)}")
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x * rstd * gamma.float()).to(input.dtype)
    return y, rstd


# ---------------------------------------------------------------- npu_rotary_mul


def npu_rotary_mul(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half", rotate: Optional[Tensor] = None):
    """r1 * x + r2 * rot(x); half: rot = cat(-x2, x1) of the halves, interleave: pairs (x[2i], x[2i+1])."""
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if input.dim() != 4:
        raise ValueError(f"npu_rotary_mul needs a 4-D input (BNSD/BSND/SBND), got shape {tuple(input.shape)}")
    d = input.shape[-1]
    if d % 2 != 0 or d >= 896:
        raise ValueError(f"head dim must be even and < 896, got {d}")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16/bfloat16/float32, got {t.dtype}")
    if r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise TypeError(f"r1/r2 dtypes ({r1.dtype}, {r2.dtype}) must match input's {input.dtype}")
    if r1.shape != r2.shape:
        raise ValueError(f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have the same shape")
    a, b, c, _ = input.shape
    if rotary_mode == "half":
        # BNSD: 11SD/B1SD/BNSD; BSND: 1S1D/BS1D/BSND; SBND: S11D/SB1D/SBND.
        allowed = {(1, 1, c, d), (a, 1, c, d), (1, b, 1, d), (a, b, 1, d), (a, 1, 1, d), (a, b, c, d)}
    else:
        allowed = {(1, 1, c, d), (1, b, 1, d), (a, 1, 1, d)}
    if tuple(r1.shape) not in allowed:
        raise ValueError(
            f"r1/r2 shape {tuple(r1.shape)} is not a documented broadcast shape for input {tuple(input.shape)} "
            f"in {rotary_mode} mode (e.g. 1S1D for BSND, 11SD for BNSD)"
        )
    if bool((r1.detach().abs() > 1).any()) or bool((r2.detach().abs() > 1).any()):
        raise ValueError("r1/r2 values must lie in [-1, 1] (documented data range: they are cos/sin tables)")
    _check_rotary_batch_and_heads(tuple(input.shape), tuple(r1.shape), rotary_mode)
    x = input.float()
    if rotate is not None:
        if tuple(rotate.shape) != (d, d):
            raise ValueError(f"rotate must be [{d}, {d}], got {tuple(rotate.shape)}")
        rotated = x @ rotate.float()
    elif rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    out = (r1.float() * x + r2.float() * rotated).to(input.dtype)
    if out.requires_grad:
        broadcast = math.prod(n for n, m in zip(input.shape, r1.shape) if n != m)
        out.register_hook(functools.partial(_rotary_backward_check, broadcast))
    return out


# Documented limits (jit_compile=False): half mode B, N < 1000; interleave B * N < 1000; and "当需要计算cos/sin的反向
# 梯度时，B*N <= 1024". npu_rotary_mul_backward returns (dx, dr1, dr2) whatever needs a gradient, so every backward
# computes the cos/sin gradients: the product of the axes r1 broadcasts over must be <= 1024.
_ROTARY_MAX_BATCH_OR_HEADS = 999
_ROTARY_MAX_INTERLEAVE_BN = 999
_ROTARY_MAX_BACKWARD_BROADCAST = 1024


def _rotary_layouts(x_shape: tuple, r_shape: tuple) -> list[tuple[int, int]]:
    """(B, N) under every layout (BNSD, BSND, SBND) whose documented r1 shapes include ``r_shape``."""
    a, b, c, d = x_shape
    layouts = {
        (a, b): {(1, 1, c, d), (a, 1, c, d), (a, b, c, d)},  # BNSD: 11SD, B1SD, BNSD
        (a, c): {(1, b, 1, d), (a, b, 1, d), (a, b, c, d)},  # BSND: 1S1D, BS1D, BSND
        (b, c): {(a, 1, 1, d), (a, b, 1, d), (a, b, c, d)},  # SBND: S11D, SB1D, SBND
    }
    return [bn for bn, shapes in layouts.items() if r_shape in shapes]


def _check_rotary_batch_and_heads(x_shape: tuple, r_shape: tuple, mode: str) -> None:
    # Where the shapes fit several layouts, every reading must satisfy the limits (the fake is strict).
    for batch, heads in _rotary_layouts(x_shape, r_shape):
        if mode == "half" and max(batch, heads) > _ROTARY_MAX_BATCH_OR_HEADS:
            raise ValueError(f"npu_rotary_mul (half) needs B, N < 1000; input {x_shape} has B={batch}, N={heads}")
        if mode == "interleave" and batch * heads > _ROTARY_MAX_INTERLEAVE_BN:
            raise ValueError(f"npu_rotary_mul (interleave) needs B * N < 1000; input {x_shape} has B * N = {batch * heads}")


def _rotary_backward_check(broadcast: int, grad: Tensor) -> Tensor:
    if broadcast > _ROTARY_MAX_BACKWARD_BROADCAST:
        raise RuntimeError(
            f"npu_rotary_mul_backward: the cos/sin gradients need B * N <= {_ROTARY_MAX_BACKWARD_BROADCAST}"
            f" (the broadcast axes), got {broadcast}"
        )
    return grad


# ---------------------------------------------------------------- npu_swiglu


def npu_swiglu(input: Tensor, dim: int = -1) -> Tensor:
    """A * sigmoid(A) * B with (A, B) = chunk(x, 2, dim)."""
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"npu_swiglu supports float32/float16/bfloat16, got {input.dtype}")
    if not 1 <= input.dim() <= 8:
        raise ValueError(f"npu_swiglu supports 1-8 dims, got shape {tuple(input.shape)}")
    if input.shape[dim] % 2 != 0:
        raise ValueError(f"dim {dim} of shape {tuple(input.shape)} has odd size; it must split into two halves")
    if not input.is_contiguous():
        raise ValueError("npu_swiglu needs a contiguous input")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# ---------------------------------------------------------------- npu_grouped_matmul (the MoE form)
# Sources: _op_plugin_docs.py and the op schemas of the 2.6.0, 2.13.0 and 2.14.0 wheels, summarised in
# shared/docs/moe-facts.md section 1. The wheel registers no autograd node for this op (the fake returns its output
# without a grad_fn, see fake.py), so training code must wrap its forward, dX and dW calls in an autograd Function.

#: The group_type values each release takes: -1 (no grouping), 0 (split the M axis of x), 2 (split the K axis, which
#: gives the weight gradient (E, K, N)); torch_npu 2.6.0's library rejects 2.
_GMM_GROUP_TYPES = {"2.6.0": (-1, 0), "2.13.0": (-1, 0, 2), "2.14.0": (-1, 0, 2)}
_GMM_MAX_GROUPS = 1024  # with a 3-D weight
_GMM_MAX_INNER = 65535  # "inner dims < 65536"


def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, release: Optional[str] = None, **unmodelled):
    """One matmul per group of rows: ``x=[X (M, K)]``, ``weight=[W (E, K, N)]``, ``group_type=0`` gives (M, N) with
    rows of group e times W[e]; ``x=[X.t() (K, M)]``, ``weight=[dY (M, N)]``, ``group_type=2``, ``split_item=3`` gives
    (E, K, N) with ``X_e^T dY_e`` (zeros for an empty group). ``group_list`` is an int64 tensor of cumulative ends
    (``group_list_type=0``, the last == M) or of counts (``group_list_type=1``, summing to M, never of length 1).
    Returns a one-element list (split_item 2 and 3)."""
    if output_dtype is not None:
        raise ValueError(
            "output_dtype is ScalarType? in torch_npu 2.6.0 and int? from 2.13.0, so no value means the same in every"
            " release: do not pass it (the output takes x's dtype)"
        )
    for name, value in unmodelled.items():
        if value is not None:
            raise NotImplementedError(f"the fake models npu_grouped_matmul's MoE form only, not its {name} argument")
    if act_type != 0:
        raise NotImplementedError(f"the fake does not model npu_grouped_matmul's act_type={act_type}")
    if release not in _GMM_GROUP_TYPES:
        raise NotImplementedError(f"the fake has not read torch_npu {release}'s npu_grouped_matmul rules")
    if len(x) != 1 or len(weight) != 1:
        raise NotImplementedError(
            f"the fake models the MoE form x=[X], weight=[W] only, not {len(x)} x and {len(weight)} weight tensors")
    if group_list is None:
        raise NotImplementedError("the fake does not model npu_grouped_matmul without a group_list")
    if group_list.dtype != torch.int64:
        raise TypeError(
            f"npu_grouped_matmul needs an int64 group_list, got {group_list.dtype}; pass counts.to(torch.int64)"
            " (torch._grouped_mm's int32 offsets are not accepted)")
    if group_list.dim() != 1:
        raise ValueError(f"group_list must be 1-D, got shape {tuple(group_list.shape)}")
    if group_list_type not in (0, 1):
        raise ValueError(f"group_list_type must be 0 (cumulative ends) or 1 (counts), got {group_list_type}")
    if group_list_type == 1 and group_list.numel() == 1:
        raise ValueError(
            "group_list_type=1 (counts) rejects a group_list of length 1 ('length cannot be 1'); for one group pass"
            " its cumulative end with group_list_type=0")
    if split_item not in (2, 3):
        raise NotImplementedError(f"the fake models split_item 2 and 3 (one output tensor), not {split_item}")
    if group_type not in _GMM_GROUP_TYPES[release]:
        raise ValueError(
            f"torch_npu {release}'s npu_grouped_matmul takes group_type in {_GMM_GROUP_TYPES[release]}, got"
            f" {group_type}" + ("; the weight-gradient form (group_type=2) needs torch_npu >= 2.13" if group_type == 2 else ""))
    if group_type == -1:
        raise NotImplementedError("the fake does not model group_type=-1 (no grouping)")
    a, b = x[0], weight[0]
    if a.dtype not in _FLOAT_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"x and weight must share one of float16/bfloat16/float32; got {a.dtype} and {b.dtype}")
    if group_list.numel() > _GMM_MAX_GROUPS:
        raise ValueError(f"npu_grouped_matmul takes at most {_GMM_MAX_GROUPS} groups, got {group_list.numel()}")
    if group_type == 0:
        if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1] or b.shape[0] != group_list.numel():
            raise ValueError(
                f"group_type=0 needs x (M, K), weight (E, K, N) and E = len(group_list); got x {tuple(a.shape)},"
                f" weight {tuple(b.shape)}, {group_list.numel()} groups")
        if not a.is_contiguous():
            raise ValueError("x must be contiguous with group_type=0 (only the weight may be a transposed view)")
        rows, inner = a.shape[0], (a.shape[1], b.shape[2])
    else:
        if split_item != 3 or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(
                f"group_type=2 (the weight gradient) needs split_item=3, x [X.t() (K, M)] and weight [dY (M, N)];"
                f" got split_item={split_item}, x {tuple(a.shape)}, weight {tuple(b.shape)}")
        rows, inner = a.shape[1], (a.shape[0], b.shape[1])
    if max(inner) > _GMM_MAX_INNER:
        raise ValueError(f"npu_grouped_matmul needs K and N < 65536, got {inner}")
    sizes = _group_sizes(group_list, group_list_type, rows)
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    if group_type == 0:
        out = torch.cat([a[s:s + n].float() @ b[e].float() for e, (s, n) in enumerate(zip(starts, sizes))])
    else:
        out = torch.stack([a[:, s:s + n].float() @ b[s:s + n].float() for s, n in zip(starts, sizes)])
    return [out.to(a.dtype)]


def _group_sizes(group_list: Tensor, group_list_type: int, rows: int) -> list[int]:
    values = group_list.tolist()
    if group_list_type == 0:
        if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:])) or values[-1] != rows:
            raise ValueError(
                f"group_list={values} (group_list_type=0) must be non-decreasing cumulative ends whose last is the"
                f" {rows} grouped rows")
        return [end - start for start, end in zip([0, *values[:-1]], values)]
    if any(v < 0 for v in values) or sum(values) != rows:
        raise ValueError(f"group_list={values} (group_list_type=1) must be counts >= 0 summing to the {rows} grouped rows")
    return values


# ---------------------------------------------------------------- npu_moe_token_permute / npu_moe_token_unpermute
# The later (effective) docstrings of _op_plugin_docs.py in 2.13.0 / 2.14.0: fp16/bf16/fp32 tokens, int32/int64 ids,
# topK <= 512, and sorted_indices[i] = the row of permuted_tokens that holds tokens[i // topK], stable by expert
# (CANN's aclnnMoeTokenPermute): the inverse of the argsort that torchtitan's and Megatron's reference permute keep.
# Autograd nodes exist from 2.13 only (fake.py strips gradients where the wheel registers none).

_PERMUTE_MAX_TOPK = 512
_PERMUTE_MAX_INDEX = 16777215  # numel and values below this: ids are sorted as floats


def npu_moe_token_permute(tokens: Tensor, indices: Tensor, num_out_tokens: Optional[int] = None,
                          padded_mode: bool = False):
    """(permuted_tokens, sorted_indices): every (token, k) pair's row, sorted stably by expert id; int32
    ``sorted_indices`` with ``permuted[sorted_indices[i]] = tokens[i // topK]``."""
    if padded_mode:
        raise ValueError("npu_moe_token_permute supports padded_mode=False only ('当前仅支持False')")
    if tokens.dim() != 2 or tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"tokens must be a 2-D float16/bfloat16/float32 tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2):
        raise TypeError(f"indices must be a 1-D or 2-D int32/int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    if indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"indices {tuple(indices.shape)} must have one row per token ({tokens.shape[0]})")
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    if top_k > _PERMUTE_MAX_TOPK:
        raise ValueError(f"npu_moe_token_permute takes topK <= {_PERMUTE_MAX_TOPK}, got {top_k}")
    flat = indices.reshape(-1)
    if flat.numel() >= _PERMUTE_MAX_INDEX or bool((flat < 0).any()) or bool((flat >= _PERMUTE_MAX_INDEX).any()):
        raise ValueError(f"indices must have fewer than {_PERMUTE_MAX_INDEX} elements, each in [0, {_PERMUTE_MAX_INDEX})")
    order = torch.argsort(flat, stable=True)
    sorted_indices = torch.argsort(order).to(torch.int32)
    permuted = tokens[order // top_k]
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]  # > 0: the first n rows; < 0: a negative slice end, as documented
    return permuted, sorted_indices


def npu_moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Optional[Tensor] = None,
                            padded_mode: bool = False, restore_shape=None) -> Tensor:
    """``out[i] = sum_k probs[i, k] * permuted_tokens[sorted_indices[i * topK + k]]`` (topK = probs.size(1), or 1),
    in permuted_tokens' dtype."""
    if padded_mode or restore_shape is not None:
        raise ValueError("npu_moe_token_unpermute supports padded_mode=False and restore_shape=None only")
    if permuted_tokens.dim() != 2 or permuted_tokens.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"permuted_tokens must be a 2-D float16/bfloat16/float32 tensor, got {permuted_tokens.dtype}")
    if sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1:
        raise TypeError(f"sorted_indices must be the 1-D int32 tensor npu_moe_token_permute returns, got {sorted_indices.dtype}")
    top_k = 1 if probs is None else probs.shape[-1]
    if probs is not None:
        if probs.dim() != 2 or probs.numel() != sorted_indices.numel():
            raise ValueError(f"probs {tuple(probs.shape)} must be (tokens, topK) with tokens * topK = {sorted_indices.numel()}")
        if probs.dtype != permuted_tokens.dtype:
            raise TypeError(
                f"probs ({probs.dtype}) must be in permuted_tokens' dtype ({permuted_tokens.dtype}): mixed dtypes make"
                " MoeTokenUnpermuteGrad return NaN (torchtitan-npu); cast probs with .to(tokens.dtype)")
    if top_k > _PERMUTE_MAX_TOPK:
        raise ValueError(f"npu_moe_token_unpermute takes topK <= {_PERMUTE_MAX_TOPK}, got {top_k}")
    n = sorted_indices.numel()
    index = sorted_indices.long()
    if bool((index < 0).any()) or bool((index >= permuted_tokens.shape[0]).any()) or index.unique().numel() != n:
        raise ValueError(f"sorted_indices must be distinct rows of permuted_tokens (0 .. {permuted_tokens.shape[0] - 1})")
    rows = permuted_tokens[index].float().reshape(n // top_k, top_k, permuted_tokens.shape[-1])
    weights = torch.ones(n // top_k, top_k) if probs is None else probs.float()
    return (rows * weights[..., None]).sum(dim=1).to(permuted_tokens.dtype)


# ---------------------------------------------------------------- npu_weight_quant_batchmatmul
# _op_plugin_docs.py of 2.13.0 / 2.14.0 (same text; 2.6.0's schema lacks weight_dtype): x (M, K) fp16/bf16 on A2/A3,
# weight (K, N) int8 (a transposed view allowed), antiquant_scale (N,) / (1, N) per channel, (1,) / (1, 1) per tensor
# or (ceil(K / g), N) per group (g in [32, K - 1], a multiple of 32), in x's dtype; K and N in [1, 65535]; a bias
# fp32 for bf16 x, fp16 for fp16 x. Output x's dtype: (x @ ((weight + offset) * scale)). No autograd node in any
# release (fake.py strips gradients).

_WQBMM_MAX_INNER = 65535


def npu_weight_quant_batchmatmul(x: Tensor, weight: Tensor, antiquant_scale: Tensor,
                                 antiquant_offset: Optional[Tensor] = None, quant_scale: Optional[Tensor] = None,
                                 quant_offset: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                                 antiquant_group_size: int = 0, inner_precise: int = 0,
                                 weight_dtype: Optional[int] = None) -> Tensor:
    """``x @ dequant(weight)`` (+ bias) for an int8 weight (K, N), per-tensor, per-channel or per-group scales."""
    for name, value in (("quant_scale", quant_scale), ("quant_offset", quant_offset), ("weight_dtype", weight_dtype)):
        if value is not None:
            raise NotImplementedError(f"the fake does not model npu_weight_quant_batchmatmul's {name} argument")
    if inner_precise != 0:
        raise NotImplementedError("the fake does not model inner_precise=1 (int32 FRACTAL_NZ weights only)")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"npu_weight_quant_batchmatmul takes x in float16/bfloat16 (A2/A3), got {x.dtype}")
    if weight.dtype == torch.int32:
        raise NotImplementedError("the fake does not model int4 weights packed in int32")
    if weight.dtype != torch.int8:
        raise TypeError(f"npu_weight_quant_batchmatmul takes an int8 weight (or int4 packed in int32), got"
                        f" {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"x and weight must be (M, K) and (K, N); got x {tuple(x.shape)} and weight"
                         f" {tuple(weight.shape)}")
    if x.numel() == 0 or weight.numel() == 0:
        raise ValueError("npu_weight_quant_batchmatmul does not take empty tensors ('不支持空Tensor输入')")
    k, n = weight.shape
    if max(k, n) > _WQBMM_MAX_INNER:
        raise ValueError(f"K and N must lie in [1, {_WQBMM_MAX_INNER}], got K={k}, N={n}")
    if antiquant_scale.dtype != x.dtype:
        raise TypeError(f"antiquant_scale in float16/bfloat16 must have x's dtype {x.dtype}, got"
                        f" {antiquant_scale.dtype} (int64 scales, the fp16-only npu_trans_quant_param form, are not"
                        " modelled)")
    shape = tuple(antiquant_scale.shape)
    if antiquant_group_size:
        if antiquant_group_size % 32 or not 32 <= antiquant_group_size <= k - 1:
            raise ValueError(f"antiquant_group_size must be a multiple of 32 in [32, K - 1], got"
                             f" {antiquant_group_size}")
        groups = -(-k // antiquant_group_size)
        if shape != (groups, n):
            raise ValueError(f"per-group antiquant_scale must be (ceil(K / group), N) = {(groups, n)}, got {shape}")
        scale = antiquant_scale.float().repeat_interleave(antiquant_group_size, dim=0)[:k]
    elif shape in ((n,), (1, n)):
        scale = antiquant_scale.float().reshape(1, n)
    elif shape in ((1,), (1, 1)):
        scale = antiquant_scale.float().reshape(1, 1)
    else:
        raise ValueError(f"antiquant_scale must be (N,) or (1, N) per channel, (1,) or (1, 1) per tensor (N={n}),"
                         f" got {shape}")
    offset = 0.0
    if antiquant_offset is not None:
        if antiquant_group_size:
            raise NotImplementedError("the fake does not model a per-group antiquant_offset")
        if tuple(antiquant_offset.shape) != shape or antiquant_offset.dtype != antiquant_scale.dtype:
            raise ValueError("antiquant_offset must have antiquant_scale's shape and dtype")
        offset = antiquant_offset.float().reshape(scale.shape)
    out = x.float() @ ((weight.float() + offset) * scale)
    if bias is not None:
        wanted = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        if bias.dtype != wanted or tuple(bias.shape) not in ((n,), (1, n)) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous {wanted} (N,) or (1, N) for {x.dtype} x, got {bias.dtype}"
                             f" {tuple(bias.shape)}")
        out = out + bias.float().reshape(1, n)
    return out.to(x.dtype)
