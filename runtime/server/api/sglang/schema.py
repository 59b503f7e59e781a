"""SGLang's native wire shapes, as a superset of Arbor's ``/generate``.

Learned from SGLang's own source: what its frontend sends
(``sglang/lang/backend/runtime_endpoint.py``, ``SglSamplingParams.to_srt_kwargs``), what
its server takes (``srt/managers/io_struct.py`` ``GenerateReqInput``,
``srt/sampling/sampling_params.py``) and answers (``srt/managers/tokenizer_manager.py``:
``text``, ``output_ids``, ``meta_info``). Arbor's own request fields (``constraint``,
``prompt_logprobs``, ``speculation``, ``timeout``...) stay valid beside SGLang's, and its
answer fields (``finish_reason`` as text, ``meta``) are kept beside ``meta_info``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.server.api.common.fields import RefusedFields, WireModel, is_empty, is_false
from runtime.server.api.common.wire import (
    ConstraintCheckInfo,
    ConstraintSpec,
    RetentionHint,
    Strict,
)


class SglSamplingParams(WireModel):
    """One prompt's ``sampling_params``: Arbor's names (``runtime.SamplingParams``) and
    SGLang's (``min_new_tokens``, ``n``, ``regex``, ``json_schema``, ``ebnf``...)."""

    model_config = ConfigDict(extra="allow")
    # NOTE: null keeps its SGLang meaning here (max_new_tokens: as many as fit)
    keep_null: ClassVar[frozenset[str]] = frozenset({"max_new_tokens"})

    max_new_tokens: int | None = Field(default=128, ge=0)  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # SGLang's -1 (every token) is 0 here too
    min_p: float = 0.0
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_regex: str | list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_new_tokens: int = 0  # SGLang's name for min_tokens
    n: int = Field(default=1, ge=1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # Arbor's: every prompt position from logprob_start_len
    logprob_start_len: int = Field(default=0, ge=0)  # Arbor's (the top-level one is SGLang's)
    skip_special_tokens: bool = True
    speculation: bool = True
    ttft_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target
    itl_slo: float | None = Field(default=None, gt=0)  # Arbor's: seconds; None: the engine's target
    constraint: ConstraintSpec | None = None  # Arbor's constraint object
    regex: str | None = None  # SGLang's constraint fields (at most one constraint in all)
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    json_bounds: bool = True


class SglGenerateRequest(WireModel):
    """``POST /generate``: one prompt or a batch, as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglSamplingParams | list[SglSamplingParams] = Field(
        default_factory=lambda: SglSamplingParams())
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1  # SGLang: -1 = no prompt positions
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None  # echoed as meta_info.id
    cache_salt: Any = None  # vLLM's prefix-cache namespace; checked by tenants.caller_of (400)
    timeout: float | None = Field(default=None, gt=0, description="seconds; the server's limit caps it")
    retention: RetentionHint | None = None  # Arbor: keep the prefix for the session's next request

    @model_validator(mode="after")
    def _one_prompt(self) -> SglGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


# ---- Arbor's own /generate: the strict subset its typed client sends, and the answer ----


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


# SGLang sampling / request fields this server knows and does not have (400 unless no-op)
REFUSED: RefusedFields = {
    "image_data": ("no image input", is_empty),
    "video_data": ("no video input", is_empty),
    "audio_data": ("no audio input", is_empty),
    "lora_path": ("no LoRA adapters", is_empty),
    "return_hidden_states": ("hidden states are not returned", is_false),
    "session_params": ("no sessions", is_empty),
    "custom_logit_processor": ("no custom logit processors", is_empty),
    "token_ids_logprob": ("logprobs of chosen token ids are not computed", is_empty),
}
SAMPLING_REFUSED: RefusedFields = {
    "no_stop_trim": ("stop strings are always cut from the output", is_false),
    "logit_bias": ("no logit bias", is_empty),
    "structural_tag": ("no structural tags; use json_schema, regex or ebnf", is_empty),
    "custom_params": ("no custom logit processors", is_empty),
}
SAMPLING_IGNORED = {
    "spaces_between_special_tokens": "fast tokenizers never insert spaces between special tokens",
    "stream_interval": "every step's tokens are streamed",
}
