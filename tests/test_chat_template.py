"""Chat templates rendered by waferscale give the same prompt token ids as transformers' apply_chat_template.

Three tokenizers: the built-in SmolLM2 (ours read from the GGUF metadata, transformers' from the same GGUF file,
both cached under .cache/ because the GGUF reads take seconds), and small Hugging Face folders built here that
carry the vendored Qwen2.5, Llama 3.2 and Qwen3 templates (tests/data/templates) over the built-in vocabulary
plus the special tokens each template writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import BPE

import waferscale.models.tokenizer as tokenizer_module
from waferscale.models import builtin_model_path
from waferscale.models.chat_template import DEFAULT_CHATML, ChatTemplate, TemplateError, fallback_tools_block
from waferscale.models.tokenizer import ModelTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city, e.g. «Zürich»",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now", "parameters": {"type": "object"}},
    },
]
SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about <html> & \"quotes\" and 'apostrophes'."},
]
ONE_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}},
}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [ONE_CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]
TWO_CALL_HISTORY = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            ONE_CALL,
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
]


# ---------------------------------------------------------------- tokenizers


def _gguf_meta(path: Path) -> dict:
    from waferscale.models.gguf_file import read_gguf_file

    return {k: v for k, v in read_gguf_file(path).metadata.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def builtin(request):
    """(transformers tokenizer, ours) for the built-in model, cached once per GGUF file / library version."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    path = builtin_model_path()
    st = path.stat()
    key = hashlib.sha256(
        "|".join(
            [
                str(path.resolve()),
                str(st.st_size),
                str(st.st_mtime_ns),
                transformers.__version__,
                tokenizers.__version__,
                Path(tokenizer_module.__file__).read_text(),
            ]
        ).encode()
    ).hexdigest()[:16]
    cache = ROOT / ".cache" / "test-chat-template" / key
    if not cache.is_dir():
        tmp = cache.with_name(f"{key}.tmp{os.getpid()}")
        (tmp / "hf").mkdir(parents=True, exist_ok=True)
        (tmp / "ours").mkdir(parents=True, exist_ok=True)
        request.getfixturevalue("hf_tokenizer").save_pretrained(str(tmp / "hf"))  # only when not cached
        ModelTokenizer.from_gguf_metadata(_gguf_meta(path)).save(tmp / "ours")
        try:
            tmp.rename(cache)
        except OSError:  # another run finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cache / "hf")), ModelTokenizer.load_saved(cache / "ours")


def _hf_folder(
    folder: Path, base: Path, template: str, config: dict, special: list[str], plain: list[str]
) -> Path:
    """A Hugging Face tokenizer folder: the built-in vocabulary plus `special`/`plain` added tokens."""
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(Path(base) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


FAMILIES = {
    "qwen2.5": (
        "qwen2.5-instruct.jinja",
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>"],
    ),
    "llama3": (
        "llama-3.2-instruct.jinja",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
        [],
    ),
    "qwen3": (
        "qwen3.jinja",
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
    ),
}


@pytest.fixture(scope="module")
def families(builtin, tmp_path_factory):
    """name -> (transformers tokenizer, ours, ChatTemplate) for each vendored template."""
    from transformers import AutoTokenizer

    base = builtin[0].name_or_path  # the cached folder transformers saved
    out = {}
    for name, (file, config, special, plain) in FAMILIES.items():
        folder = _hf_folder(
            tmp_path_factory.mktemp("hf") / name, base, (TEMPLATES / file).read_text(), config, special, plain
        )
        ours = ModelTokenizer.from_hf_folder(folder, {})
        out[name] = (AutoTokenizer.from_pretrained(str(folder)), ours, ChatTemplate.for_tokenizer(ours))
    return out


def _same_as_transformers(hf, ours: ModelTokenizer, template: ChatTemplate, messages, hf_messages=None, **kw):
    """Render both ways; the texts and the token ids must be identical. Returns our text."""
    ours_kw = {k: v for k, v in kw.items() if v is not None}
    text = template.render(messages, **ours_kw)
    ref_text = hf.apply_chat_template(
        hf_messages if hf_messages is not None else messages,
        tokenize=False,
        add_generation_prompt=True,
        **ours_kw,
    )
    assert text == ref_text
    ref_ids = hf.apply_chat_template(
        hf_messages if hf_messages is not None else messages,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
        **ours_kw,
    )
    assert ours.tokenizer.encode(text, add_special_tokens=False).ids == list(ref_ids)
    return text


def _as_system(messages):
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


DEVELOPER = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]


# ---------------------------------------------------------------- the built-in model (SmolLM2, plain ChatML)


def test_builtin_flags_and_tokens(builtin):
    _, ours = builtin
    t = ChatTemplate.for_tokenizer(ours)
    assert (t.supports_tools, t.supports_developer, t.reasoning, t.tool_syntax) == (
        False,
        False,
        False,
        "hermes",
    )
    assert t.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }


@pytest.mark.parametrize(
    "messages",
    [SYSTEM_USER, MULTI_TURN, [{"role": "user", "content": "Only a user, «ünïcode» 🙂 and digits 12345"}]],
    ids=["system-user", "multi-turn", "user-only"],
)
def test_builtin_matches_transformers(builtin, messages):
    hf, ours = builtin
    _same_as_transformers(hf, ours, ChatTemplate.for_tokenizer(ours), messages)


def test_builtin_developer_becomes_system(builtin):
    hf, ours = builtin
    text = _same_as_transformers(hf, ours, ChatTemplate.for_tokenizer(ours), DEVELOPER, _as_system(DEVELOPER))
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")


def test_builtin_tool_fallback(builtin):
    hf, ours = builtin
    t = ChatTemplate.for_tokenizer(ours)
    # tools but no system message: the tool block becomes the system turn (SmolLM2's default system prompt goes)
    text = t.render([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    tool_lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    expected_block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert fallback_tools_block(TOOLS) == expected_block
    assert text == (
        f"<|im_start|>system\n{expected_block}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "«Zürich»" in text  # ensure_ascii=False, like tojson
    # with a system message, the block follows it after a blank line; calls and results become text
    text = t.render(TWO_CALL_HISTORY, tools=TOOLS)
    equivalent = [
        {"role": "system", "content": "Use tools.\n\n" + expected_block},
        TWO_CALL_HISTORY[1],
        {
            "role": "assistant",
            "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>',
        },
    ]
    assert text == hf.apply_chat_template(equivalent, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(equivalent, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.tokenizer.encode(text, add_special_tokens=False).ids == list(ids)
    # history without tools given, and a call whose arguments did not parse (kept as the raw string)
    raw = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c"},
    ]
    assert t.render(raw) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nx<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {bad}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------- Qwen2.5 (tool-aware, Hermes)


def test_qwen25_flags(families):
    t = families["qwen2.5"][2]
    assert (t.supports_tools, t.supports_developer, t.reasoning, t.tool_syntax) == (
        True,
        False,
        False,
        "hermes",
    )
    assert t.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize(
    "messages,tools",
    [
        (SYSTEM_USER, None),
        (MULTI_TURN, None),
        ([{"role": "user", "content": "No system"}], None),
        (SYSTEM_USER, TOOLS),
        ([{"role": "user", "content": "No system, tools"}], TOOLS),
        (TOOL_HISTORY, TOOLS),
        (TWO_CALL_HISTORY, TOOLS),
    ],
    ids=["system-user", "multi-turn", "user-only", "tools", "tools-no-system", "tool-history", "two-calls"],
)
def test_qwen25_matches_transformers(families, messages, tools):
    hf, ours, t = families["qwen2.5"]
    _same_as_transformers(hf, ours, t, messages, tools=tools)


def test_qwen25_developer_becomes_system(families):
    hf, ours, t = families["qwen2.5"]
    _same_as_transformers(hf, ours, t, DEVELOPER, _as_system(DEVELOPER))
    _same_as_transformers(hf, ours, t, DEVELOPER, _as_system(DEVELOPER), tools=TOOLS)


# ---------------------------------------------------------------- Llama 3.2 (tool-aware, JSON with "parameters")


def test_llama3_flags(families):
    t = families["llama3"][2]
    assert (t.supports_tools, t.supports_developer, t.reasoning, t.tool_syntax) == (
        True,
        False,
        False,
        "llama3_json",
    )
    assert t.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@pytest.mark.parametrize(
    "messages,tools",
    [
        (SYSTEM_USER, None),
        (MULTI_TURN, None),
        (SYSTEM_USER, TOOLS),
        (TOOL_HISTORY, TOOLS),
    ],
    ids=["system-user", "multi-turn", "tools", "tool-history"],
)
def test_llama3_matches_transformers(families, messages, tools):
    hf, ours, t = families["llama3"]
    text = _same_as_transformers(hf, ours, t, messages, tools=tools)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    ids = ours.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[0] == ours.tokenizer.token_to_id("<|begin_of_text|>") and ids.count(ids[0]) == 1


def test_llama3_developer_becomes_system(families):
    hf, ours, t = families["llama3"]
    _same_as_transformers(hf, ours, t, DEVELOPER, _as_system(DEVELOPER))


def test_raise_exception_is_template_error(families):
    hf, _, t = families["llama3"]
    with pytest.raises(TemplateError, match="^This model only supports single tool-calls at once!$"):
        t.render(TWO_CALL_HISTORY, tools=TOOLS)
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):  # transformers refuses it too
        hf.apply_chat_template(TWO_CALL_HISTORY, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    with pytest.raises(TemplateError, match="no first user message"):
        t.render([{"role": "system", "content": "s"}], tools=TOOLS)


# ---------------------------------------------------------------- Qwen3 (reasoning)


def test_qwen3_flags(families):
    t = families["qwen3"][2]
    assert (t.supports_tools, t.supports_developer, t.reasoning, t.tool_syntax) == (
        True,
        False,
        True,
        "hermes",
    )


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_matches_transformers(families, enable_thinking):
    hf, ours, t = families["qwen3"]
    text = _same_as_transformers(hf, ours, t, MULTI_TURN, enable_thinking=enable_thinking)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n" if enable_thinking is False else "assistant\n"
    )


def test_qwen3_reasoning_history(families):
    hf, ours, t = families["qwen3"]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Call the tool.",
            "tool_calls": [ONE_CALL],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ]
    # Qwen3's template reads an assistant's content as text: transformers fails on a null one (it drops the key);
    # we retry such a conversation with "" (the reference is given "" directly)
    with pytest.raises(jinja2.UndefinedError):
        hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    with_empty = [messages[0], {**messages[1], "content": ""}, messages[2]]
    text = _same_as_transformers(hf, ours, t, messages, with_empty, tools=TOOLS)
    assert "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n<tool_call>" in text
    # an older name for the reasoning reaches the template as reasoning_content, as transformers aliases it
    renamed = [
        messages[0],
        {**{k: v for k, v in messages[1].items() if k != "reasoning_content"}, "reasoning": "Call the tool."},
        messages[2],
    ]
    assert t.render(renamed, tools=TOOLS) == text


# ---------------------------------------------------------------- the environment


def test_default_chatml():
    t = ChatTemplate(None)
    assert t.source == DEFAULT_CHATML and not t.supports_tools and t.tool_syntax == "hermes"
    assert t.render(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.render(SYSTEM_USER, add_generation_prompt=False).endswith("What is 2 + 2?<|im_end|>\n")


def test_environment_mirrors_transformers():
    t = ChatTemplate(
        "{% generation %}{{ messages[0].content | tojson }}{% endgeneration %}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2,"
        " sort_keys=true) }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{{ strftime_now('%Y') | length }}|{{ bos_token }}|{{ eos_token is defined }}"
        "|{{ tools is none }}|{{ documents is none }}|{% set ns = namespace(n=1) %}{% set ns.n = 2 %}{{ ns.n }}"
        "|{{ dict(a=1) | tojson }}\n  {% if true %}\n  x\n  {% endif %}\n",
        bos_token="<s>",
    )
    out = t.render([{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": "y"}])
    assert (
        out
        == '"é <b>"|{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}|user|4|<s>|False|True|True|2|{"a": 1}\n  x\n'
    )


@pytest.mark.parametrize(
    "source,message",
    [
        ("{{ raise_exception('nope: ' + messages[0].role) }}", "^nope: user$"),
        ("{{ ''.__class__.__mro__ }}", "cannot render"),
        ("{% set ns = namespace(_x=1) %}", "underscore"),
        ("{{ messages[0].content + 1 }}", "cannot render"),
        ("{{ messages.append(1) }}", "cannot render"),  # the sandbox is immutable
    ],
)
def test_template_errors(source, message):
    with pytest.raises(TemplateError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_invalid_template_source():
    with pytest.raises(TemplateError, match="not valid Jinja"):
        ChatTemplate("{% for %}")


def test_none_values_dropped_and_input_untouched():
    t = ChatTemplate("{% for m in messages %}{{ m.content is defined }},{{ m | length }};{% endfor %}")
    messages = [{"role": "assistant", "content": None, "name": None}]
    assert t.render(messages) == "False,1;"
    assert messages == [{"role": "assistant", "content": None, "name": None}]


# ---------------------------------------------------------------- a model that ships no template

# Gemma 3's instruct template, verbatim (the chat_template of google/gemma-3-*-it, as the ggml-org/gemma-3-1b-it-GGUF
# and gemma-3-12b-it-GGUF files carry it): the reference for the default given to Gemma models that ship none.
GEMMA3_IT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    '    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)


def untemplated_tokenizer(architecture: str) -> ModelTokenizer:
    """A tokenizer whose model ships no chat template (a base model's GGUF)."""
    extra = {"special_tokens": {"bos_token": "<bos>"}, "architecture": architecture}
    info = tokenizer_module.TokenizerInfo(eos_token_ids=[1], bos_token_id=2, extra=extra)
    return ModelTokenizer(Tokenizer(BPE()), info)


@pytest.mark.parametrize(
    "messages", [SYSTEM_USER, MULTI_TURN, MULTI_TURN[1:]], ids=["system", "multi-turn", "no-system"]
)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_gemma_model_without_a_template_gets_the_turns_gemmas_own_template_writes(
    messages, generation_prompt
):
    ours = ChatTemplate.for_tokenizer(untemplated_tokenizer("gemma3"))
    gemma = ChatTemplate(GEMMA3_IT_TEMPLATE, bos_token="<bos>")
    text = ours.render(messages, add_generation_prompt=generation_prompt)
    assert text == gemma.render(messages, add_generation_prompt=generation_prompt)
    assert text.startswith("<bos><start_of_turn>user\n")


def test_the_gemma_default_folds_the_system_message_into_the_first_user_turn():
    text = ChatTemplate.for_tokenizer(untemplated_tokenizer("gemma3")).render(SYSTEM_USER)
    assert (
        text
        == "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_the_gemma_default_renders_roles_out_of_turn_as_user_turns():
    messages = [*MULTI_TURN, {"role": "user", "content": "Another."}, {"role": "tool", "content": "42"}]
    text = ChatTemplate.for_tokenizer(untemplated_tokenizer("gemma")).render(messages)
    assert text.endswith(
        "<start_of_turn>user\nAnother.<end_of_turn>\n"
        "<start_of_turn>user\n<tool_response>\n42\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3", ""])
def test_other_families_without_a_template_get_chatml(architecture):
    t = ChatTemplate.for_tokenizer(untemplated_tokenizer(architecture))
    assert t.source == DEFAULT_CHATML and t.is_default
