"""Self-attention over the paged KV cache, reading the engine's pure-data batch plan (engine/kv_cache.PagedBatch):
decode rows first (one query each, over their block tables), then prefill chunks (causal over their context). A
layer may see only a sliding window of the latest positions, and may add a learned sink logit per head to each
softmax's denominator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.models.layers.linear import Linear
from waferscale.models.layers.rotary import apply_rope


def _window_starts(group, window: int | None) -> torch.Tensor | None:
    """The first position (from the table's start) each decode row attends to under a window (None: all)."""
    if window is None:
        return None
    key = ("starts", window)
    starts = group.cache.get(key)
    if starts is None:
        starts = group.cache[key] = (group.decode_lengths - window).clamp(min=0)
    return starts


def _decode_mask(group, window: int | None, width: int) -> torch.Tensor:
    """Boolean [B, 1, 1, width] of the positions each decode row sees (its length, and its window)."""
    key = ("decode_mask", window)
    mask = group.cache.get(key)
    if mask is None:
        pos = torch.arange(width).unsqueeze(0)
        allowed = pos < group.decode_lengths.unsqueeze(1)
        if window is not None:
            allowed &= pos >= _window_starts(group, window).unsqueeze(1)
        mask = group.cache[key] = allowed[:, None, None]
    return mask


def _prefill_mask(
    group, n: int, start: int, rows: int, length: int, first: int, window: int | None, dtype
) -> torch.Tensor | None:
    """Additive mask (0 or -inf) of prefill chunk n's rows over its context from position `first`; None where
    plain causal does."""
    if not start and window is None:
        return None
    key = ("prefill_mask", n, window)
    mask = group.cache.get(key)
    if mask is None:
        row_pos = torch.arange(start, start + rows).unsqueeze(1)
        pos = torch.arange(first, length).unsqueeze(0)
        allowed = pos <= row_pos
        if window is not None:
            allowed &= pos > row_pos - window
        mask = group.cache[key] = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return mask


def _attend_with_sinks(q, keys, values, mask, scale: float, sinks: torch.Tensor, gqa: bool) -> torch.Tensor:
    """softmax([q K^T * scale, sink]) V without the sink's column, as transformers' eager gpt-oss attention.
    q [B, H, T, D]; keys, values [B, KVH, L, D]; mask additive or boolean, broadcastable to [B, H, T, L]."""
    if gqa:
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    both = both - both.amax(dim=-1, keepdim=True)
    probs = F.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def paged_attention(
    plan,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's keys and values to their slots, then attend each row over its context (and window)."""
    pool = plan.pool
    group, cache = plan.layer(layer)
    cache.write(group.slots, k, v)  # an int8 pool quantizes here, and every read below sees the stored values
    heads, dim = cache.k.shape[1], cache.k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    out_dtype = q.dtype
    q = q.to(cache.compute_dtype)  # attention runs in the pool's dtype (an int8 pool's compute dtype)
    out = torch.empty_like(q)
    b = plan.num_decode
    if b and plan.native is not None:
        o = plan.native.paged_decode_attention(
            q[:b].float().contiguous(),
            cache.k,
            cache.v,
            group.decode_tables,
            group.decode_lengths,
            scale,
            pool.block_size,
            starts=_window_starts(group, window),
            sinks=None if sinks is None else sinks.float().contiguous(),
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )
        out[:b] = o.to(out.dtype)
    elif b:
        keys, values = cache.gather(group.decode_tables.flatten(), pool.block_size)
        shape = (b, -1, heads, dim)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)  # [B, kv_heads, L, D]
        if window is None and sinks is None and group.decode_mask is not None:
            mask = group.decode_mask
        else:
            mask = _decode_mask(group, window, keys.shape[2])
        qd = q[:b].unsqueeze(2)
        if sinks is not None:
            o = _attend_with_sinks(qd, keys, values, mask, scale, sinks, gqa)
        else:
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[:b] = o.squeeze(2)
    for n, (start_row, end_row, table, start_pos, length, *rest) in enumerate(group.prefills):
        first = rest[0] if rest else 0  # the position of the table's first page
        keys, values = cache.gather(table, pool.block_size)
        keys = keys[: length - first].transpose(0, 1).unsqueeze(0)
        values = values[: length - first].transpose(0, 1).unsqueeze(0)
        rows = end_row - start_row
        mask = _prefill_mask(group, n, start_pos, rows, length, first, window, cache.compute_dtype)
        qp = q[start_row:end_row].transpose(0, 1).unsqueeze(0)
        if sinks is not None:
            if mask is None:
                mask = _prefill_mask(group, n, start_pos, rows, length, first, 1 << 62, cache.compute_dtype)
            o = _attend_with_sinks(qp, keys, values, mask, scale, sinks, gqa)
        else:
            o = F.scaled_dot_product_attention(
                qp, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
        out[start_row:end_row] = o.squeeze(0).transpose(0, 1)
    return out.to(out_dtype)


def _decode_args(plan, layer: int, rope: tuple[torch.Tensor, torch.Tensor], rows: int) -> tuple[tuple, dict]:
    """What the native decode calls take after their own input: rope rows, the layer's caches, slots and tables;
    and an int8 pool's scales as keywords."""
    cos, sin = rope
    group, cache = plan.layer(layer)
    args = (cos.reshape(rows, -1), sin.reshape(rows, -1), cache.k, cache.v, group.slots, group.decode_tables)
    return (*args, group.decode_lengths), {"k_scale": cache.k_scale, "v_scale": cache.v_scale}


def fused_decode_attention(plan, layer: int, qkv: torch.Tensor, rope, num_heads: int, scale: float) -> torch.Tensor:
    """Decode rows only (plan.can_fuse_decode): rope, KV write and attention in one native call; qkv bf16
    [B, (H + 2 KVH) D] in, attention output bf16 [B, H D]."""
    args, scales = _decode_args(plan, layer, rope, qkv.shape[0])
    return plan.native.decode_attention_bf16(
        qkv.contiguous(), *args, num_heads, scale, plan.pool.block_size, **scales
    )


def fused_decode_layer(plan, layer: int, h: torch.Tensor, rope, weights, attn: Attention) -> None:
    """A whole decoder layer for decode rows only, in place on h (bf16 [B, E]), with `attn`'s heads, scale and
    window; weights: waferscale.kernels.DecodeLayerWeights."""
    args, scales = _decode_args(plan, layer, rope, h.shape[0])
    starts = None if attn.window is None else _window_starts(plan.group(layer), attn.window)
    plan.native.decode_layer_bf16(
        h, weights, *args, attn.num_heads, attn.scale, plan.pool.block_size, **scales, starts=starts
    )


def fused_decode_layers(plan, h: torch.Tensor, ropes: list, windows: list, calls) -> None:
    """Every decoder layer for decode rows only in one native call, in place on h (bf16 [B, E]): fused_decode_layer
    for each layer in order, `calls` holding what does not change between steps (NativeKernels.layer_calls), and
    each layer's rope rows (ropes), window (windows) and KV group giving what does."""
    rows, fields, keep, seen = h.shape[0], [], [], {}
    for i, (rope, window) in enumerate(zip(ropes, windows)):
        group = plan.group(i)
        key = (id(group), id(rope), window)
        row = seen.get(key)
        if row is None:
            cos, sin = (t.reshape(rows, -1) for t in rope)
            starts = _window_starts(group, window)
            keep += [cos, sin]  # reshape may copy: alive until the call returns
            tables = group.decode_tables
            row = seen[key] = [cos.data_ptr(), sin.data_ptr(), group.slots.data_ptr(), tables.data_ptr()]
            row += [group.decode_lengths.data_ptr(), tables.shape[1], 0 if starts is None else starts.data_ptr()]
        fields += row
    plan.native.decode_layers_bf16(h, calls, torch.tensor(fields, dtype=torch.int64), plan.pool.block_size)


class Attention(nn.Module):
    """q/k/v fused in one projection, rope, paged attention, o_proj; optional per-head q/k RMSNorm before rope
    (Qwen3, Gemma 3), a sliding window, and sink logits."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        window: int | None = None,
        qk_norm: type[nn.Module] | None = None,
        norm_eps: float = 1e-6,
        sinks: bool = False,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.q_norm = qk_norm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = qk_norm(head_dim, norm_eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None

    @property
    def native_decode(self) -> bool:
        """Whether the whole-layer decode call can run this attention (q/k norms through the native kernel; a
        window; sinks)."""
        return self.q_norm is None or (self.q_norm.native and self.k_norm.native)

    def decode_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The q and k norms' weights as the whole-layer decode call reads them (None: no norms)."""
        if self.q_norm is None:
            return None, None
        return self.q_norm.decode_weight(), self.k_norm.decode_weight()

    @property
    def plain(self) -> bool:
        """Whether rope, KV write and attention can run as one native decode call (no norms, window or sinks)."""
        return self.q_norm is None and self.window is None and self.sinks is None

    def forward(self, x: torch.Tensor, rope, kv, layer: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Self-attention of x's rows, plus `residual` when given."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.plain and qkv.dtype == torch.bfloat16 and kv.can_fuse_decode(t, self.head_dim):
            return self.o_proj(fused_decode_attention(kv, layer, qkv, rope, self.num_heads, self.scale), residual)
        heads = self.num_heads + self.num_kv_heads
        if self.q_norm is None:
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(kv, layer, q, k, v, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(t, self.q_size), residual)
