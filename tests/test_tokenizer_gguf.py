"""SentencePiece vocabularies read from GGUF files give the token ids transformers gives for the same file: the
real Gemma 3 270M (the gemma3 extra) and a small Llama-style vocabulary written here with the gguf package."""

from __future__ import annotations

import hashlib
import json

import pytest

from waferscale.models.chat_template import ChatTemplate
from waferscale.models.gguf_file import read_gguf_file
from waferscale.models.gguf_vocab import eos_token_ids, merges_from_vocab
from waferscale.models.source import GEMMA3_270M, model_source
from waferscale.models.tokenizer import ModelTokenizer

TEXTS = [
    "Hello world",
    "hello",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "two  spaces   and    four",
    "tab\there",
    "line one\nline two\n\nline four\n",
    "\n\nstarts with newlines",
    "Ünïcödé façade — naïve café",
    "日本語のテキストと中文",
    "Здравствуй, мир!",
    "emoji 🙂🚀 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "digits 1234567890 and 3.14159, 2,500",
    "0.000001 1e-9 -42",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already has a bos",
    "text<eos>after eos",
    "[multimodal] a user-defined token",
    "<unused0> an unused control token",
    "mixed<start_of_turn> no newline after",
    "URL: https://example.com/path?q=1&r=two#frag",
    "e-mail someone@example.org, ok?",
    "a",
    " ",
    "",
    "\u2581 a literal sentencepiece space",
    "ZWJ\u200djoin and nbsp\u00a0here",
    "\x00\x01 control bytes \x7f",
    "Ω≈ç√∫˜µ≤≥÷ symbols",
    "ALL CAPS SHOUTING and MiXeD cAsE",
    "It's a dog's life; they're 'quoted' \"double\"",
    "😀" * 5 + " repeated",
]


def test_gemma_3_270m_is_a_built_in_model_name(gemma3_gguf):
    assert model_source("gemma-3-270m") == gemma3_gguf
    digest = hashlib.sha256()
    with open(gemma3_gguf, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    assert digest.hexdigest() == GEMMA3_270M.sha256


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_gemma_token_ids_are_transformers_ids(gemma_tokenizers, text):
    ours, theirs = gemma_tokenizers
    assert ours.encode(text) == theirs.encode(text)


def test_gemma_prompts_start_with_bos_and_no_prefix_space(gemma_tokenizers):
    ours, _ = gemma_tokenizers
    ids = ours.encode("Hello")
    assert ids[0] == ours.info.bos_token_id == 2
    assert ours.decode(ids) == "Hello"


def test_gemma_chat_markers_are_one_token_each(gemma_tokenizers):
    ours, _ = gemma_tokenizers
    ids = ours.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert [ours.token_text(i) for i in (ids[1], ids[-1])] == ["<start_of_turn>", "<end_of_turn>"]


def test_gemma_end_of_turn_ends_generation(gemma_tokenizers):
    ours, theirs = gemma_tokenizers
    end_of_turn = theirs.convert_tokens_to_ids("<end_of_turn>")
    assert set(ours.eos_token_ids) == {theirs.eos_token_id, end_of_turn}


def test_a_gemma_chat_prompt_from_the_default_template_is_tokenized_as_transformers_does(gemma_tokenizers):
    ours, theirs = gemma_tokenizers
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And  3 + 3?\n"},
    ]
    text = ChatTemplate.for_tokenizer(ours).render(messages)
    ids = ours.tokenizer.encode(text, add_special_tokens=False).ids  # as the chat endpoint encodes a prompt
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, theirs.convert_tokens_to_ids("<start_of_turn>")] and ids.count(2) == 1


def test_only_a_control_token_that_ends_a_turn_ends_generation():
    meta = {
        "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<end_of_turn>", "<|im_end|>"],
        "tokenizer.ggml.token_type": [3, 3, 3, 1],  # <|im_end|> as plain text here
        "tokenizer.ggml.eos_token_id": 1,
    }
    assert eos_token_ids(meta) == [1, 2]


def test_gemma_ids_decode_to_transformers_text(gemma_tokenizers):
    ours, theirs = gemma_tokenizers
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_a_saved_gemma_tokenizer_loads_with_the_same_ids(gemma_tokenizers, tmp_path):
    ours, _ = gemma_tokenizers
    ours.save(tmp_path)
    again = ModelTokenizer.load_saved(tmp_path)
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert again.eos_token_ids == ours.eos_token_ids


# A small SentencePiece vocabulary in the Llama 2 / Mistral (and Phi-3) layout: <unk> <s> </s>, 256 byte tokens, pieces scored
# best first, two control tokens and a user-defined one.
PIECES = [
    "\u2581",
    "e",
    "t",
    "h",
    "l",
    "o",
    "\u2581t",
    "he",
    "\u2581the",
    "ll",
    "llo",
    "\u2581he",
    "\u2581hello",
    "w",
    "r",
    "d",
    "\u2581w",
    "or",
    "\u2581wor",
    "ld",
    "\u2581world",
    "1",
    "2",
    "12",
    ",",
    "!",
    "a",
    "n",
    "\u2581a",
    "an",
    "\u2581an",
    "\u2581\u2581",
    "\u2581\u2581\u2581",
]
SMALL_TEXTS = [
    "hello world",
    " hello world",
    "  the  world",
    "hello\nworld",
    "the 12 worlds!",
    "ünknown 字 bytes 🙂",
    "[INST] hello [/INST] world",
    "hello<tool>world",
    "<s>the",
    "",
    "world ",
]


@pytest.fixture(scope="module", params=["llama", "phi3"])  # phi3: the space prefix from a normalizer
def small_gguf(request, tmp_path_factory):
    import gguf

    folder = tmp_path_factory.mktemp(f"spm-{request.param}")
    path = folder / "small-spm.gguf"
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    tokens += ["[INST]", "[/INST]", "<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [3, 3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0] * 3
    writer = gguf.GGUFWriter(str(path), request.param)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", SMALL_TEXTS, ids=range(len(SMALL_TEXTS)))
def test_a_llama_sentencepiece_vocabulary_gives_transformers_ids(small_gguf, text):
    from transformers import LlamaTokenizer

    theirs = LlamaTokenizer.from_pretrained(str(small_gguf.parent), gguf_file=small_gguf.name)
    ours = ModelTokenizer.from_gguf_metadata(read_gguf_file(small_gguf).metadata)
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)


def test_a_llama_sentencepiece_vocabulary_is_transformers_tokenizer(small_gguf):
    from transformers import LlamaTokenizer

    theirs = LlamaTokenizer.from_pretrained(str(small_gguf.parent), gguf_file=small_gguf.name)
    ours = ModelTokenizer.from_gguf_metadata(read_gguf_file(small_gguf).metadata)
    assert json.loads(ours.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())


def test_a_llama_vocabulary_prefixes_one_space_and_adds_bos_when_the_file_is_silent(small_gguf):
    ours = ModelTokenizer.from_gguf_metadata(read_gguf_file(small_gguf).metadata)
    ids = ours.encode("hello world")
    assert ids[0] == 1
    assert [ours.tokenizer.id_to_token(i) for i in ids[1:]] == ["\u2581hello", "\u2581world"]


def test_merges_from_a_vocabulary_follow_the_ranks_then_the_longer_left_piece():
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    ranks = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -2.0, "abc": -1.0}
    assert merges_from_vocab(vocab, ranks) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
