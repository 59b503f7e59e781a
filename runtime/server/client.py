"""A small typed HTTP client for an Arbor server: what a remote DSL backend needs.

    client = ArborClient("http://127.0.0.1:30000", api_key="...")
    info = client.tokenizer_info()                  # EOS ids, max_model_len, chat template
    ids = client.encode("Hello")                    # no special tokens added
    out = await client.generate(ids, NativeSamplingParams(max_new_tokens=8, temperature=0))
    async for chunk in client.generate_stream(ids, params): ...
    logprobs = await client.score(ids, start=1)     # log p(ids[i] | ids[:i]) for i >= start
    client.end_session("conv-1")                    # release a retention session's pins now

Tokenizer calls are synchronous (``Backend.encode`` is); generation calls are coroutines
on whichever event loop awaits them (one ``httpx.AsyncClient`` per loop). Every non-2xx
answer, and every error event inside a stream, raises ``ServerError``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from runtime.server.api.common.wire import RetentionHint
from runtime.server.api.native.schema import TokenizerInfo
from runtime.server.api.programs.schema import ProgramInfo, ProgramResult
from runtime.server.api.sglang.schema import GenerateChunk, GenerateResponse, NativeSamplingParams


class ServerError(Exception):
    """An error answer from the server: HTTP ``status``, error ``kind`` and message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message


class ArborClient:
    """Client of one server. Thread-safe for the synchronous calls.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        timeout: seconds for any one HTTP exchange (a whole non-streamed generation).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._sync = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)
        self._async: dict[int, httpx.AsyncClient] = {}
        self._info: TokenizerInfo | None = None

    # ---- synchronous: tokenizer and programs ----------------------------------------------

    def tokenizer_info(self) -> TokenizerInfo:
        """Vocab size, EOS/BOS ids, max_model_len and chat template (fetched once)."""
        if self._info is None:
            self._info = TokenizerInfo.model_validate(self._get("/tokenizer_info"))
        return self._info

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data = self._post("/tokenize", {"text": text, "add_special_tokens": add_special_tokens})
        return list(data["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        data = self._post("/detokenize", {"token_ids": list(token_ids),
                                          "skip_special_tokens": skip_special_tokens})
        return str(data["text"])

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        data = self._post("/apply_chat_template", {"messages": messages,
                                                   "add_generation_prompt": add_generation_prompt})
        return str(data["text"])

    def list_programs(self) -> list[ProgramInfo]:
        return [ProgramInfo.model_validate(p) for p in self._get("/programs")["programs"]]

    def run_program(self, name: str, **arguments: Any) -> ProgramResult:
        return ProgramResult.model_validate(self._post(f"/programs/{name}", {"arguments": arguments}))

    def end_session(self, session_id: str) -> int | None:
        """End the caller's retention session now (``DELETE /sessions/{id}``): the pages
        it pinned, or None when the server has no such live session."""
        response = self._sync.delete(f"/sessions/{session_id}")
        if response.status_code == 404:
            return None
        return int(_checked(response)["pages_released"])

    def engine_metrics(self) -> dict[str, float]:
        return dict(self._get("/engine_metrics"))

    def health(self) -> dict[str, Any]:
        return dict(self._get("/health"))

    # ---- asynchronous: generation ------------------------------------------------------------

    async def generate(self, input_ids: list[int] | None = None,
                       params: NativeSamplingParams | None = None, *, text: str | None = None,
                       timeout: float | None = None, retention: RetentionHint | None = None) -> GenerateResponse:
        """One generation, awaited whole; ``retention``: keep its prefix for the session."""
        body = self._generate_body(input_ids, text, params, stream=False, timeout=timeout, retention=retention)
        response = await self._client().post("/generate", json=body)
        return GenerateResponse.model_validate(_checked(response))

    async def generate_stream(self, input_ids: list[int] | None = None,
                              params: NativeSamplingParams | None = None, *, text: str | None = None,
                              timeout: float | None = None,
                              retention: RetentionHint | None = None) -> AsyncIterator[GenerateChunk]:
        """Chunks as the server sends them; the last has ``finish_reason`` and the whole
        output. Leaving the iteration early closes the connection (the server aborts)."""
        body = self._generate_body(input_ids, text, params, stream=True, timeout=timeout, retention=retention)
        async with self._client().stream("POST", "/generate", json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                _checked(response)
            async for payload in _sse_payloads(response):
                yield GenerateChunk.model_validate(payload)

    async def score(self, input_ids: list[int], start: int,
                    retention: RetentionHint | None = None) -> list[float]:
        """``log p(input_ids[i] | input_ids[:i])`` for ``i`` in ``[start, len)``; start >= 1."""
        if start < 1:
            raise ValueError("start must be >= 1 (the first token has no context)")
        params = NativeSamplingParams(max_new_tokens=0, prompt_logprobs=True, logprob_start_len=start)
        out = await self.generate(input_ids, params, retention=retention)
        logprobs = (out.meta.prompt_logprobs or [])[start:]
        if len(logprobs) != len(input_ids) - start or any(lp is None for lp in logprobs):
            raise ServerError(500, "missing_logprobs", f"no prompt logprobs from position {start}")
        return [float(lp) for lp in logprobs if lp is not None]

    async def cache_prefix(self, input_ids: list[int], retention: RetentionHint | None = None) -> None:
        """Make ``input_ids`` resident in the server's prefix cache (a prefill, no output)."""
        await self.generate(input_ids, NativeSamplingParams(max_new_tokens=0), retention=retention)

    # ---- plumbing -----------------------------------------------------------------------------

    def _generate_body(self, input_ids: list[int] | None, text: str | None,
                       params: NativeSamplingParams | None, stream: bool,
                       timeout: float | None, retention: RetentionHint | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"sampling_params": (params or NativeSamplingParams()).model_dump(
            exclude_defaults=True), "stream": stream}
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        if text is not None:
            body["text"] = text
        if timeout is not None:
            body["timeout"] = timeout
        if retention is not None:
            body["retention"] = retention.model_dump()
        return body

    def _client(self) -> httpx.AsyncClient:
        """The async client of the running loop (httpx pools belong to one loop)."""
        key = id(asyncio.get_running_loop())
        if key not in self._async:
            self._async[key] = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                                 timeout=self.timeout)
        return self._async[key]

    def _get(self, path: str) -> Any:
        return _checked(self._sync.get(path))

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return _checked(self._sync.post(path, json=body))

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        """Close the async client of the running loop (and the sync one)."""
        client = self._async.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()
        self.close()


def _checked(response: httpx.Response) -> Any:
    """The JSON body of a 2xx answer; ``ServerError`` otherwise."""
    if response.status_code < 400:
        return response.json()
    try:
        error = response.json()["error"]
        raise ServerError(response.status_code, str(error.get("type")), str(error.get("message")))
    except (ValueError, KeyError, TypeError):
        raise ServerError(response.status_code, "http_error", response.text[:500]) from None


async def _sse_payloads(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of ``data:`` lines until ``[DONE]``; an error event raises."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            error = payload["error"]
            raise ServerError(int(error.get("code", 500)), str(error.get("type")), str(error.get("message")))
        yield payload
