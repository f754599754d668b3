"""Pydantic models that mirror the chat contract (tests/contract/chat-completions.openapi.json): same names, fields,
ranges and defaults. Request models are closed (an unknown property is a 400); response models document the wire.

Schemas whose names both contracts use (TimeInfo, Usage, StreamOptions, ErrorChunkResponse, ...) come from
`schemas.py`: the completions contract's shapes, which are the stricter of the two and satisfy both.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, field_validator

from waferscale.api.schemas import (
    ErrorChunkResponse,
    ReasoningFormat,
    StreamOptions,
    TimeInfo,
    Usage,
    integer_keys_as_text,
)


def _anyof(schema: dict[str, Any]) -> None:
    """The contract writes message and content unions as anyOf (pydantic writes a tagged union as oneOf)."""
    if "oneOf" in schema:
        schema["anyOf"] = schema.pop("oneOf")
    schema.pop("discriminator", None)


# ---------------------------------------------------------------- content parts


class TextContent(BaseModel):
    model_config = ConfigDict(extra="forbid", title="TextContent")
    text: str = Field(title="Text")
    type: Literal["text"] = Field(title="Type")


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ImageURL")
    url: str = Field(title="Url")
    detail: str | None = Field(default=None, title="Detail")


class ImageURLContent(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ImageURLContent")
    image_url: ImageURL
    type: Literal["image_url"] = Field(title="Type")


class ImageContent(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ImageContent")
    image: str = Field(title="Image")
    type: Literal["image"] = Field(title="Type")


def _part_type(value: Any) -> str | None:
    """The `type` tag of a content part or a response format (raw dict or model)."""
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


AnyPart = Annotated[
    Annotated[TextContent, Tag("text")]
    | Annotated[ImageURLContent, Tag("image_url")]
    | Annotated[ImageContent, Tag("image")],
    Discriminator(
        _part_type,
        custom_error_type="invalid_part",
        custom_error_message="a content part's type must be one of: text, image_url, image",
    ),
    Field(json_schema_extra=_anyof),
]
UserContent = str | list[AnyPart]
TextOnlyContent = str | list[TextContent]


# ---------------------------------------------------------------- messages


class SystemMessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="SystemMessageRequest")
    content: UserContent = Field(title="Content")
    name: str | None = Field(default=None, title="Name")
    role: Literal["system"] = Field(default="system", title="Role")


class DeveloperMessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="DeveloperMessageRequest")
    content: UserContent = Field(title="Content")
    name: str | None = Field(default=None, title="Name")
    role: Literal["developer"] = Field(default="developer", title="Role")


class UserMessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="UserMessageRequest")
    content: UserContent = Field(title="Content")
    name: str | None = Field(default=None, title="Name")
    role: Literal["user"] = Field(default="user", title="Role")


class AssistantToolCallFunctionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="AssistantToolCallFunctionRequest")
    arguments: str = Field(title="Arguments")
    name: str = Field(title="Name")


class AssistantToolCallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="AssistantToolCallRequest")
    function: AssistantToolCallFunctionRequest
    id: str = Field(title="Id")
    index: int | None = Field(default=None, title="Index")
    type: Literal["function"] = Field(title="Type")


class AssistantMessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="AssistantMessageRequest")
    content: TextOnlyContent | None = Field(default=None, title="Content")
    name: str | None = Field(default=None, title="Name")
    reasoning: TextOnlyContent | None = Field(default=None, title="Reasoning")
    role: Literal["assistant"] = Field(default="assistant", title="Role")
    tool_calls: list[AssistantToolCallRequest] | None = Field(default=None, title="Tool Calls")


class ToolMessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ToolMessageRequest")
    content: TextOnlyContent = Field(title="Content")
    name: str | None = Field(default=None, title="Name")
    role: Literal["tool"] = Field(default="tool", title="Role")
    tool_call_id: str = Field(title="Tool Call Id")


ROLES = ("system", "developer", "user", "assistant", "tool")


def _role(value: Any) -> str | None:
    return value.get("role") if isinstance(value, dict) else getattr(value, "role", None)


class ChatMessageRequest(RootModel):
    """One message, chosen by its `role` (required in practice: without it the shapes are ambiguous)."""

    model_config = ConfigDict(title="ChatMessageRequest", json_schema_extra=_anyof)
    root: Annotated[
        Annotated[SystemMessageRequest, Tag("system")]
        | Annotated[DeveloperMessageRequest, Tag("developer")]
        | Annotated[UserMessageRequest, Tag("user")]
        | Annotated[AssistantMessageRequest, Tag("assistant")]
        | Annotated[ToolMessageRequest, Tag("tool")],
        Discriminator(
            _role,
            custom_error_type="invalid_role",
            custom_error_message="role is required and must be one of: system, developer, user, assistant, tool",
        ),
    ]


# ---------------------------------------------------------------- tools, formats, prediction


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Prediction")
    content: TextOnlyContent = Field(title="Content")
    type: Literal["content"] = Field(title="Type")


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ResponseFormatText")
    type: Literal["text"] = Field(title="Type")


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ResponseFormatJsonObject")
    type: Literal["json_object"] = Field(title="Type")


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", title="JsonSchema", populate_by_name=True)
    description: str | None = Field(default=None, title="Description")
    name: str = Field(title="Name")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", title="Schema")
    strict: bool | None = Field(default=False, title="Strict")


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ResponseFormatJsonSchema")
    json_schema: JsonSchema
    type: Literal["json_schema"] = Field(title="Type")


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("text")]
    | Annotated[ResponseFormatJsonObject, Tag("json_object")]
    | Annotated[ResponseFormatJsonSchema, Tag("json_schema")],
    Discriminator(
        _part_type,
        custom_error_type="invalid_format",
        custom_error_message="response_format.type must be one of: text, json_object, json_schema",
    ),
    Field(json_schema_extra=_anyof),
]


class FunctionObject(BaseModel):
    model_config = ConfigDict(extra="forbid", title="FunctionObject")
    description: str | None = Field(default=None, title="Description")
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$", title="Name")
    parameters: dict[str, Any] | None = Field(default=None, title="Parameters")
    strict: bool = Field(default=False, title="Strict")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Tool")
    function: FunctionObject
    type: str = Field(title="Type", examples=["function"])


class ChoiceObjectFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ChoiceObjectFunction")
    name: str = Field(title="Name")


class ChoiceObject(BaseModel):
    model_config = ConfigDict(extra="forbid", title="ChoiceObject")
    function: ChoiceObjectFunction
    type: str = Field(title="Type", examples=["function"])


class ReasoningEffort(str, Enum):
    none = "none"
    low = "low"
    medium = "medium"
    high = "high"


class ServiceTier(str, Enum):
    auto = "auto"
    default = "default"
    flex = "flex"
    priority = "priority"


class FinishReason(str, Enum):
    stop = "stop"
    length = "length"
    content_filter = "content_filter"
    tool_calls = "tool_calls"


# ---------------------------------------------------------------- the request

Penalty = Annotated[float, Field(ge=-2, le=2)]


class ChatCompletionRequest(BaseModel):
    """Request for the chat completions endpoint."""

    model_config = ConfigDict(extra="forbid", title="ChatCompletionRequest")

    clear_thinking: bool | None = Field(default=None, title="Clear Thinking")
    disable_reasoning: bool | None = Field(default=None, title="Disable Reasoning")
    frequency_penalty: Penalty | None = Field(default=0.0, title="Frequency Penalty")
    logit_bias: dict[str, float] | None = Field(default=None, title="Logit Bias")
    logprobs: bool | None = Field(default=False, title="Logprobs")
    max_completion_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, title="Max Completion Tokens"
    )
    # deprecated in the document only: pydantic's own flag would warn each time the pipeline reads it
    max_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, title="Max Tokens", json_schema_extra={"deprecated": True}
    )
    messages: list[ChatMessageRequest] = Field(min_length=1, title="Messages")
    min_completion_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, title="Min Completion Tokens"
    )
    min_tokens: Annotated[int, Field(ge=-1)] | None = Field(default=None, title="Min Tokens")
    model: str = Field(title="Model")
    model_parameters: dict[str, Any] | None = Field(default=None, title="Model Parameters")
    n: Annotated[int, Field(ge=1)] | None = Field(default=1, title="N")
    parallel_tool_calls: bool | None = Field(default=True, title="Parallel Tool Calls")
    prediction: Prediction | None = Field(default=None, title="Prediction")
    presence_penalty: Penalty | None = Field(default=0.0, title="Presence Penalty")
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = Field(
        default=None, title="Prompt Cache Key"
    )
    reasoning_effort: ReasoningEffort | None = Field(default=None, title="Reasoning Effort")
    reasoning_format: ReasoningFormat = Field(default=ReasoningFormat.none, title="Reasoning Format")
    response_format: ResponseFormat | None = Field(default=None, title="Response Format")
    seed: int | None = Field(default=None, title="Seed")
    service_tier: ServiceTier | None = Field(default=None, title="Service Tier")
    stop: str | Annotated[list[str], Field(max_length=4)] | None = Field(default=None, title="Stop")
    stream: bool | None = Field(default=False, title="Stream")
    stream_options: StreamOptions | None = Field(default=None, title="Stream Options")
    temperature: Annotated[float, Field(ge=0, le=2.0)] | None = Field(default=1.0, title="Temperature")
    tool_choice: Literal["none", "auto", "required"] | ChoiceObject | None = Field(
        default=None, title="Tool Choice"
    )
    tools: list[Tool] | None = Field(default=None, title="Tools")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(default=None, title="Top Logprobs")
    top_p: Annotated[float, Field(ge=0, le=1)] | None = Field(default=1.0, title="Top P")
    user: str | None = Field(default=None, title="User")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_keys(cls, value: Any) -> Any:
        return integer_keys_as_text(value)


# ---------------------------------------------------------------- responses (documentation of what we send)

Role = Literal["assistant", "user", "system", "tool"]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(title="ToolCallFunction")
    arguments: str | None = Field(default=None, title="Arguments")
    name: str | None = Field(default=None, title="Name")


class ToolCall(BaseModel):
    model_config = ConfigDict(title="ToolCall")
    function: ToolCallFunction
    id: str | None = Field(default=None, title="Id")
    index: int | None = Field(default=None, title="Index")
    type: Literal["function"] = Field(title="Type")


class ChatCompletionMessage(BaseModel):
    model_config = ConfigDict(title="ChatCompletionMessage")
    content: str | None = Field(default=None, title="Content")
    reasoning: str | None = Field(default=None, title="Reasoning")
    role: Role = Field(title="Role")
    tool_calls: list[ToolCall] | None = Field(default=None, title="Tool Calls")


class TopLogprob(BaseModel):
    model_config = ConfigDict(title="TopLogprob")
    bytes: list[int] | None = Field(default=None, title="Bytes")
    logprob: float = Field(title="Logprob")
    token: str = Field(title="Token")


class TokenLogprob(BaseModel):
    model_config = ConfigDict(title="TokenLogprob")
    bytes: list[int] | None = Field(default=None, title="Bytes")
    logprob: float = Field(title="Logprob")
    token: str = Field(title="Token")
    top_logprobs: list[TopLogprob] = Field(title="Top Logprobs")


class ChatCompletionLogProbs(BaseModel):
    model_config = ConfigDict(title="ChatCompletionLogProbs")
    content: list[TokenLogprob] | None = Field(default=None, title="Content")
    refusal: list[TokenLogprob] | None = Field(default=None, title="Refusal")


class ChatCompletionChoice(BaseModel):
    model_config = ConfigDict(title="ChatCompletionChoice")
    finish_reason: FinishReason | None = Field(default=None, title="Finish Reason")
    index: int = Field(title="Index")
    logprobs: ChatCompletionLogProbs | None = Field(default=None, title="Logprobs")
    message: ChatCompletionMessage
    reasoning_logprobs: ChatCompletionLogProbs | None = Field(default=None, title="Reasoning Logprobs")


class ChatCompletionResponse(BaseModel):
    model_config = ConfigDict(title="ChatCompletionResponse")
    choices: list[ChatCompletionChoice] = Field(title="Choices")
    created: int = Field(title="Created")
    id: str = Field(title="Id")
    model: str = Field(title="Model")
    object: Literal["chat.completion"] = Field(title="Object")
    service_tier: str | None = Field(default=None, title="Service Tier")
    service_tier_used: ServiceTier | None = Field(default=None, title="Service Tier Used")
    system_fingerprint: str = Field(title="System Fingerprint")
    time_info: TimeInfo | None = Field(default=None, title="Time Info")
    usage: Usage | None = Field(default=None, title="Usage")


class ChatChunkDelta(BaseModel):
    model_config = ConfigDict(title="ChatChunkDelta")
    content: str | None = Field(default=None, title="Content")
    reasoning: str | None = Field(default=None, title="Reasoning")
    role: Role | None = Field(default=None, title="Role")
    tokens: list[int] | None = Field(default=None, title="Tokens")
    tool_calls: list[ToolCall] | None = Field(default=None, title="Tool Calls")


class ChatChunkChoice(BaseModel):
    model_config = ConfigDict(title="ChatChunkChoice")
    delta: ChatChunkDelta | None = Field(default=None, title="Delta")
    finish_reason: FinishReason | None = Field(default=None, title="Finish Reason")
    index: int = Field(title="Index")
    logprobs: ChatCompletionLogProbs | None = Field(default=None, title="Logprobs")
    reasoning_logprobs: ChatCompletionLogProbs | None = Field(default=None, title="Reasoning Logprobs")
    text: str | None = Field(default=None, title="Text")
    tokens: list[int] | None = Field(default=None, title="Tokens")


class ChatChunkResponse(BaseModel):
    model_config = ConfigDict(title="ChatChunkResponse")
    choices: list[ChatChunkChoice] | None = Field(default=None, title="Choices")
    created: int = Field(title="Created")
    id: str = Field(title="Id")
    model: str = Field(title="Model")
    object: Literal["chat.completion.chunk"] = Field(title="Object")
    service_tier: str | None = Field(default=None, title="Service Tier")
    system_fingerprint: str = Field(title="System Fingerprint")
    time_info: TimeInfo | None = Field(default=None, title="Time Info")
    usage: Usage | None = Field(default=None, title="Usage")


class CreateChatCompletionResponse(
    RootModel[ChatCompletionResponse | ChatChunkResponse | ErrorChunkResponse]
):
    model_config = ConfigDict(title="CreateChatCompletionResponse")


class ChatCompletionStreamEvent(RootModel[ChatChunkResponse | ErrorChunkResponse]):
    model_config = ConfigDict(title="ChatCompletionStreamEvent")


class ErrorResponse(BaseModel):
    """The flat error body the hosted chat endpoint returns (not OpenAI's {"error": {...}} wrapper)."""

    model_config = ConfigDict(title="ErrorResponse")
    code: str | None = Field(default=None, title="Code")
    message: str = Field(title="Message")
    param: str | None = Field(default=None, title="Param")
    type: str | None = Field(default=None, title="Type")
