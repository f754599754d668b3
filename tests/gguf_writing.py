"""Writing small GGUF files of transformers' models for tests, as llama.cpp's convert_hf_to_gguf.py lays them out:
the built-in model's tokenizer, the hyperparameters every family shares, then the family's tensors."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from waferscale.models.gguf_file import read_gguf_file
from waferscale.models.source import builtin_model_path


def f32(t: torch.Tensor) -> np.ndarray:
    """A tensor as the float32 array GGUFWriter stores."""
    return t.detach().float().numpy().copy()


def moe_writer(path, arch: str, cfg, *, experts: int, expert_ffn: int) -> gguf.GGUFWriter:
    """A GGUFWriter for `arch` holding the built-in model's tokenizer and a mixture-of-experts config's shapes."""
    src = read_gguf_file(builtin_model_path())
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in src.metadata.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, value, *src.value_types[key])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(expert_ffn)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def finish(writer: gguf.GGUFWriter, state: dict[str, torch.Tensor]) -> None:
    """The final norm and the output head, then the file written and closed."""
    writer.add_tensor("output_norm.weight", f32(state["model.norm.weight"]))
    writer.add_tensor("output.weight", f32(state["lm_head.weight"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
