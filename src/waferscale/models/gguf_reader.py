"""A GGUF file read as its config, tokenizer and Hugging Face-named tensors: llama.cpp's tensor names and metadata
keys mapped per family (models/registry.py), its quantized blocks kept as QuantWeights where models/quant/ serves
them, the rest dequantized."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from waferscale.models.config import ModelConfig
from waferscale.models.quant import QuantWeight, from_gguf, quantize
from waferscale.models.registry import GGUF_ARCHITECTURES, family_for_gguf
from waferscale.models.source import ModelLoadError, derive_name
from waferscale.models.tokenizer import ModelTokenizer

_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: torch.Tensor | np.ndarray | QuantWeight, n_head: int) -> torch.Tensor | np.ndarray | QuantWeight:
    """Undo llama.cpp's q/k row permutation (interleaved rope) back to the Hugging Face rotate-half layout."""
    if isinstance(w, QuantWeight):  # whole rows move: the same permutation of the blocks' rows
        return w.take_rows(torch.from_numpy(_unpermute(np.arange(w.out_features), n_head).copy()))
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf(src: Path, dtype: torch.dtype, progress: bool = True, quantization: str = "none"):
    """Config, tokenizer and an iterator of Hugging Face-named tensors from a GGUF file: dequantised to dtype
    (quantization none), or, for the 2-D weights in a format models/quant/ serves, QuantWeights of the same values
    (and float 2-D weights quantized with quantization int8/int4). The config is complete once the iterator is
    exhausted (a rope_freqs tensor sets its rope scaling)."""
    from waferscale.models.gguf_file import read_gguf_file

    try:
        reader = read_gguf_file(src)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{src} is not a readable GGUF file: {exc}") from exc
    meta = reader.metadata
    arch = meta.get("general.architecture")
    family = family_for_gguf(arch)
    if family is None:
        raise ModelLoadError(
            f"{src}: unsupported architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    to_hf = {**_GGUF_TO_HF, **family.gguf_tensors}

    def m(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    tokenizer = ModelTokenizer.from_gguf_metadata(meta)
    names = {t.name for t in reader.tensors}
    heads = m("attention.head_count")
    hidden = m("embedding_length")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=m("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=m("feed_forward_length"),
        num_layers=m("block_count"),
        num_heads=heads,
        num_kv_heads=m("attention.head_count_kv") or heads,
        head_dim=m("attention.key_length") or hidden // heads,
        max_position_embeddings=m("context_length", 4096),
        rms_norm_eps=m("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=m("rope.freq_base", 10000.0),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        name=derive_name(src),
    )
    if m("rope.scaling.type") == "linear":
        cfg.rope_scaling = {"type": "linear", "factor": m("rope.scaling.factor")}
    elif m("rope.scaling.type") == "yarn":
        cfg.rope_scaling = {
            "rope_type": "yarn",
            "factor": m("rope.scaling.factor"),
            "original_max_position_embeddings": m("rope.scaling.original_context_length"),
            "beta_fast": m("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": m("rope.scaling.yarn_beta_slow", 1.0),
        }
    elif m("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{src}: unsupported rope scaling {m('rope.scaling.type')!r}")
    family.read_gguf(cfg, m)  # after the rope: a family may refine it

    return cfg, tokenizer, _tensors(reader, src, cfg, family, to_hf, dtype, progress, quantization)


def _tensors(reader, src: Path, cfg: ModelConfig, family, to_hf: dict, dtype: torch.dtype, progress: bool,
             quantization: str) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Each tensor under its Hugging Face name, converted as it is reached and its file pages released after, so
    that a conversion holds one tensor at a time (rope_freqs.weight goes into cfg instead)."""
    from gguf.quants import dequantize

    arch = cfg.architecture
    for t in tqdm(
        reader.tensors, desc=f"converting {src.name}", unit="tensor", disable=not progress, file=sys.stderr
    ):
        parts = t.name.split(".")
        w = None
        if quantization != "none" and len(t.shape) in (2, 3):
            # GGUF lists dimensions innermost first; experts stacked in 3-D ([K, N, E]) become E * N rows
            n, k = int(np.prod([int(d) for d in t.shape[1:]])), int(t.shape[0])
            w = _from_gguf_rows(np.asarray(t.data).reshape(n, -1), t.tensor_type.name, n, k)
            if w is None and quantization in ("int8", "int4") and k % 32 == 0 and t.name != "rope_freqs.weight":
                dense = dequantize(t.data, t.tensor_type).reshape(n, k)
                w = quantize(torch.from_numpy(np.array(dense, dtype=np.float32)), quantization)
        if w is None:
            w = _float_tensor(t, dequantize)
        reader.release(t)
        if t.name == "rope_freqs.weight":
            cfg.rope_scaling = {"type": "freq_factors", "factors": w.float().tolist()}
            continue
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if kind not in to_hf:
                raise ModelLoadError(f"{src}: unexpected tensor {t.name!r}")
            if family.gguf_permuted_qk and arch == "llama" and kind in ("attn_q", "attn_k"):
                w = _unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
            name = f"model.layers.{layer}.{to_hf[kind]}.{suffix}"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            raise ModelLoadError(f"{src}: unexpected tensor {t.name!r}")
        if isinstance(w, QuantWeight):
            yield name, w
            continue
        if family.gguf_norm_offset and name.endswith("norm.weight"):
            w = w.float() + family.gguf_norm_offset  # llama.cpp stores Gemma's norms as 1 + w
        yield name, w.to(dtype)
        del w


_CONVERT_WEIGHTS = 1 << 22  # a quantized tensor is repacked about so many weights at a time


def _from_gguf_rows(data: np.ndarray, kind: str, n: int, k: int) -> QuantWeight | None:
    """from_gguf of blocks [n, bytes a row], a few MiB of rows at a time into the result's tensors: repacking a
    stacked expert tensor whole unpacked all of its values to bytes on the way (several times its size)."""
    rows = max(1, _CONVERT_WEIGHTS // k)
    if n <= rows:
        return from_gguf(data, kind, n, k)
    first, out = None, {}
    for r in range(0, n, rows):
        w = from_gguf(data[r : r + rows], kind, min(rows, n - r), k)
        if w is None:
            return None
        if first is None:
            first = w
            out = {f: torch.empty((n, *v.shape[1:]), dtype=v.dtype)
                   for f in ("qweight", "scales", "mins", "sup", "supm") if (v := getattr(w, f)) is not None}
        for f, dest in out.items():
            dest[r : r + w.out_features] = getattr(w, f)
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    return type(first)(**{**fields, **out})


def _float_tensor(t, dequantize) -> torch.Tensor:
    """A float or dequantized GGUF tensor in PyTorch, one copy out of the mapped file: F32/F16/BF16 as stored (not
    widened to float32 first, as gguf's dequantize does), other formats dequantized to float32."""
    kind = t.tensor_type.name
    if kind == "BF16":  # raw bytes [..., 2 K]
        return torch.from_numpy(np.array(t.data)).view(torch.bfloat16)
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.array(t.data))
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
