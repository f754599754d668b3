"""What every decoder-only family shares: embeddings, a stack of layers, the final norm and the head, rope tables
per layer kind, loading Hugging Face-named tensors, and choosing each layer's execution path once after loading.
A family's file only builds its decoder layer (and says whether it can run as one native decode call)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from waferscale.kernels import ACT_GELU_TANH, ACT_SILU, DecodeLayerWeights
from waferscale.models.config import ModelConfig, embed_scale
from waferscale.models.layers.attention import fused_decode_layers
from waferscale.models.layers.embedding import Embedding
from waferscale.models.layers.linear import Linear, LoadContext, put
from waferscale.models.layers.moe import SparseMoE, split_stacked_experts
from waferscale.models.layers.norm import RMSNorm
from waferscale.models.layers.rotary import Rotary
from waferscale.models.quant import ACT_MODE, QuantWeight

# our fused projections and the checkpoint's tensors they are made of, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def layer_decode_weights(layer: nn.Module, norms: tuple, branch_norms: tuple = (None, None)):
    """A decoder layer's weights for the whole-layer decode call (its `self_attn`, `mlp`, the two pre-norms `norms`
    and, for Gemma's sandwich, the norms of each branch's output), or None where a part of it is not native: each
    projection bf16 packed (gate/up in pairs for SiLU) or quantized, native norms of one kind, no bias on a dense
    MLP (gpt-oss's sinks, output bias and biased experts are native)."""
    attn, mlp = layer.self_attn, layer.mlp
    all_norms = [n for n in (*norms, *branch_norms, attn.q_norm, attn.k_norm) if n is not None]
    if not (attn.native_decode and all(n.native for n in all_norms)):
        return None
    if len({type(n).kind for n in all_norms}) != 1:
        return None
    qkv, o = (p.method.decode_weight() for p in (attn.qkv_proj, attn.o_proj))
    o_bias = attn.o_proj.method.decode_bias() if attn.o_proj.bias is not None else None
    if qkv is None or o is None or (attn.o_proj.bias is not None and o_bias is None):
        return None
    if isinstance(mlp, SparseMoE):  # experts in place of the MLP: router, routing and experts in the same call
        moe, gate_up, down, inter, act = mlp.native_weights(), None, None, mlp.experts.inter, "silu"
        if moe is None:
            return None
    else:
        moe, gate_up, down, inter, act = None, mlp.decode_gate_up(), mlp.down_proj.method.decode_weight(), mlp.inter, mlp.act
        if gate_up is None or down is None or any(p.bias is not None for p in (mlp.down_proj, mlp.gate_up_proj)):
            return None
    q_norm, k_norm = attn.decode_norms()
    post_attn, post_ff = (None if n is None else n.decode_weight() for n in branch_norms)
    return DecodeLayerWeights(
        norm1=norms[0].decode_weight(),
        qkv=qkv,
        qkv_bias=attn.qkv_proj.method.decode_bias(),
        o=o,
        norm2=norms[1].decode_weight(),
        gate_up=gate_up,
        inter=inter,
        down=down,
        eps=norms[0].eps,
        act=ACT_MODE,
        norm_kind=all_norms[0].kind,
        q_norm=q_norm,
        k_norm=k_norm,
        post_attn=post_attn,
        post_ff=post_ff,
        mlp_act=ACT_SILU if act == "silu" else ACT_GELU_TANH,
        moe=moe,
        sinks=None if attn.sinks is None else attn.sinks.detach().float().contiguous(),
        o_bias=o_bias,
    )


class CausalLM(nn.Module):
    """Token ids in, hidden states out; `logits` turns chosen hidden rows into float32 vocabulary scores."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, embed_scale(cfg))
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, dtype, cfg.max_position_embeddings
        )
        self.rotary_local = None  # sliding layers' own rope base (Gemma 3)
        if cfg.rope_local_theta is not None and any(cfg.window(i) for i in range(cfg.num_layers)):
            self.rotary_local = Rotary(
                cfg.head_dim, cfg.rope_local_theta, cfg.rope_local_scaling, max_positions, dtype,
                cfg.max_position_embeddings,
            )
        self.requires_grad_(False)
        # each layer's weights for the native whole-layer decode call, and the most rows it takes; None where the
        # layers cannot run natively (set by process_weights_after_loading)
        self.decode_layers: list | None = None
        self.decode_rows: int | None = None
        self.decode_windows = [layer.self_attn.window for layer in self.layers]  # read by every decode step
        self._native_calls: tuple | None = None  # (weakref to a KV pool, its layer_calls): _layer_calls

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        """The family's decoder layer number `index`."""
        raise NotImplementedError

    def _ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin rows for these positions."""
        rope = self.rotary(positions)
        if self.rotary_local is None:
            return [rope] * len(self.layers)
        local = self.rotary_local(positions)
        return [local if self.cfg.window(i) else rope for i in range(len(self.layers))]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        ropes = self._ropes(positions)
        if (
            self.decode_layers is not None
            and h.dtype == torch.bfloat16
            and (self.decode_rows is None or h.shape[0] <= self.decode_rows)
            and kv.can_fuse_decode(h.shape[0], self.cfg.head_dim)
        ):  # decode rows only: native calls in place on h (the modules' kernels, bit for bit)
            if kv.interrupt is None:  # no check to make between layers: all of them in one native call
                fused_decode_layers(kv, h, ropes, self.decode_windows, self._layer_calls(kv))
                return self.norm(h)
            for i, weights in enumerate(self.decode_layers):
                kv.check_interrupt()
                self.layers[i].decode_native(kv, i, h, ropes[i], weights)
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            kv.check_interrupt()
            h = layer(h, ropes[i], kv, i)
        return self.norm(h)

    def _layer_calls(self, kv):
        """The whole-model decode call's unchanging arguments for kv's pool (its caches' pointers), built at the
        pool's first decode step and kept while that pool lives."""
        cached = self._native_calls
        if cached is not None and cached[0]() is kv.pool:
            return cached[1]
        layers = []
        for i, weights in enumerate(self.decode_layers):
            cache, attn = kv.layer(i)[1], self.layers[i].self_attn
            layers.append((weights, cache.k, cache.v, cache.k_scale, cache.v_scale, attn.num_heads, attn.scale))
        calls = kv.native.layer_calls(layers)
        self._native_calls = (weakref.ref(kv.pool), calls)
        return calls

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 scores over the vocabulary for hidden rows (soft-capped where the config says)."""
        scores = self.lm_head.logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap:
            scores = torch.tanh(scores / cap) * cap
        return scores

    def expert_load(self) -> dict[int, list[int]]:
        """Rows routed to each expert since loading, per sparse layer index (empty for a dense model)."""
        return {
            i: layer.mlp.expert_load.tolist()
            for i, layer in enumerate(self.layers)
            if hasattr(getattr(layer, "mlp", None), "expert_load")
        }

    def process_weights_after_loading(self, ctx: LoadContext) -> int:
        """Choose every layer's execution path (parents first, so a fused neighbour can claim its parts); returns
        the bytes of packed weights and copies added."""
        for m in self.modules():
            if m is not self and hasattr(m, "process_weights_after_loading"):
                m.process_weights_after_loading(ctx)
        added = sum(m.method.nbytes() for m in self.modules() if isinstance(m, Linear))
        added += sum(m.nbytes() for m in self.modules() if hasattr(m, "gate_up_pairs"))
        if ctx.kernels is not None and ctx.dtype == torch.bfloat16:
            layers = [layer.decode_weights() for layer in self.layers]
            self.decode_layers = None if None in layers else layers
            # the row limit is the packed bf16 projections' (beyond it oneDNN's GEMM wins where bf16 is in
            # hardware); layers whose projections are all quantized take qgemm either way, at any batch size
            packed = any(
                isinstance(p, torch.Tensor) for w in layers if w is not None for p in (w.qkv, w.o, w.gate_up, w.down)
            ) or any(w.moe.packed for w in layers if w is not None and w.moe is not None)
            self.decode_rows = ctx.native_rows if packed else None
        return added

    def load_hf_state(self, tensors: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype) -> None:
        """Take weights named as in Hugging Face checkpoints, fusing q/k/v and gate/up; a QuantWeight entry (see
        models/quant/) is kept in its blocks; experts stacked in one tensor are taken per expert."""

        def take(name: str) -> torch.Tensor | QuantWeight:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            value = tensors.pop(name)
            return value if isinstance(value, QuantWeight) else value.to(dtype)

        if self.cfg.num_experts:
            split_stacked_experts(tensors, self.cfg.num_experts)  # stacked experts as per-expert views
        embed = take("model.embed_tokens.weight")
        self.embed_tokens.load(embed, dtype)
        for path, module in list(self.named_modules()):
            if not path.startswith("layers."):
                continue
            prefix = f"model.{path}"
            if isinstance(module, Linear):
                owner, attr = prefix.rsplit(".", 1)
                names = [f"{owner}.{n}" for n in FUSED.get(attr, (attr,))]
                bias = torch.cat([take(f"{n}.bias") for n in names]) if module.bias is not None else None
                module.load([take(f"{n}.weight") for n in names], bias, f"{owner}.{attr}")
                continue
            for pname, _ in module.named_parameters(recurse=False):
                put(module, pname, take(f"{prefix}.{pname}"), f"{prefix}.{pname}")
        put(self.norm, "weight", take("model.norm.weight"), "model.norm.weight")
        if "lm_head.weight" in tensors and not self.cfg.tie_word_embeddings:
            self.lm_head.load([take("lm_head.weight")], None, "lm_head.weight")
        elif isinstance(embed, QuantWeight):
            self.lm_head.load([embed], None, "lm_head.weight")  # the same blocks: one copy
        else:
            self.lm_head.weight = self.embed_tokens.weight
        tensors.pop("lm_head.weight", None)
