"""Gated feed-forward layers: down(act(gate(x)) * up(x)), with SiLU (Llama, Qwen) or tanh-GELU (Gemma); or
down(act(gate(x), up(x))) for gpt-oss's clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.models.layers.linear import (
    Linear,
    LoadContext,
    TorchMethod,
    Unpacked,
    _meta,
    pack_bf16_chunked,
    within,
)

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


SWIGLU_DEFAULTS = {"alpha": 1.702, "limit": 7.0}  # gpt-oss's released values


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's: gate clamped above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# activations of (gate, up) that are not act(gate) * up
GATED_ACTIVATIONS = {"swiglu_clamped": _clamped_swiglu}


class GatedMLP(nn.Module):
    """gate and up fused in one projection (gate rows first); with SiLU and bf16 weights, both are packed in pairs
    of panels so that one native pass gives silu(gate) * up. Biases on both projections where a family has them
    (gpt-oss's experts); `act_params` are a gated activation's keyword arguments (gpt-oss's alpha and limit)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        bias: bool = False,
        act_params: dict[str, float] | None = None,
    ):
        super().__init__()
        if act not in ACTIVATIONS and act not in GATED_ACTIVATIONS:
            supported = ", ".join([*ACTIVATIONS, *GATED_ACTIVATIONS])
            raise ValueError(f"unsupported activation {act!r} (supported: {supported})")
        self.inter, self.act = intermediate_size, act
        # a gated activation's parameters (gpt-oss: alpha, limit), the released values where a family gives none
        self.act_params = {**(SWIGLU_DEFAULTS if act == "swiglu_clamped" else {}), **(act_params or {})}
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.kernels = None
        self.gate_up_pairs: torch.Tensor | None = None  # gate/up packed in pairs (silu only)
        self.pair_rows: int | None = None  # batches of at most this many rows use gate_up_pairs (None: any)
        # the activation by the native kernel on bf16 rows (tanh-GELU, the clamped SwiGLU; SiLU after quantized)
        self.native_mul = False

    def process_weights_after_loading(self, ctx: LoadContext) -> None:
        """Pack bf16 gate/up in pairs where the native SiLU-and-multiply kernel applies; before the projections
        choose their own methods (modules are visited parents first; a second call does nothing)."""
        proj = self.gate_up_proj
        if self.gate_up_pairs is not None or proj.method is not None:
            return
        native_bf16 = ctx.kernels is not None and ctx.dtype == torch.bfloat16
        # SiLU after quantized projections only: bf16 ones take the packed pairs' one pass below
        quantized_silu = self.act == "silu" and proj.quant is not None
        if native_bf16 and (self.act in (*GELU_TANH, "swiglu_clamped") or quantized_silu):
            # bf16 rows take the native activation-and-multiply, as the whole-layer call does
            self.kernels, self.native_mul = ctx.kernels, True
            return
        if (
            self.act != "silu"
            or proj.bias is not None
            or proj.quant is not None
            or proj.weight.dtype != torch.bfloat16
            or not ctx.packs_bf16()
            or self.inter % 16
        ):
            return
        self.kernels, self.pair_rows = ctx.kernels, ctx.native_rows
        self.gate_up_pairs = pack_bf16_chunked(proj.weight.detach(), pairs=True)
        if self.pair_rows is None:  # every bf16 batch reads the pairs: they are the only copy kept
            proj.weight, proj.method = _meta(proj.weight), Unpacked()
        else:
            proj.method = TorchMethod(proj.weight, proj.bias, ctx.hardware_bf16)

    def decode_gate_up(self):
        """gate/up as the whole-layer decode kernel reads it (SiLU: packed pairs or quantized parts; tanh-GELU:
        the projection's packed panels or parts, as for the clamped SwiGLU), or None."""
        if self.act in GELU_TANH or self.act == "swiglu_clamped":
            return self.gate_up_proj.method.decode_weight() if self.native_mul else None
        if self.act != "silu":
            return None
        if self.gate_up_pairs is not None:
            return self.gate_up_pairs
        return self.gate_up_proj.method.decode_weight() if self.gate_up_proj.quant is not None else None

    def nbytes(self) -> int:
        return 0 if self.gate_up_pairs is None else self.gate_up_pairs.numel() * 2

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), plus `residual` when given."""
        if self.gate_up_pairs is not None and x.dtype == torch.bfloat16 and within(x.shape[0], self.pair_rows):
            act = self.kernels.linear_silu_mul_bf16(x, self.gate_up_pairs, self.inter)
        elif self.native_mul and x.dtype == torch.bfloat16 and x.dim() == 2:
            gate_up = self.gate_up_proj(x)
            act = self._native_act(gate_up.contiguous()) if gate_up.dtype == torch.bfloat16 else None
            if act is None:  # a method that answered in another dtype
                act = self._act(*gate_up.split([self.inter, self.inter], dim=-1))
        else:
            act = self._act(*self.gate_up_proj(x).split([self.inter, self.inter], dim=-1))
        return self.down_proj(act, residual)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, or the gated activation of both, in PyTorch."""
        gated = GATED_ACTIVATIONS.get(self.act)
        return gated(gate, up, **self.act_params) if gated is not None else ACTIVATIONS[self.act](gate) * up

    def _native_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The native kernel's activation of bf16 gate_up [M, 2 I] (the one the whole-layer and experts' calls use)."""
        if self.act == "silu":
            return self.kernels.silu_mul_bf16(gate_up)
        if self.act == "swiglu_clamped":
            return self.kernels.swiglu_clamped_bf16(gate_up, **self.act_params)
        return self.kernels.gelu_mul_bf16(gate_up)
