"""Wire schemas: the pydantic models of every request and response body.

Native (``/generate``, tokenizer endpoints, programs) and OpenAI-compatible
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``). Only shapes and types
are checked here (a failure is a 422); value checks that the engine owns (temperature
range, prompt length...) stay in the engine and come back as 400.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.server.api.fields import WireModel


class Strict(BaseModel):
    """Unknown fields are an error (native API: typos must not pass silently). Types are
    strict on both APIs: ``"5"`` is no integer and ``"true"`` no boolean (a 422)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(WireModel):
    """OpenAI API shapes: unknown fields are kept so the route can refuse them by name
    (``api/fields.py``: 400, or ignored with a header on a ``--unknown-fields warn``
    server); an explicit null means the default, as the OpenAI spec allows. Fields that
    would change the output and are not supported are declared and refused with a 400
    (``logit_bias``, ``best_of``...); the OpenAI fields that cannot change the output are
    listed, with why, in ``api/openai_fields.py``.
    """

    # NOTE: types are strict too ("5" is no integer); extra fields are kept for api/fields.py
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)


# ---- native ------------------------------------------------------------------------------


class ConstraintSpec(Strict):
    """Exactly one of: a JSON schema, a regex, a list of choices, a Lark grammar, a type.

    For a JSON schema, ``strict`` refuses (400) a schema the grammar could only relax,
    and ``json_bounds: false`` lifts the bounds on number literals (``grammars.JsonBounds``).
    """

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None  # Lark grammar text
    type: Literal["int", "float", "bool", "str"] | None = None
    strict: bool = False
    json_bounds: bool = True

    @model_validator(mode="after")
    def _exactly_one(self) -> ConstraintSpec:
        given = [k for k in ("json_schema", "regex", "choices", "grammar", "type")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a constraint needs exactly one of json_schema, regex, choices, "
                             f"grammar, type; got {given or 'none'}")
        return self


class NativeSamplingParams(Strict):
    """``runtime.SamplingParams`` on the wire (same names, same defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_regex: str | list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    logprob_start_len: int = Field(default=0, ge=0)  # first prompt position to score
    skip_special_tokens: bool = True
    speculation: bool = True
    ttft_slo: float | None = Field(default=None, gt=0)  # seconds; None: the engine's target
    itl_slo: float | None = Field(default=None, gt=0)  # seconds; None: the engine's target
    constraint: ConstraintSpec | None = None


class GenerateRequest(Strict):
    """``POST /generate``: one prompt, as text or token ids."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=lambda: NativeSamplingParams())
    stream: bool = False
    timeout: float | None = Field(default=None, gt=0, description="seconds; the server's limit caps it")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


class ConstraintCheckInfo(BaseModel):
    """Arbor's own field, on the final output of a constrained request
    (``runtime.ConstraintCheck``): was the output measured against the whole constraint?"""

    # NOTE: defaults, because a streamed chunk is sent with exclude_none (a None is absent).
    relaxed: str | None = None  # what the grammar did not enforce (the keywords); null: exact grammar
    valid: bool | None = None  # satisfies the whole constraint; null: cut by the length cap
    checked: bool  # parsed and checked (jsonschema...); false: valid by construction
    error: str | None = None  # why not, when valid is false


class CachedTokensDetails(BaseModel):
    """Where a prompt's cached tokens came from: ``pool + tier == cached_tokens``."""

    pool: int  # found in the KV pool (the radix tree's pages)
    tier: int = 0  # reloaded from the host tier beyond the pool; 0 while no tier exists


class GenerateMeta(BaseModel):
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails | None = None  # None: a server that does not split
    e2e_latency: float  # seconds, server side
    logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None  # token id (as a string) → logprob
    prompt_logprobs: list[float | None] | None = None
    constraint_check: ConstraintCheckInfo | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    finish_reason: str
    meta: GenerateMeta


class GenerateChunk(BaseModel):
    """One SSE event of a streamed ``/generate``; the last has ``finish_reason`` and the
    whole output (``text``, ``output_ids``, ``meta``)."""

    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None
    output_ids: list[int] | None = None
    meta: GenerateMeta | None = None


class TokenizeRequest(Strict):
    text: str
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    input_ids: list[int]


class DetokenizeRequest(Strict):
    token_ids: list[int]
    skip_special_tokens: bool = False


class DetokenizeResponse(BaseModel):
    text: str


class ChatTemplateRequest(Strict):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True


class ChatTemplateResponse(BaseModel):
    text: str


class TokenizerInfo(BaseModel):
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    chat_template: str | None


class ProgramInfo(BaseModel):
    name: str
    description: str
    arguments_schema: dict[str, Any]


class ProgramsResponse(BaseModel):
    programs: list[ProgramInfo]


class ProgramResult(BaseModel):
    program: str
    variables: dict[str, Any]
    text: str
    latency: float
    run_id: str | None = None  # the run's entry in /ui/api/runs
    trace: dict[str, Any] | None = None  # the run's trace (format arbor.run_trace/1), when asked for


# ---- OpenAI-compatible -------------------------------------------------------------------


class RetentionHint(Strict):
    """Keep this request's prefix cached for the session's next request (docs/retention.md)."""

    session_id: str  # the caller's session; namespaced by tenant on the server
    ttl_s: float  # seconds to keep it after this request; the server caps it (a 400 above)


class EndSessionResponse(Strict):
    """``DELETE /sessions/{id}``: the session ended; its pins are released."""

    session_id: str
    pages_released: int  # KV pages it had pinned (now evictable like any other)


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, every chunk carries the
    # usage so far
    continuous_usage_stats: bool = False


class SamplingExtras(Lenient):
    """Fields shared by both OpenAI endpoints, with the vLLM/SGLang extensions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the tenant, unless the X-Tenant header names one (tenants.py)
    # vLLM's: a prefix-cache namespace within the tenant; any JSON value, checked by
    # tenants.caller_of so that a bad one is a 400 saying why
    cache_salt: Any = None
    # extensions (vLLM / SGLang names)
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    regex: str | None = None  # SGLang: the output matches this regular expression
    guided_regex: str | None = None  # vLLM's name for the same
    guided_choice: list[str] | None = Field(default=None, min_length=1)  # vLLM: one of these strings
    # More constraint fields of other servers (``api/constraint_fields.py``): honoured or a 400.
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema (object or text)
    json_schema: dict[str, Any] | str | None = None  # SGLang extra body: the same
    guided_grammar: str | None = None  # vLLM: GBNF or Lark
    ebnf: str | None = None  # SGLang: GBNF
    grammar: str | None = None  # llama.cpp server: GBNF
    structured_outputs: dict[str, Any] | None = None  # vLLM >= 0.10
    timeout: float | None = Field(default=None, gt=0)
    json_bounds: bool = True  # false: no bounds on number literals in JSON outputs
    retention: RetentionHint | None = None  # Arbor: keep the conversation for the next turn
    ttft_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target
    itl_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target


class JsonSchemaFormat(Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion (with its logprobs when asked)
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs tokens as "token_id:<id>"
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # extension (as in vLLM)


class FunctionDef(Lenient):
    name: str
    description: str | None = None
    strict: bool | None = None  # a forced call refuses parameters the grammar could only relax
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ChatTool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(Lenient):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessageIn:
        # NOTE: as in OpenAI's API, only an assistant turn that calls tools may go without text.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (null only for an assistant "
                             "message with tool_calls)")
        return self


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True  # extension
    parallel_tool_calls: bool = True  # false: at most one tool call per answer
    # reasoning models (docs/reasoning-and-tool-formats.md): the most thinking tokens before
    # the span is closed; keyword arguments of the chat template (vLLM's, e.g. enable_thinking)
    reasoning_budget: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None  # None: the first echoed prompt token
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: constrained, final


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking span (as vLLM, DeepSeek)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: constrained requests


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    constraint_check: ConstraintCheckInfo | None = None  # extension: on the final chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "arbor"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
