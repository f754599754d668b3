"""The model's tokenizer: a `tokenizers.Tokenizer` plus the facts generation needs (EOS, BOS, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from waferscale.models.gguf_vocab import eos_token_ids, gguf_vocab_tokenizer, named_special_tokens


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
                extra={"special_tokens": named, "architecture": config.get("model_type") or ""},
            ),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelTokenizer:
        """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes (byte-level BPE or SentencePiece), its
        ids those transformers gives for the same file."""
        return cls(
            gguf_vocab_tokenizer(meta),
            TokenizerInfo(
                eos_token_ids=eos_token_ids(meta),
                bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                chat_template=meta.get("tokenizer.chat_template"),
                extra={
                    "special_tokens": named_special_tokens(meta),
                    "architecture": meta.get("general.architecture") or "",
                },
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
