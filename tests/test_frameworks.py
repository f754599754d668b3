"""The structured-output examples of the frameworks people use against the hosted service, run unchanged against a
real server: LangChain's `ChatCerebras(...).with_structured_output(Model)` and instructor's `response_model=`, with
Pydantic models whose `Field` constraints (lengths, patterns, bounds) strict mode must accept and enforce."""

from __future__ import annotations

import instructor
import pytest
from conftest import MODEL, openai_for
from langchain_cerebras import ChatCerebras
from pydantic import BaseModel, Field


class Person(BaseModel):
    """A person (issue 36's example: LangChain answered 400 on its `maxLength`)."""

    name: str = Field(min_length=1, max_length=40)
    age: int = Field(ge=0, le=130)


class Ticket(BaseModel):
    """A support ticket."""

    code: str = Field(pattern=r"^[A-Z]{2}-[0-9]{3}$")
    priority: int = Field(ge=1, le=5)
    tags: list[str] = Field(max_length=2)


ASK_PERSON = "Invent a person: give their name and age."


def _chat_cerebras(server) -> ChatCerebras:
    return ChatCerebras(
        model=MODEL, api_key="unused", base_url=server.url + "/v1", temperature=0, max_tokens=120, max_retries=0
    )


@pytest.mark.parametrize("method", [None, "json_mode"])  # None: function_calling; json_schema: below, strict
def test_langchain_with_structured_output_gives_a_valid_pydantic_object(server, method):
    llm = _chat_cerebras(server)
    kwargs = {} if method is None else {"method": method}  # None: the framework's default method
    structured = llm.with_structured_output(Person, **kwargs)
    question = ASK_PERSON + (" Answer in JSON with keys name and age." if method == "json_mode" else "")
    person = structured.invoke(question)
    assert isinstance(person, Person)  # pydantic validated the lengths and bounds


def test_langchain_strict_structured_output(server):
    structured = _chat_cerebras(server).with_structured_output(Ticket, method="json_schema", strict=True)
    ticket = structured.invoke("File a ticket for a broken printer.")
    assert isinstance(ticket, Ticket)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])  # its two families
def test_instructor_response_model(server, mode):
    client = instructor.from_openai(openai_for(server.url), mode=mode)
    ticket = client.chat.completions.create(
        model=MODEL,
        response_model=Ticket,
        messages=[{"role": "user", "content": "File a ticket for a broken printer."}],
        max_tokens=120,
        temperature=0,
        max_retries=0,  # a first answer that fails validation fails the test
    )
    assert isinstance(ticket, Ticket)
