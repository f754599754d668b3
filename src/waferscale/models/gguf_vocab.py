"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer`, built as transformers builds it for
the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so that both give the same token ids:
byte-level BPE (`tokenizer.ggml.model` gpt2) and SentencePiece vocabularies (llama: Llama 2, Mistral, Gemma), the
latter as a BPE with byte fallback whose merges come from the file or, when it has none, from its vocabulary."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

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
CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"  # SentencePiece's visible space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# Control tokens that end a chat turn, as llama.cpp counts them among end-of-generation tokens: a GGUF names only
# one EOS (Gemma's `<eos>`), while a chat turn ends with the template's marker (Gemma's `<end_of_turn>`).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


def gguf_vocab_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer `tokenizer.ggml.*` describes, with its control and user-defined tokens added and, where the
    file says so (a SentencePiece vocabulary by default), BOS prepended. ValueError names what is unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = byte_level_bpe(meta)
    elif kind == "llama":
        tok = sentencepiece_bpe(meta)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are); "
            "serve the model's Hugging Face folder instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    vocab = tok.get_vocab()  # a SentencePiece file's tokens of spaces are respelled: those are not added
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == USER_DEFINED and (kind == "gpt2" or tokens[i] in vocab)
        ]
    )
    if kind == "llama":  # transformers adds the named ones as special too (Llama 2's `<unk>` is type UNKNOWN)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in named_special_tokens(meta).values()]
        )
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = int(bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None)
    add_eos = int(bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None)
    if add_bos or add_eos:  # as transformers' update_post_processor writes it
        first = [f"{tokens[bos]}:0"] * add_bos + ["$A:0"] + [f"{tokens[eos]}:0"] * add_eos
        second = [f"{tokens[bos]}:1"] * add_bos + ["$B:1"] + [f"{tokens[eos]}:1"] * add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first),
            pair=" ".join(first + second),
            special_tokens=[(tokens[bos], bos)] * add_bos + [(tokens[eos], eos)] * add_eos,
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end generation: the file's EOS and EOT, and the control tokens that end a chat turn."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids = {meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")}
    ids.update(i for i, t in enumerate(tokens) if t in END_OF_TURN_TOKENS and types[i] == CONTROL)
    return sorted(i for i in ids if i is not None)


def named_special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token as strings, as transformers names them for a GGUF file."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in keys.items()}
    return {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}


def byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE (`gpt2`) with the pre-tokenizer `tokenizer.ggml.pre` names."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"), fuse_unk=False)
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
    return tok


def sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    """A SentencePiece vocabulary as BPE with byte fallback, as transformers' LlamaTokenizer and GemmaTokenizer
    hold it. Llama and Mistral: a space is prefixed to the text's first piece (Metaspace, prepend "first").
    Gemma: no prefix; spaces become `▁` in the normalizer, its tokens of plain spaces are respelled as `▁`s, and
    its merges follow the order of the vocabulary (its scores do not). Phi-3: the prefix from the normalizer."""
    arch = meta.get("general.architecture", "")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if arch in GEMMA_ARCHITECTURES:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: dict[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_vocab(vocab, ranks)
    gemma = arch in GEMMA_ARCHITECTURES
    # the unknown token as GemmaTokenizer and LlamaTokenizer set it (byte fallback spells everything else)
    unk = "<unk>" if gemma else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    fallback = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence(fallback)
        return tok
    if arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([*fallback, decoders.Strip(content=" ", left=1, right=0)])
    return tok


def merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a token into two tokens, best-ranked token first (ties:
    the longer left piece, then the longer right one). transformers' `generate_merges` with scores, step for step,
    so that ties fall the same way."""
    merges: list[tuple[str, str, float]] = []
    for merge, rank in ranks.items():
        local = [
            (merge[:k], merge[k:], rank)
            for k in range(1, len(merge))
            if merge[:k] in vocab and merge[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
