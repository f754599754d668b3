"""The model's tokenizer: a `tokenizers.Tokenizer` plus the facts generation needs (EOS, BOS, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Pre-tokenizer split patterns llama.cpp names in `tokenizer.ggml.pre` (the same ones the models' tokenizer.json use).
_LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


@dataclass
class TokenizerInfo:
    """What a tokenizer.json alone does not say: special ids, BOS policy and the chat template."""

    eos_token_ids: list[int]
    bos_token_id: int | None = None
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelTokenizer:
    """Encodes prompts as the model's tokenizer config says and decodes ids back to text."""

    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo):
        self.tokenizer = tokenizer
        self.info = info
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._piece_cache: dict[int, str] = {}

    @property
    def eos_token_ids(self) -> list[int]:
        return self.info.eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each, the character offset in `text` where it starts (0 for added BOS)."""
        enc = self.tokenizer.encode(text, add_special_tokens=True)
        return enc.ids, [start for start, _ in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, the way logprobs show it (special tokens by name)."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._piece_cache[token_id] = piece
        return piece

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "waferscale_tokenizer.json").write_text(json.dumps(self.info.__dict__))

    @classmethod
    def load_saved(cls, folder: Path) -> ModelTokenizer:
        info = TokenizerInfo(**json.loads((folder / "waferscale_tokenizer.json").read_text()))
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), info)

    @classmethod
    def from_hf_folder(cls, folder: Path, config: dict[str, Any]) -> ModelTokenizer:
        """tokenizer.json plus tokenizer_config.json / generation_config.json for EOS and the chat template."""
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")
        eos: list[int] = []
        for source in (gcfg.get("eos_token_id"), config.get("eos_token_id")):
            if source is None:
                continue
            eos.extend(source if isinstance(source, list) else [source])
        eos_tok = tcfg.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if isinstance(eos_tok, str) and tok.token_to_id(eos_tok) is not None:
            eos.append(tok.token_to_id(eos_tok))
        named = _named_special_tokens(tcfg, _read_json(folder / "special_tokens_map.json"))
        template = tcfg.get("chat_template")
        if (
            template is None and (folder / "chat_template.jinja").is_file()
        ):  # newer transformers save it apart
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: keep the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            tok,
            TokenizerInfo(
                eos_token_ids=sorted(set(eos)),
                bos_token_id=gcfg.get("bos_token_id", config.get("bos_token_id")),
                chat_template=template,
                extra={"special_tokens": named},
            ),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelTokenizer:
        """Build a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata (the `gpt2` model family)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "serve the model's Hugging Face folder instead"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        pre = meta.get("tokenizer.ggml.pre", "default")
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(
            models.BPE(
                vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"), fuse_unk=False
            )
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        if pre in ("llama-bpe", "llama3", "smaug-bpe"):
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"), byte_level]
            )
        elif pre in ("qwen2", "deepseek-r1-qwen"):
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"), byte_level]
            )
        elif pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        elif pre in ("default", "gpt-2", "gpt2"):
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported; serve the Hugging Face folder instead"
            )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t == _CONTROL
            ]
        )
        tok.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == _USER_DEFINED
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        eos_ids = sorted({i for i in (eos, eot) if i is not None})
        # the special-token strings chat templates see, as transformers names them for a GGUF file
        unk, pad = meta.get("tokenizer.ggml.unknown_token_id"), meta.get("tokenizer.ggml.padding_token_id")
        ids = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
        named = {k: tokens[i] for k, i in ids.items() if i is not None and 0 <= i < len(tokens)}
        return cls(
            tok,
            TokenizerInfo(
                eos_token_ids=eos_ids,
                bos_token_id=bos,
                chat_template=meta.get("tokenizer.chat_template"),
                extra={"special_tokens": named},
            ),
        )


def _named_special_tokens(tcfg: dict[str, Any], legacy_map: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (tokenizer_config.json over the legacy special_tokens_map.json)."""
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = tcfg.get(name) or legacy_map.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
