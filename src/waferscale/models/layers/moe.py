"""Mixture-of-experts feed-forward layers: a router picks k experts a token, each expert is a gated MLP of its own
`Linear`s (so it multiplies as the dense layers do: quantized blocks, packed bf16, float32 native), tokens are
grouped by expert (one GEMM per active expert over its rows), and the results are weighted and summed.

What differs between families is data, not code: the routing order (softmax then top-k for Qwen, top-k then
softmax for gpt-oss), k, renormalisation of the top-k weights, router and expert biases, the activation, and a
shared expert beside the routed ones (with its own sigmoid gate where the family has one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.heap import trim_heap
from waferscale.models import quant
from waferscale.models.layers.linear import Linear, LoadContext, within
from waferscale.models.layers.mlp import GatedMLP

SOFTMAX_TOPK, TOPK_SOFTMAX = "softmax_topk", "topk_softmax"


@dataclass(frozen=True)
class Routing:
    """How router logits become (expert ids, weights) a token: `order` softmax_topk (softmax over all experts,
    then the k largest) or topk_softmax (the k largest logits, then softmax over them); `renormalize` divides
    softmax_topk's k weights by their sum (Qwen's norm_topk_prob)."""

    top_k: int
    order: str = SOFTMAX_TOPK
    renormalize: bool = False

    def __post_init__(self):
        if self.order not in (SOFTMAX_TOPK, TOPK_SOFTMAX):
            raise ValueError(f"unknown routing order {self.order!r} (choose {SOFTMAX_TOPK} or {TOPK_SOFTMAX})")

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], int64 expert ids [T, k]) from router logits [T, E], as transformers computes
        them (torch.topk on the same float32 values, so ties break the same way)."""
        if self.order == TOPK_SOFTMAX:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top.float(), dim=-1), ids
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ids [T, k] sorted by expert: (the token of each, its index into ids.view(-1),
    the number of rows each expert gets, int64 [num_experts]); a token's slots keep their order within an expert."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // ids.shape[1], order, torch.bincount(flat, minlength=num_experts)


class GroupedExperts:
    """Each active expert's modules called from Python on all of its rows at once (any dtype, any method)."""

    def __init__(self, experts: Experts):
        self.experts = experts

    def apply(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, slots, counts = group_by_expert(ids, len(self.experts))
        w = weights.reshape(-1)[slots]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if not n:
                continue
            rows, part = tokens[start : start + n], w[start : start + n]
            start += n
            y = self.experts[e](x.index_select(0, rows))
            out.index_add_(0, rows, (y * part.unsqueeze(1)).float())
        return out


class NativeExperts:
    """bf16 batches of up to `max_rows` rows (None: any): every expert of the step in one native call
    (kernels.moe_experts_bf16), the same kernels and roundings as GroupedExperts, bit for bit; other batches go to
    `fallback`."""

    def __init__(self, kernels, weights, max_rows: int | None, fallback: GroupedExperts, packed: bool = False):
        self.kernels, self.weights, self.max_rows, self.fallback = kernels, weights, max_rows, fallback
        self.packed = packed  # some experts are packed bf16

    def apply(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16 or not within(x.shape[0], self.max_rows):
            return self.fallback.apply(x, ids, weights)
        tokens, slots, counts = group_by_expert(ids, self.weights.count)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        xs = x.index_select(0, tokens).contiguous()
        self.kernels.moe_experts_bf16(xs, tokens, weights.reshape(-1)[slots].contiguous(), counts, self.weights, out)
        return out


class Experts(nn.ModuleList):
    """`num_experts` gated MLPs, each its own gate_up_proj and down_proj (loaded from per-expert tensors, named
    experts.{j}.gate_proj ... as the checkpoints name them), applied by a method chosen once after loading."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool = False,
        act_params: dict[str, float] | None = None,
    ):
        super().__init__(
            GatedMLP(hidden_size, intermediate_size, act, bias=bias, act_params=act_params) for _ in range(num_experts)
        )
        self.num_experts, self.hidden_size, self.inter = num_experts, hidden_size, intermediate_size
        self.method: GroupedExperts | NativeExperts | None = None

    def process_weights_after_loading(self, ctx: LoadContext) -> None:
        """Let each expert choose its projections' methods, then take all experts in one native call where every
        expert's projections are packed bf16 or quantized (MXFP4 included), with SiLU or the clamped SwiGLU and their
        biases where the family has them. bf16 experts are packed for the native
        kernels at any row count, without the PyTorch copy kept beside the packed one for large batches where bf16
        is multiplied in hardware: experts are most of the model's bytes and take a few rows each."""
        if ctx.packs_bf16() and ctx.native_rows is not None:
            ctx = dataclasses.replace(ctx, hardware_bf16=False)
        for expert in self:
            for m in expert.modules():
                if hasattr(m, "process_weights_after_loading"):
                    m.process_weights_after_loading(ctx)
            # the weight a packed copy replaced, back now: the copies are allocated elsewhere than the freed
            # weights, which were left in the heap, an expert at a time until the whole model's were (2 layers of
            # Qwen3-30B-A3B's shape in bf16: a 1.9 GB peak above the loaded size)
            trim_heap()
        self.method = GroupedExperts(self)
        from waferscale.kernels import MOE_ACT_SILU, MOE_ACT_SWIGLU_CLAMPED, ExpertWeights

        # the experts' activations moe_experts_bf16 has
        activation = {"silu": MOE_ACT_SILU, "swiglu_clamped": MOE_ACT_SWIGLU_CLAMPED}.get(self[0].act)
        if ctx.kernels is None or ctx.dtype != torch.bfloat16 or activation is None:
            return
        gate_up = [e.decode_gate_up() for e in self]
        down = [e.down_proj.method.decode_weight() for e in self]
        if any(w is None for w in gate_up + down):
            return
        packed = any(isinstance(w, torch.Tensor) for w in gate_up + down)
        # the row limit of the bf16 paths (packed pairs, packed panels), as the modules apply it
        rows = min((r for e in self for r in (e.pair_rows, getattr(e.gate_up_proj.method, "max_rows", None),
                                               getattr(e.down_proj.method, "max_rows", None)) if r is not None),
                   default=None)
        biases = [[e.gate_up_proj.method.decode_bias() for e in self], [e.down_proj.method.decode_bias() for e in self]]
        params = self[0].act_params if self[0].act == "swiglu_clamped" else {}
        weights = ExpertWeights(gate_up, down, self.inter, quant.modules.ACT_MODE,  # as QuantLinear passes it
                                *biases, activation=activation, **params)
        self.method = NativeExperts(ctx.kernels, weights, rows, self.method, packed)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over a token's k experts of weight * expert(x), float32 [T, hidden]; experts are taken in id order
        and each multiplies all of its rows at once."""
        return self.method.apply(x, ids, weights)


class SparseMoE(nn.Module):
    """x -> sum of the routed experts' outputs (plus a shared expert's), in x's dtype, plus a residual when given.
    `gate` is the router (named as the checkpoints name it); `shared_expert_gate` scales the shared expert by a
    sigmoid where the family has one (Qwen2-MoE); `expert_load` counts the rows routed to each expert (routing
    skew, for an operator)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: Routing,
        act: str = "silu",
        router_bias: bool = False,
        expert_bias: bool = False,
        shared_intermediate_size: int | None = None,
        shared_gate: bool = False,
        act_params: dict[str, float] | None = None,
    ):
        super().__init__()
        if not 0 < routing.top_k <= num_experts:
            raise ValueError(f"experts per token {routing.top_k} is outside 1..{num_experts} (the experts)")
        self.routing = routing
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act, expert_bias, act_params)
        shared = shared_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, shared, act) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1) if shared and shared_gate else None
        self.expert_load = torch.zeros(num_experts, dtype=torch.int64)  # rows routed to each expert since loading
        self._native: tuple | None = None  # (MoEWeights or None, its row limit), once the methods are chosen

    def native_weights(self):
        """The whole layer as one native call reads it (waferscale.kernels.MoEWeights: router, routing, experts), or
        None where a part is not native (experts off the one-call path, a router without a native weight, a shared
        expert). Built on first use, after loading has chosen every part's method."""
        if self._native is None:
            self._native = self._build_native()
        return self._native[0]

    def _build_native(self) -> tuple:
        method, router = self.experts.method, self.gate.method
        if not isinstance(method, NativeExperts) or self.shared_expert is not None or router is None:
            return None, None
        weight, bias = router.decode_weight(), router.decode_bias()
        if weight is None or (self.gate.bias is not None and bias is None):
            return None, None
        from waferscale.kernels import MOE_SOFTMAX_TOPK, MOE_TOPK_SOFTMAX, MoEWeights

        order = MOE_SOFTMAX_TOPK if self.routing.order == SOFTMAX_TOPK else MOE_TOPK_SOFTMAX
        limits = [r for r in (method.max_rows, getattr(router, "max_rows", None)) if r is not None]
        packed = isinstance(weight, torch.Tensor) or method.packed
        moe = MoEWeights(weight, bias, method.weights, self.routing.top_k, order, self.routing.renormalize,
                         self.expert_load, quant.modules.ACT_MODE, packed=packed)
        return moe, min(limits, default=None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for rows x [T, hidden] (in x's dtype), plus `residual` when given."""
        moe = self.native_weights()
        if moe is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and within(x.shape[0], self._native[1]):
            # router, routing and experts in one native call: the whole-layer decode call's, bit for bit
            out = torch.zeros_like(x) if residual is None else residual.clone(memory_format=torch.contiguous_format)
            self.experts.method.kernels.moe_forward_bf16(x.contiguous(), moe, out)
            return out
        logits = self.gate(x)
        weights, ids = self.routing.route(logits)
        self.expert_load += torch.bincount(ids.reshape(-1), minlength=len(self.expert_load))
        out = self.experts(x, ids, weights.to(logits.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out += shared.float()
        out = out.to(x.dtype)
        return out if residual is None else residual + out


GATE_UP_ROWS = "gate_up_rows"  # stacked experts' gate and up, each expert's gate rows then its up rows


def stack_gate_up(gate, up, num_experts: int):
    """One QuantWeight of every expert's gate rows then up rows (E * 2N rows), from GGUF's separate gate and up
    stacks; None where they cannot share one (not quantized, or in different layouts). Written as
    `experts.gate_up_rows`, each expert's fused gate/up is then a view of it at load, not a copy."""
    from waferscale.models.quant import QuantWeight

    if not (isinstance(gate, QuantWeight) and isinstance(up, QuantWeight)) or gate.shape != up.shape:
        return None
    if gate.layout != up.layout or type(gate) is not type(up):
        return None

    def rows(key: str) -> torch.Tensor | None:
        g, u = getattr(gate, key), getattr(up, key)
        if g is None:
            return None
        both = torch.stack([g.reshape(num_experts, -1, *g.shape[1:]), u.reshape(num_experts, -1, *u.shape[1:])], 1)
        return both.reshape(-1, *g.shape[1:])

    fields = {f.name: getattr(gate, f.name) for f in dataclasses.fields(gate)}
    return type(gate)(**{**fields, **{k: rows(k) for k in ("qweight", "scales", "mins", "sup", "supm")}})


def split_stacked_experts(tensors: dict, num_experts: int) -> None:
    """Replace, in place, every projection stored for all experts at once by per-expert entries named as published
    checkpoints name them (`...mlp.experts.{j}.gate_proj.weight`): transformers' fused 3-D parameters
    (`experts.gate_up_proj` [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]) and the GGUF stacks
    (`experts.gate_proj.weight` ..., [E, N, K] float or a QuantWeight of E * N rows), and a conversion's
    `experts.gate_up_rows` (stack_gate_up). Each entry is a view of the stack's rows, not a copy."""
    from waferscale.models.quant import QuantWeight

    def per_expert(value) -> list:
        if isinstance(value, QuantWeight):
            if value.out_features % num_experts:
                raise ValueError(f"{value.out_features} stacked rows do not split into {num_experts} experts")
            n = value.out_features // num_experts
            return [value.take_rows(slice(j * n, (j + 1) * n)) for j in range(num_experts)]
        if value.dim() != 3 or value.shape[0] != num_experts:
            raise ValueError(f"stacked experts have shape {tuple(value.shape)}, expected [{num_experts}, N, K]")
        return list(value.unbind(0))

    for name in [k for k in tensors if ".mlp.experts." in k]:
        owner, _, tail = name.partition(".mlp.experts.")
        prefix = f"{owner}.mlp.experts"
        if tail in ("gate_up_proj", GATE_UP_ROWS):
            for j, w in enumerate(per_expert(tensors.pop(name))):
                n = w.shape[0] // 2
                gate, up = (w.take_rows(slice(0, n)), w.take_rows(slice(n, None))) if isinstance(
                    w, QuantWeight) else (w[:n], w[n:])
                tensors[f"{prefix}.{j}.gate_proj.weight"], tensors[f"{prefix}.{j}.up_proj.weight"] = gate, up
        elif tail in ("down_proj", "gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            proj = tail.removesuffix(".weight")
            for j, w in enumerate(per_expert(tensors.pop(name))):
                tensors[f"{prefix}.{j}.{proj}.weight"] = w
