"""waferscale.api.tools: every grammar compiled by llguidance and run through matchers (no model, no server)."""

from __future__ import annotations

import enum
import json
import re
import uuid
from typing import Literal, Optional

import llguidance
import pytest
from openai import pydantic_function_tool
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from waferscale.api.errors import APIError
from waferscale.api.tools import (
    FORMATS,
    grammar_special_tokens,
    new_tool_call_id,
    parse_tool_calls,
    response_format_grammar,
    tool_grammar,
    validate_conversation,
    validate_strict_schema,
)

# ------------------------------------------------------------------------------------------------ tokenizers

_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n',
    '{"name": "get_time", "parameters": {"tz": "UTC"}}; <tool_call>\n</tool_call>\n',
    "Hello world, the weather is nice today. Sure, let me check that for you.\n",
]


def _tokenizer(tool_tags: bool) -> Tokenizer:
    """A small byte-level BPE (like the built-in model's), trained in a few ms. With `tool_tags`, <tool_call> and
    </tool_call> are added tokens, as in the Qwen2.5/Qwen3 tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|im_end|>"]
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    if tool_tags:
        tok.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")]
        )
    return tok


class Env:
    def __init__(self, tool_tags: bool):
        self.hf = _tokenizer(tool_tags)
        eos = self.hf.token_to_id("<|im_end|>")
        # as engine/grammar.py builds it
        self.ll = llguidance.LLTokenizer(self.hf.to_str(), n_vocab=self.hf.get_vocab_size(), eos_token=[eos])
        self.specials = grammar_special_tokens(self.hf)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def feed(self, grammar: str, text: str) -> llguidance.LLMatcher | None:
        """The matcher after consuming `text` (tokenized as the model would emit it), or None if rejected."""
        m = self.matcher(grammar)
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return m if m.consume_tokens(ids) else None

    def complete(self, grammar: str, text: str) -> bool:
        """`text` is a whole valid output: every token accepted and the grammar may end (EOS allowed) there."""
        m = self.feed(grammar, text)
        return m is not None and m.is_accepting()

    def rejects(self, grammar: str, text: str) -> bool:
        """Some token of `text` is masked out: the model could not produce it."""
        return self.feed(grammar, text) is None


PLAIN = Env(tool_tags=False)
TAGGED = Env(tool_tags=True)
ENVS = [pytest.param(PLAIN, id="text-tags"), pytest.param(TAGGED, id="token-tags")]


def test_tokenizers_behave_as_the_models_do():
    assert PLAIN.specials == {"<|im_end|>"}
    # llguidance makes every added token spelled <...> special, even with special=False (Qwen's <tool_call>)
    assert {"<tool_call>", "</tool_call>"} <= TAGGED.specials
    tid = TAGGED.hf.token_to_id("<tool_call>")
    assert TAGGED.ll.is_special_token(tid)
    assert TAGGED.hf.encode("<tool_call>\n", add_special_tokens=False).ids[0] == tid


# ------------------------------------------------------------------------------------------------ fixtures

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"anyOf": [{"type": "string", "enum": ["c", "f"]}, {"type": "null"}]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {  # not strict (an optional property would be refused in strict mode): still constrained, leniently
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "minLength": 2}},
            "required": ["tz"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: arguments are {}
TOOLS = [WEATHER, TIME, PING]


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def llama(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


W1 = hermes("get_weather", '{"city": "Paris", "unit": null}')
W2 = hermes("get_weather", '{"city": "Oslo", "unit": "c"}')
T1 = hermes("get_time", '{"tz": "UTC"}')
P1 = hermes("ping", "{}")
BAD_ARGS = [
    hermes("get_weather", '{"city": 1, "unit": null}'),  # wrong type
    hermes("get_weather", '{"city": "Paris"}'),  # missing required
    hermes("get_weather", '{"city": "Paris", "unit": "k"}'),  # not in enum
    hermes("get_weather", '{"city": "Paris", "unit": null, "x": 1}'),  # additional property
    hermes("get_time", '{"tz": "U"}'),  # non-strict, minLength enforced
    hermes("get_time", "{}"),  # non-strict, missing required
    hermes("ping", '{"a": 1}'),  # no parameters
    hermes("get_wether", "{}"),  # unknown tool
    '<tool_call>\n{"name": "get_weather", "args": {"city": "Paris", "unit": null}}\n</tool_call>',
]
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


# ------------------------------------------------------------------------------------------------ hermes


@pytest.mark.parametrize("env", ENVS)
def test_hermes_auto_accepts_text_and_calls(env: Env):
    g = tool_grammar(TOOLS, "auto", True, "hermes", special_tokens=env.specials)
    for text in [
        "Hello!",
        "",
        "It is sunny.\nAnything else?",
        W1,
        T1,
        P1,
        "Sure.\n" + W1,
        W1 + "\n" + T1,
        W1 + T1,
    ]:
        assert env.complete(g, text), text
    for text in BAD_ARGS:
        assert env.rejects(g, text), text
    assert env.rejects(g, "Let me check: " + BAD_ARGS[0])
    # a started call is completed: no EOS inside it, and text cannot follow the calls
    assert not env.feed(g, W1[: W1.index("null")]).is_accepting()
    assert env.rejects(g, W1 + "\nDone.")


@pytest.mark.parametrize("env", ENVS)
def test_hermes_auto_without_parallel_stops_after_one_call(env: Env):
    g = tool_grammar(TOOLS, "auto", False, "hermes", special_tokens=env.specials)
    assert env.complete(g, "Hi") and env.complete(g, "Checking.\n" + W1)
    m = env.feed(g, W1)
    assert m.is_accepting() and m.is_stopped()  # the engine ends the sequence here
    assert env.rejects(g, W1 + "\n" + T1) and env.rejects(g, W1 + T1)


@pytest.mark.parametrize("env", ENVS)
def test_hermes_none_never_starts_a_call(env: Env):
    g = tool_grammar(TOOLS, "none", True, "hermes", special_tokens=env.specials)
    assert env.complete(g, "Hello, no tools today.") and env.complete(g, "")
    for text in [W1, "Sure.\n" + W1, "<tool_call>"]:
        assert env.rejects(g, text), text
    assert env.complete(g, "a <tool_cal b")  # only the tag itself is excluded
    if env is TAGGED:  # the special token is masked at the first step
        mask = env.matcher(g).compute_logit_bias()
        assert mask[env.hf.token_to_id("<tool_call>")] == 0


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("parallel", [True, False])
def test_hermes_required(env: Env, parallel: bool):
    g = tool_grammar(TOOLS, "required", parallel, "hermes", special_tokens=env.specials)
    assert env.rejects(g, "Hello") and env.rejects(g, "Sure.\n" + W1)
    assert not env.matcher(g).is_accepting()  # EOS before a call is not allowed
    assert env.complete(g, W1) and env.complete(g, P1) and env.complete(g, "\n" + T1)
    assert env.complete(g, W1 + "\n" + T1 + "\n" + W2) == parallel
    assert env.feed(g, W1).is_stopped() == (not parallel)
    for text in BAD_ARGS:
        assert env.rejects(g, text), text


@pytest.mark.parametrize("env", ENVS)
def test_hermes_named_calls_that_function_once(env: Env):
    g = tool_grammar(TOOLS, NAMED_TIME, True, "hermes", special_tokens=env.specials)
    assert env.complete(g, T1) and env.feed(g, T1).is_stopped()
    for text in ["Hello", W1, P1, T1 + "\n" + T1, hermes("get_time", '{"tz": 5}')]:
        assert env.rejects(g, text), text


def test_hermes_whitespace_is_bounded():
    g = tool_grammar(TOOLS, "required", True, "hermes")
    assert PLAIN.complete(g, '<tool_call>{"name":"ping","arguments":{}}</tool_call>')  # compact
    assert PLAIN.complete(
        g, '<tool_call>\n{\n  "name": "get_time",\n  "arguments": {\n    "tz": "UTC"\n  }\n}\n</tool_call>'
    )
    assert PLAIN.rejects(g, '<tool_call>\n\n\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert PLAIN.rejects(g, '<tool_call>\n{"name":  "ping", "arguments": {}}\n</tool_call>')
    assert PLAIN.rejects(g, hermes("get_time", '{"tz":  "UTC"}'))
    assert PLAIN.rejects(g, hermes("get_time", '{"tz": "UTC"\n\n}'))


def test_hermes_grammar_names_tags_as_tokens_only_when_they_are():
    text = tool_grammar(TOOLS, "required", True, "hermes")
    assert '"<tool_call>"' in text and '"</tool_call>"' in text
    text = tool_grammar(TOOLS, "required", True, "hermes", special_tokens=TAGGED.specials)
    assert "call: <tool_call> WS? body WS? </tool_call>" in text
    # the token form does not compile for a tokenizer without the token, and spelled-out tags are refused with it
    assert llguidance.LLMatcher(PLAIN.ll, text, log_level=0).is_error()
    g = tool_grammar(TOOLS, "required", True, "hermes", special_tokens=TAGGED.specials)
    spelled = TAGGED.ll.tokenize_str("<")
    assert TAGGED.matcher(g).validate_tokens(spelled) == 0


# ------------------------------------------------------------------------------------------------ llama3_json


def test_llama3_json_modes():
    w = llama("get_weather", '{"city": "Paris", "unit": null}')
    p = llama("ping", "{}")
    auto = tool_grammar(TOOLS, "auto", True, "llama3_json")
    for text in ["Hello", "", "Use {braces} later", w, " " + p, "\n" + w]:
        assert PLAIN.complete(auto, text), text
    assert PLAIN.feed(auto, w).is_stopped()  # one call per turn, even with parallel_tool_calls
    for text in [
        w + "; " + p,
        llama("get_weather", '{"city": 1, "unit": null}'),
        llama("nope", "{}"),
        hermes("ping", "{}")[len("<tool_call>\n") :],
        '{"a": 1}',
    ]:
        assert PLAIN.rejects(auto, text), text
    none = tool_grammar(TOOLS, "none", True, "llama3_json")
    assert PLAIN.complete(none, "Hello") and PLAIN.complete(none, "")
    assert PLAIN.rejects(none, w) and PLAIN.rejects(none, "  " + p)
    required = tool_grammar(TOOLS, "required", True, "llama3_json")
    assert PLAIN.rejects(required, "Hello") and PLAIN.complete(required, p)
    assert not PLAIN.matcher(required).is_accepting()
    named = tool_grammar(TOOLS, {"type": "function", "function": {"name": "ping"}}, False, "llama3_json")
    assert PLAIN.complete(named, p) and PLAIN.rejects(named, w)


# ------------------------------------------------------------------------------------------------ tool checks


def test_no_tools_no_grammar():
    assert tool_grammar(None, None, True, "hermes") is None
    assert tool_grammar([], "auto", True, "llama3_json") is None
    with pytest.raises(ValueError):
        tool_grammar(TOOLS, "auto", True, "pythonic")


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "auto", "tools[0].function.name"),
        ([PING, PING], "auto", "tools[1].function.name"),
        ([{"type": "retrieval"}], "auto", "tools[0].type"),
        ([PING], "sometimes", "tool_choice"),
        ([PING], {"type": "function", "function": {"name": "pong"}}, "tool_choice.function.name"),
        ([PING], {"type": "function"}, "tool_choice"),
    ],
)
def test_tool_grammar_rejects_bad_tools(tools, choice, param):
    with pytest.raises(APIError) as e:
        tool_grammar(tools, choice, True, "hermes")
    assert e.value.status_code == 400 and e.value.param == param


def test_strict_tool_parameters_are_validated():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "string"}, "b": {"type": ["string", "null"]}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
    with pytest.raises(APIError) as e:
        tool_grammar([PING, tool], "auto", True, "hermes")
    assert e.value.param == "tools[1].function.parameters.properties.b.type"
    assert "Lists of types" in e.value.message
    # the same schema without strict is used as given (llguidance understands type lists)
    del tool["function"]["strict"]
    g = tool_grammar([tool], "required", True, "hermes")
    assert PLAIN.complete(g, hermes("f", '{"a": "x", "b": null}'))
    assert PLAIN.rejects(g, hermes("f", '{"a": "x", "b": 3}'))


def test_non_strict_schema_llguidance_cannot_compile_falls_back_to_any_object():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
        },
    }
    g = tool_grammar([tool], "required", True, "hermes")
    assert '%json {"type":"object",' in g
    assert PLAIN.complete(g, hermes("f", '{"anything": [1, 2]}'))
    assert PLAIN.rejects(g, hermes("f", "[1]"))


# ------------------------------------------------------------------------------------------------ response_format

PERSON = {
    "type": "object",
    "title": "Person",
    "properties": {
        "name": {"type": "string", "description": "full name"},
        "age": {"type": "integer"},
        "born": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "none": {"type": "array", "items": False},
        "kind": {"const": "person"},
        "partner": {"anyOf": [{"$ref": "#/$defs/ref"}, {"type": "null"}], "default": None},
    },
    "required": ["name", "age", "born", "tags", "none", "kind", "partner"],
    "additionalProperties": False,
    "$defs": {
        "ref": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "next": {"anyOf": [{"$ref": "#/$defs/ref"}, {"type": "null"}]},
            },
            "required": ["name", "next"],
            "additionalProperties": False,
        }
    },
}
GOOD_PERSON = (
    '{"name": "Ada", "age": 36, "born": "1815-12-10", "tags": ["math"], "none": [], "kind": "person", '
    '"partner": {"name": "W", "next": null}}'
)


def _rf(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "p", "strict": strict, "schema": schema}}


def test_response_format_text_and_json_object():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    g = response_format_grammar({"type": "json_object"})
    for text in ['{"a": [1, {"b": null}]}', " {}", '{\n  "a": 1\n}']:
        assert PLAIN.complete(g, text), text
    for text in ["[]", '"x"', "hello", '{"a": 1} more', '{"a":   1}']:
        assert PLAIN.rejects(g, text), text
    assert PLAIN.feed(g, "{}").is_stopped()


def test_response_format_strict_schema():
    g = response_format_grammar(_rf(PERSON))
    assert PLAIN.complete(g, GOOD_PERSON)
    good = json.loads(GOOD_PERSON)
    for change in [
        {"age": "36"},
        {"age": 3.5},
        {"born": "yesterday"},
        {"kind": "cat"},
        {"tags": [1]},
        {"none": ["x"]},
        {"partner": {"name": "W"}},
        {"extra": 1},
    ]:
        doc = {**good, **change}
        assert PLAIN.rejects(g, json.dumps(doc)), change
    missing = dict(good)
    del missing["age"]
    assert PLAIN.rejects(g, json.dumps(missing))


def test_response_format_without_a_schema_is_any_object():
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p"}})
    assert PLAIN.complete(g, '{"anything": true}') and PLAIN.rejects(g, "[1]")


def test_response_format_not_strict_enforces_what_it_can_and_ignores_the_rest():
    schema = {  # not strict mode's subset (an optional property, uniqueItems), never refused for it
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
        "required": ["name"],
    }
    g = response_format_grammar(_rf(schema, strict=False))
    assert PLAIN.complete(g, '{"name": "Ada"}')
    assert PLAIN.complete(g, '{"name": "Ada", "tags": ["x", "x"]}')  # uniqueItems: ignored
    assert not PLAIN.complete(g, '{"name": "Ada Lovelace"}')  # maxLength: enforced
    assert not PLAIN.complete(g, '{"tags": []}')  # required: enforced
    # a schema llguidance cannot compile at all still gets a JSON object
    g = response_format_grammar(
        _rf({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, strict=False)
    )
    assert PLAIN.complete(g, '{"anything": true}') and PLAIN.rejects(g, "[1]")


@pytest.mark.parametrize(
    "rf, param",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            _rf({"type": "string", "enum": [1]}),
            "response_format.json_schema.schema",
        ),  # llguidance: unsatisfiable
    ],
)
def test_response_format_errors(rf, param):
    with pytest.raises(APIError) as e:
        response_format_grammar(rf)
    assert e.value.status_code == 400 and e.value.param == param


# ------------------------------------------------------------------------------------------------ strict subset


def _obj(props: dict, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
        **extra,
    }


S = "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "schema, param, words",
    [
        (
            {**_obj({"a": {"$ref": "#/definitions/x"}}), "definitions": {"x": {"type": "string"}}},
            f"{S}.definitions",
            ["'definitions'", "$defs"],
        ),
        (_obj({"a": {"type": ["string", "null"]}}), f"{S}.properties.a.type", ["Lists of types", "anyOf"]),
        (
            {**_obj({"a": {"type": "string"}, "b": {"type": "string"}}), "required": ["a"]},
            f"{S}.properties.b",
            ["'b'", "required"],
        ),
        ({**_obj({"a": {"type": "string"}}), "required": ["a", "z"]}, f"{S}.required", ["'z'"]),
        (
            {"type": "object", "properties": {}, "required": []},
            f"{S}.additionalProperties",
            ["additionalProperties"],
        ),
        (_obj({}, additionalProperties=True), f"{S}.additionalProperties", ["additionalProperties"]),
        (
            _obj({"a": {"type": "object", "properties": {}, "required": []}}),
            f"{S}.properties.a.additionalProperties",
            ["additionalProperties"],
        ),
        (_obj({"a": {"type": "array", "items": True}}), f"{S}.properties.a.items", ["items: true"]),
        (_obj({"a": {"type": "array"}}), f"{S}.properties.a.items", ["items"]),
        (
            _obj({"a": {"anyOf": [{"type": "null"}] + [{"type": "string"}] * 5}}),
            f"{S}.properties.a.anyOf",
            ["anyOf"],
        ),
        (
            _obj({"a": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}),
            f"{S}.properties.a.uniqueItems",
            ["'uniqueItems'", "cannot enforce", "maxItems"],
        ),
        (_obj({"a": {"not": {"type": "string"}}}), f"{S}.properties.a.not", ["'not'"]),
        (
            _obj({"a": {"type": "string", "minimum": 0}}),
            f"{S}.properties.a.minimum",
            ["'minimum'", "integer"],
        ),
        (_obj({"a": {"type": "string", "maxLength": -1}}), f"{S}.properties.a.maxLength", ["non-negative"]),
        (_obj({"a": {"type": "string", "maxLength": "40"}}), f"{S}.properties.a.maxLength", ["integer"]),
        (
            _obj({"a": {"type": "number", "multipleOf": 0}}),
            f"{S}.properties.a.multipleOf",
            ["greater than 0"],
        ),
        (_obj({"a": {"type": "integer", "maximum": True}}), f"{S}.properties.a.maximum", ["number"]),
        (
            _obj({"a": {"type": "string", "pattern": "(?<=a)b"}}),
            f"{S}.properties.a.pattern",
            ["'pattern'", "look-around"],
        ),
        (_obj({"a": {"type": "string", "pattern": "(ab"}}), f"{S}.properties.a.pattern", ["unclosed group"]),
        (
            _obj({"a": {"type": "array", "prefixItems": [{"type": "string"}]}}),
            f"{S}.properties.a.items",
            ["prefixItems"],
        ),
        (
            _obj({"a": {"oneOf": [{"type": "null"}] + [{"type": "string"}] * 5}}),
            f"{S}.properties.a.oneOf",
            ["oneOf"],
        ),
        (
            _obj({"a": {"allOf": [{"type": "string"}, {"maxLength": 3}]}}),
            f"{S}.properties.a.allOf",
            ["'allOf'", "one schema"],
        ),
        (_obj({"a": {"type": "string", "nullable": True}}), f"{S}.properties.a.nullable", ["'nullable'"]),
        (_obj({"a": {"$ref": "#/$defs/missing"}}), f"{S}.properties.a.$ref", ["$ref"]),
        (_obj({"a": {**_obj({}), "$defs": {}}}), f"{S}.properties.a.$defs", ["$defs"]),
        (_obj({"a": True}), f"{S}.properties.a", ["Boolean schemas"]),
        (_obj({"a": {"description": "no type"}}), f"{S}.properties.a", ["'type'"]),
        (_obj({"a": {"type": "float"}}), f"{S}.properties.a.type", ["'float'"]),
        (_obj({"a": {"type": "string", "format": "color"}}), f"{S}.properties.a.format", ["'format'"]),
        (
            _obj({"a": {"type": "integer", "format": "date"}}),
            f"{S}.properties.a.format",
            ["'format'", "string"],
        ),
        (
            _obj({"a": {"type": "string", "items": {"type": "string"}}}),
            f"{S}.properties.a.items",
            ["'items'", "array"],
        ),
        (_obj({"a": {"enum": []}}), f"{S}.properties.a.enum", ["enum"]),
        (
            _obj({"a": {"anyOf": [{"type": "string", "maxItems": 3}]}}),
            f"{S}.properties.a.anyOf[0].maxItems",
            ["'maxItems'", '"array"'],
        ),
        (
            {**_obj({"a": {"$ref": "#/$defs/x"}}), "$defs": {"x": {"type": "object", "properties": {}}}},
            f"{S}.$defs.x.additionalProperties",
            ["additionalProperties"],
        ),
        ("not a schema", S, ["must be an object"]),
    ],
)
def test_strict_schema_rejections(schema, param, words):
    with pytest.raises(APIError) as e:
        validate_strict_schema(schema, S)
    assert e.value.status_code == 400
    assert e.value.param == param
    for w in words:
        assert w in e.value.message, e.value.message
    with pytest.raises(APIError):  # the same check runs inside response_format_grammar
        response_format_grammar(_rf(schema))


def _pet(kind: str, **extra) -> dict:
    return _obj({"kind": {"type": "string", "const": kind}, **extra})


PETS = {
    **_obj(
        {
            "pet": {
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}},
            }
        }
    ),
    "$defs": {"Cat": _pet("cat", lives={"type": "integer"}), "Dog": _pet("dog", bark={"type": "string"})},
}


def test_strict_schema_accepts_a_discriminated_union():
    """Pydantic's discriminated unions write oneOf + discriminator; the const tags make the branches exclusive."""
    assert '"oneOf"' in response_format_grammar(_rf(PETS))


def test_strict_schema_refuses_a_oneof_whose_branches_overlap():
    schema = _obj({"a": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}})
    with pytest.raises(APIError) as e:
        response_format_grammar(_rf(schema))
    assert e.value.status_code == 400
    assert "'oneOf' branches could overlap" in e.value.message and "const" in e.value.message


def test_strict_schema_accepts_the_subset():
    validate_strict_schema(PERSON, S)
    validate_strict_schema({"type": "string", "enum": ["a", "b"], "title": "t", "examples": ["a"]}, S)
    validate_strict_schema({"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "null"}]}, S)
    validate_strict_schema(
        {
            **_obj({"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}),
            "$schema": "https://json-schema.org/draft/2020-12/schema",
        },
        S,
    )
    for fmt in FORMATS:  # every accepted format also compiles
        response_format_grammar(_rf({"type": "string", "format": fmt}))


def test_pydantic_style_schema_with_annotations():
    schema = {
        "$defs": {"Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"}},
        "properties": {
            "city": {"title": "City", "type": "string"},
            "unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}], "default": None},
        },
        "required": ["city", "unit"],
        "title": "Args",
        "type": "object",
        "additionalProperties": False,
    }
    g = response_format_grammar(_rf(schema))
    assert "title" not in g and "default" not in g  # annotations are dropped from the grammar
    assert PLAIN.complete(g, '{"city": "Rome", "unit": "c"}')
    assert PLAIN.rejects(g, '{"city": "Rome", "unit": "k"}')


def test_strict_schema_enforces_string_number_and_array_constraints():
    schema = _obj(
        {
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "name": {"type": "string", "minLength": 2, "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "step": {"type": "integer", "multipleOf": 5},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
            "point": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "maxItems": 2,
            },
            "ref": {
                "allOf": [{"$ref": "#/$defs/Unit"}],
                "description": "Pydantic's older $ref with annotations",
            },
        },
        **{"$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}},
    )
    g = response_format_grammar(_rf(schema))
    good = {
        "code": "ABC",
        "name": "Ada",
        "age": 36,
        "score": 0.5,
        "step": 15,
        "tags": ["x"],
        "point": [1, "y"],
        "ref": "c",
    }
    assert PLAIN.complete(g, json.dumps(good))
    for change in [
        {"code": "AB"},
        {"code": "abc"},
        {"name": "A"},
        {"name": "Adaline"},
        {"age": -1},
        {"age": 131},
        {"score": 0},
        {"score": 1},
        {"step": 7},
        {"tags": []},
        {"tags": ["a", "b", "c"]},
        {"point": ["y", 1]},
        {"point": [1, "y", 2]},
        {"ref": "k"},
    ]:
        assert not PLAIN.complete(g, json.dumps({**good, **change})), change


# Pydantic v2 models as users write them, converted for strict mode as the OpenAI SDK's `parse` and
# `pydantic_function_tool` do (openai.lib._pydantic.to_strict_json_schema).
class _Role(str, enum.Enum):
    admin = "admin"
    user = "user"


class _Address(BaseModel):
    city: str = Field(min_length=1, max_length=40)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class _Person(BaseModel):
    """A person."""

    name: str = Field(max_length=40, description="full name")
    age: int = Field(ge=0, le=130)
    height: float = Field(gt=0, lt=3.0, multiple_of=0.01)
    role: _Role
    kind: Literal["human", "robot"]
    email: Optional[str] = Field(default=None)  # noqa: UP045 - what users write
    tags: list[str] = Field(min_length=1, max_length=3)
    address: _Address
    previous: list[_Address] = Field(max_length=2)
    nick: _Address | None = None
    point: tuple[int, int]


def test_pydantic_v2_schemas_are_accepted_and_enforced():
    schema = to_strict_json_schema(_Person)
    g = response_format_grammar(_rf(schema))
    person = _Person(
        name="Ada",
        age=36,
        height=1.65,
        role="admin",
        kind="human",
        tags=["math"],
        address={"city": "London", "zip": "12345"},
        previous=[],
        point=(1, 2),
    )
    assert PLAIN.complete(g, person.model_dump_json())
    for change in [{"name": "x" * 41}, {"age": 131}, {"height": 1.655}, {"tags": []}, {"point": [1]}]:
        assert not PLAIN.complete(g, json.dumps({**person.model_dump(mode="json"), **change})), change
    bad_zip = person.model_dump(mode="json")
    bad_zip["address"]["zip"] = "1234"
    assert not PLAIN.complete(g, json.dumps(bad_zip))
    tool = pydantic_function_tool(_Person)
    assert tool["function"]["strict"] is True
    assert tool_grammar([tool], "required", False, "hermes") is not None


def test_zod_style_schemas_are_accepted():
    # as zod-to-json-schema writes z.object({...}) with definitionPath "$defs" (target: draft-07)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},  # z.string().min(1).max(40)
            "email": {"type": "string", "format": "email"},  # .email()
            "site": {"type": "string", "format": "uri"},  # .url()
            "id": {"type": "string", "format": "uuid"},  # .uuid()
            "at": {"type": "string", "format": "date-time"},  # .datetime()
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},  # .regex(/^[A-Z]{3}-\d{4}$/)
            "pin": {"type": "string", "minLength": 4, "maxLength": 4},  # .length(4)
            "count": {"type": "integer", "exclusiveMinimum": 0},  # z.number().int().positive()
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},  # .min(0).max(1)
            "kind": {"type": "string", "const": "order"},  # z.literal("order")
            "status": {"type": "string", "enum": ["open", "closed"]},  # z.enum([...])
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 10},
            "note": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]},  # .max(80).nullable()
        },
        "required": [
            "name",
            "email",
            "site",
            "id",
            "at",
            "sku",
            "pin",
            "count",
            "ratio",
            "kind",
            "status",
            "lines",
            "note",
        ],
        "additionalProperties": False,
        "$defs": {
            "line": {
                "type": "object",
                "properties": {
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number", "multipleOf": 0.5},
                },
                "required": ["qty", "price"],
                "additionalProperties": False,
            }
        },
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    g = response_format_grammar(_rf(schema))
    doc = {
        "name": "Ada",
        "email": "ada@example.com",
        "site": "https://example.com/a",
        "id": str(uuid.UUID(int=7)),
        "at": "2026-01-02T03:04:05Z",
        "sku": "ABC-1234",
        "pin": "0042",
        "count": 3,
        "ratio": 0.25,
        "kind": "order",
        "status": "open",
        "lines": [{"qty": 2, "price": 9.5}],
        "note": None,
    }
    assert PLAIN.complete(g, json.dumps(doc))
    for change in [
        {"email": "ada"},
        {"sku": "AB-1234"},
        {"pin": "42"},
        {"count": 0},
        {"lines": [{"qty": 1, "price": 0.3}]},
    ]:
        assert not PLAIN.complete(g, json.dumps({**doc, **change})), change


def test_extension_keywords_are_annotations():
    schema = _obj({"a": {"type": "string", "x-order": 1, "example": "hi"}}, **{"x-generator": "openapi"})
    g = response_format_grammar(_rf(schema))
    assert "x-order" not in g and "x-generator" not in g and PLAIN.complete(g, '{"a": "hi"}')


# ------------------------------------------------------------------------------------------------ parsing


def test_parse_hermes_round_trip():
    assert parse_tool_calls("Hello there", "hermes") == ("Hello there", [])
    assert parse_tool_calls(W1, "hermes") == (
        None,
        [{"name": "get_weather", "arguments": '{"city":"Paris","unit":null}'}],
    )
    content, calls = parse_tool_calls("Let me look.\n" + W1 + "\n" + T1, "hermes")
    assert content == "Let me look."
    assert calls == [
        {"name": "get_weather", "arguments": '{"city":"Paris","unit":null}'},
        {"name": "get_time", "arguments": '{"tz":"UTC"}'},
    ]
    assert parse_tool_calls("  \n" + P1 + "\n", "hermes") == (None, [{"name": "ping", "arguments": "{}"}])
    # arguments keep the generated key order, number spelling and string contents (only whitespace goes)
    text = hermes("f", '{ "z": 1.50, "a": "x  y\\n",\n  "n": [1e3, -0] }')
    assert parse_tool_calls(text, "hermes")[1] == [
        {"name": "f", "arguments": '{"z":1.50,"a":"x  y\\n","n":[1e3,-0]}'}
    ]
    # text that is not a valid call stays content
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'
    assert parse_tool_calls(broken, "hermes") == (broken, [])
    truncated = W1[:30]
    assert parse_tool_calls(truncated, "hermes") == (truncated, [])


@pytest.mark.parametrize("env", ENVS)
def test_grammar_output_parses_back(env: Env):
    """What the grammar lets through, decoded as the engine would (special tokens kept), parses to the calls."""
    g = tool_grammar(TOOLS, "auto", True, "hermes", special_tokens=env.specials)
    text = "One moment.\n" + W1 + "\n" + P1
    ids = env.hf.encode(text, add_special_tokens=False).ids
    assert env.matcher(g).consume_tokens(ids)
    decoded = env.hf.decode(ids, skip_special_tokens=True)
    content, calls = parse_tool_calls(decoded, "hermes")
    assert content == "One moment." and [c["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": None}


def test_parse_llama3_json():
    w = llama("get_weather", '{"city": "Paris", "unit": null}')
    assert parse_tool_calls(w, "llama3_json") == (
        None,
        [{"name": "get_weather", "arguments": '{"city":"Paris","unit":null}'}],
    )
    assert parse_tool_calls("<|python_tag|>" + w, "llama3_json")[1][0]["name"] == "get_weather"
    _, calls = parse_tool_calls(w + "; " + llama("ping", "{}"), "llama3_json")
    assert [c["name"] for c in calls] == ["get_weather", "ping"]
    assert parse_tool_calls('{"name": "f", "arguments": {"a": 1}}', "llama3_json")[1] == [
        {"name": "f", "arguments": '{"a":1}'}
    ]
    for text in ["Hello", '{"answer": 42}', '{"name": "f", "parameters": 3}', '{"name": "f"', ""]:
        assert parse_tool_calls(text, "llama3_json") == (text, []), text
    with pytest.raises(ValueError):
        parse_tool_calls("x", "pythonic")


# ------------------------------------------------------------------------------------------------ conversation


def _call(cid: str, name: str = "ping") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


def _conv(*msgs) -> list[dict]:
    return [{"role": "user", "content": "hi"}, *msgs]


A2 = {"role": "assistant", "content": None, "tool_calls": [_call("a1"), _call("a2")]}


def test_conversation_ok():
    validate_conversation(
        _conv(
            A2,
            {"role": "tool", "tool_call_id": "a2", "content": "2"},
            {"role": "tool", "tool_call_id": "a1", "content": "1"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "again"},
        ),
        [PING],
        "auto",
    )
    validate_conversation(_conv(), None, None)
    validate_conversation(_conv(), [PING], {"type": "function", "function": {"name": "ping"}})


@pytest.mark.parametrize(
    "messages, tools, choice, param, words",
    [
        (
            _conv(
                A2, {"role": "tool", "tool_call_id": "a1", "content": "1"}, {"role": "user", "content": "?"}
            ),
            [PING],
            None,
            "messages[3]",
            ["'a2'", "messages[1]"],
        ),
        (
            _conv(A2, {"role": "tool", "tool_call_id": "a1", "content": "1"}),
            [PING],
            None,
            "messages[1].tool_calls",
            ["'a2'"],
        ),
        (
            _conv({"role": "tool", "tool_call_id": "zz", "content": "1"}),
            [PING],
            None,
            "messages[1].tool_call_id",
            ["'zz'"],
        ),
        (
            _conv(
                A2,
                {"role": "tool", "tool_call_id": "a1", "content": "1"},
                {"role": "tool", "tool_call_id": "a2", "content": "2"},
                {"role": "user", "content": "?"},
                {"role": "tool", "tool_call_id": "a1", "content": "late"},
            ),
            [PING],
            None,
            "messages[5].tool_call_id",
            ["directly follow"],
        ),
        (
            _conv(
                A2,
                {"role": "tool", "tool_call_id": "a1", "content": "1"},
                {"role": "tool", "tool_call_id": "a1", "content": "1"},
            ),
            [PING],
            None,
            "messages[3].tool_call_id",
            ["'a1'"],
        ),
        (
            _conv({"role": "assistant", "tool_calls": [_call("d"), _call("d")]}),
            [PING],
            None,
            "messages[1].tool_calls[1].id",
            ["Duplicate", "'d'"],
        ),
        (
            _conv(
                A2,
                {"role": "tool", "tool_call_id": "a1", "content": "1"},
                {"role": "tool", "tool_call_id": "a2", "content": "2"},
                {"role": "assistant", "tool_calls": [_call("a1")]},
            ),
            [PING],
            None,
            "messages[4].tool_calls[0].id",
            ["Duplicate"],
        ),
        (
            _conv(
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "x", "function": {"name": "ping", "arguments": {}}}],
                }
            ),
            [PING],
            None,
            "messages[1].tool_calls[0].function.arguments",
            ["JSON string"],
        ),
        (_conv(), None, "auto", "tool_choice", ["'tools'"]),
        (_conv(), [], "none", "tool_choice", ["'tools'"]),
        (
            _conv(),
            [PING],
            {"type": "function", "function": {"name": "pong"}},
            "tool_choice.function.name",
            ["'pong'"],
        ),
        (_conv(), [PING], "always", "tool_choice", ["'always'"]),
        (_conv(), [PING, TIME, PING], "auto", "tools[2].function.name", ["Duplicate tool name 'ping'"]),
    ],
)
def test_conversation_errors(messages, tools, choice, param, words):
    with pytest.raises(APIError) as e:
        validate_conversation(messages, tools, choice)
    assert e.value.status_code == 400 and e.value.param == param
    for w in words:
        assert w in e.value.message, e.value.message


def test_new_tool_call_id():
    ids = {new_tool_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"[0-9a-f]{9}", i) for i in ids)


# ------------------------------------------------------------------------------------------------ tools + format

ANSWER = _rf(_obj({"answer": {"type": "string"}}))


@pytest.mark.parametrize("env", ENVS)
def test_hermes_with_response_format(env: Env):
    auto = tool_grammar(TOOLS, "auto", True, "hermes", special_tokens=env.specials, response_format=ANSWER)
    assert env.complete(auto, '{"answer": "hi"}') and env.complete(auto, W1 + "\n" + T1)
    for text in ["hello", '{"answer": 1}', "Sure.\n" + W1, '{"answer": "hi"}' + W1]:
        assert env.rejects(auto, text), text
    none = tool_grammar(TOOLS, "none", True, "hermes", special_tokens=env.specials, response_format=ANSWER)
    assert env.complete(none, ' {"answer": "hi"}') and env.rejects(none, W1) and env.rejects(none, "hello")
    required = tool_grammar(
        TOOLS, "required", True, "hermes", special_tokens=env.specials, response_format=ANSWER
    )
    assert env.rejects(required, '{"answer": "hi"}') and env.complete(required, W1)
    text_format = tool_grammar(TOOLS, "auto", True, "hermes", response_format={"type": "text"})
    assert text_format == tool_grammar(TOOLS, "auto", True, "hermes")


def test_llama3_json_with_response_format():
    w = llama("get_weather", '{"city": "Paris", "unit": null}')
    auto = tool_grammar(TOOLS, "auto", True, "llama3_json", response_format=ANSWER)
    assert PLAIN.complete(auto, '{"answer": "hi"}') and PLAIN.complete(auto, w)
    assert PLAIN.rejects(auto, "hello") and PLAIN.rejects(auto, '{"answer": 1}')
    assert PLAIN.rejects(auto, llama("get_weather", '{"city": 1, "unit": null}'))
    none = tool_grammar(TOOLS, "none", True, "llama3_json", response_format=ANSWER)
    assert PLAIN.complete(none, '{"answer": "hi"}') and PLAIN.rejects(none, w)
    any_object = tool_grammar(TOOLS, "auto", True, "llama3_json", response_format={"type": "json_object"})
    assert PLAIN.complete(any_object, '{"x": [1]}') and PLAIN.complete(any_object, w)


def test_tool_arguments_are_always_an_object():
    loose = {
        "type": "function",
        "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}},
    }
    g = tool_grammar([loose], "required", True, "hermes")
    assert PLAIN.complete(g, hermes("f", '{"a": 1}')) and PLAIN.complete(g, hermes("f", '{"b": "x"}'))
    assert PLAIN.rejects(g, hermes("f", '"text"')) and PLAIN.rejects(g, hermes("f", '{"a": "x"}'))
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    g = tool_grammar([not_object], "required", True, "hermes")
    assert PLAIN.complete(g, hermes("f", "{}")) and PLAIN.rejects(g, hermes("f", '"x"'))
    not_object["function"]["strict"] = True
    with pytest.raises(APIError) as e:
        tool_grammar([not_object], "required", True, "hermes")
    assert e.value.param == "tools[0].function.parameters.type"
