"""A tiny model in gpt-oss's format, for tests: a byte-level BPE tokenizer with harmony's special tokens (gpt-oss's
own o200k_harmony vocabulary is not available offline) and gpt-oss's chat template, beside a tiny random Llama
made by transformers. The family does not matter for the format: what the server sees is the template, the special
tokens and the stop tokens (generation_config's eos_token_id lists <|return|> and <|call|>, as gpt-oss's does)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from waferscale.models.default_templates import gpt_oss_template

# o200k_harmony's special tokens that the format uses (ids differ: these are appended to a small vocabulary)
HARMONY_TOKENS = (
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
_CORPUS = [
    "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2026-12-03\n",
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.\n",
    "# Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n// Current weather\n",
    'type get_weather = (_: {\ncity: "Paris" | "Lyon",\nunit?: "c" | "f",\n}) => any;\n\n} // namespace functions\n',
    '{"city": "Paris", "unit": "c", "answer": true, "temperature": 21}\n',
    "The user asks about the weather in Paris. We should call the tool. It is sunny and 21 degrees.\n",
]


def harmony_tokenizer() -> Tokenizer:
    """A byte-level BPE (any text encodes) of about 700 tokens, trained in milliseconds, plus harmony's tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    return tok


def write_tokenizer(folder: Path) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json (gpt-oss's template) and generation_config.json's stop tokens."""
    tok = harmony_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "chat_template": gpt_oss_template(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    stops = [tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return tok


def write_model(folder: Path) -> Path:
    """A tiny random Llama (float32 safetensors) with the harmony tokenizer, ready for `waferscale serve`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = write_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.token_to_id("<|return|>"),
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)  # save_pretrained writes its own generation_config.json
    return folder
