"""Structured outputs as real clients write them, through a real server: Pydantic v2 models with `Field`
constraints sent by the OpenAI SDK's `parse` and `pydantic_function_tool` (strict), a Zod-style schema, and a
non-strict schema with a keyword constrained decoding cannot enforce. Every output is validated with `jsonschema`
against the schema sent."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal, Optional, Union

import jsonschema
from conftest import MODEL
from openai import pydantic_function_tool
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, StringConstraints
from test_chat import chat


class Continent(str, enum.Enum):
    europe = "Europe"
    asia = "Asia"
    other = "other"


class Mayor(BaseModel):
    name: str = Field(min_length=1, max_length=24)
    since: int = Field(ge=1900, le=2026)


class City(BaseModel):
    """A city."""

    name: str = Field(min_length=1, max_length=20, description="the city's name")
    country_code: str = Field(pattern=r"^[A-Z]{2}$")
    population: int = Field(ge=0, le=50_000_000)
    area_km2: float = Field(gt=0, le=10_000)
    continent: Continent
    kind: Literal["capital", "town"]
    tags: list[Annotated[str, StringConstraints(max_length=12)]] = Field(max_length=2)
    mayor: Optional[Mayor] = None  # noqa: UP045 - as users write it


ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_openai_sdk_parse_with_a_constrained_pydantic_model(openai_client):
    completion = openai_client.chat.completions.parse(
        model=MODEL, messages=ASK_CITY, response_format=City, max_tokens=200, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    jsonschema.validate(json.loads(message.content), to_strict_json_schema(City))


def test_openai_sdk_strict_pydantic_tool(openai_client):
    tool = pydantic_function_tool(City, name="save_city")
    completion = openai_client.chat.completions.parse(
        model=MODEL,
        messages=ASK_CITY,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "save_city" and isinstance(call.function.parsed_arguments, City)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    name: str = Field(max_length=12)


class Owner(BaseModel):
    name: str = Field(max_length=20)
    pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]  # noqa: UP007 - as users write it


def test_openai_sdk_parse_with_a_discriminated_union(openai_client):
    """Pydantic writes a discriminated union as oneOf + discriminator: accepted in strict mode and enforced."""
    completion = openai_client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Alice has a cat. Answer as JSON."}],
        response_format=Owner,
        max_tokens=80,
        temperature=0,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Owner) and isinstance(message.parsed.pet, (Cat, Dog))
    jsonschema.validate(json.loads(message.content), to_strict_json_schema(Owner))


# As zod-to-json-schema writes z.object({...}) (definitionPath "$defs"); the Zod calls are in the comments.
ORDER = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "customer": {"type": "string", "minLength": 1, "maxLength": 20},  # z.string().min(1).max(20)
        "email": {"type": "string", "format": "email"},  # .email()
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},  # .regex(/^[A-Z]{3}-[0-9]{3}$/)
        "quantity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99},  # .int().positive().max(99)
        "price": {"type": "number", "minimum": 0, "multipleOf": 0.25},  # .nonnegative().multipleOf(0.25)
        "status": {"type": "string", "enum": ["open", "paid"]},  # z.enum(["open", "paid"])
        "lines": {  # z.array(line).min(1).max(2)
            "type": "array",
            "items": {"$ref": "#/$defs/line"},
            "minItems": 1,
            "maxItems": 2,
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},  # .max(30).nullable()
    },
    "required": ["customer", "email", "sku", "quantity", "price", "status", "lines", "note"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "properties": {
                "item": {"type": "string", "maxLength": 12},
                "qty": {"type": "integer", "minimum": 1},
            },
            "required": ["item", "qty"],
            "additionalProperties": False,
        }
    },
}


def test_zod_style_schema_output_validates(http):
    body = chat(
        http,
        messages=[{"role": "user", "content": "Write an order as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "order", "strict": True, "schema": ORDER},
        },
        max_tokens=200,
        temperature=0,
    )
    assert body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), ORDER)


def test_non_strict_schema_is_not_refused_for_a_keyword_it_cannot_enforce(http):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "maxItems": 2,
                "uniqueItems": True,
            },
        },
        "required": ["name", "tags"],
    }
    body = chat(
        http,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
        max_tokens=120,
        temperature=0,
    )
    assert body["choices"][0]["finish_reason"] == "stop"
    enforced = json.loads(json.dumps(schema))
    del enforced["properties"]["tags"]["uniqueItems"]  # ignored: the rest is enforced
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), enforced)
