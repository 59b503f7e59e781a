"""``OpenAIBackend``: programs on any OpenAI-compatible server (vLLM, SGLang, llama.cpp,
OpenAI itself, or ``arbor serve``'s ``/v1``).

Two modes, chosen by whether the served model's tokenizer is at hand:

- **completions** (``tokenizer=`` given; the mode for open models): the state keeps the
  model's exact token ids, as with the other backends. A ``gen`` is one streamed
  ``/v1/completions`` call whose prompt is those ids; roles are rendered locally by the
  tokenizer's chat template (so programs with roles use completions too, and a gen may
  continue a half-written assistant turn). A ``select`` scores each choice with the
  legacy ``echo`` + ``logprobs`` + ``max_tokens=0`` request (served by vLLM and Arbor).
  Against ``arbor serve`` a greedy program gives the same text as in-process.
- **chat** (no tokenizer; for chat-only APIs): the state is plain text whose "tokens"
  are characters; roles render into a private markup (``_ChatMarkup``) that a ``gen``
  turns back into ``messages`` for ``/v1/chat/completions``. A gen must open an assistant
  turn (the API cannot continue one) and ``select`` is refused (no scoring there).

Constraints: ``json_schema`` goes as ``response_format`` (strict as given); so do tool
calls, which the DSL constrains as a JSON call object (portable across servers, unlike
their differing ``tools`` parsers). ``regex`` needs a server extension, named by
``dialect``: ``"vllm"`` (vLLM and Arbor: ``guided_regex``, plus ``top_k``/``min_p`` and
exact output ids through ``return_tokens_as_token_ids``), ``"sglang"`` (``regex``), or
``"openai"`` (none: a regex, a Lark grammar, ``top_k`` or ``min_p`` raise
``GenerationError`` naming what is missing). Lark grammars are refused in every dialect.

Sampling: ``frequency_penalty`` / ``presence_penalty`` are OpenAI fields; ``stop_token_ids``,
``stop_regex``, ``ignore_eos``, ``min_tokens`` and ``repetition_penalty`` go as vLLM's and
SGLang's extra-body fields (refused with dialect ``"openai"``). ``return_logprob`` reads the
completions logprobs; ``top_logprobs_num`` needs their token ids (dialect ``"vllm"``);
``logprob_start_len`` costs one more scoring request (echo) for the prompt's logprobs.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from functools import cached_property
from typing import Any, Literal

import httpx

from frontend_dsl.backend import Backend, GenChunk, GenParams
from frontend_dsl.errors import GenerationError
from frontend_dsl.hf_codec import HFCodec

Dialect = Literal["vllm", "sglang", "openai"]
_REGEX_FIELD = {"vllm": "guided_regex", "sglang": "regex"}
_TOKEN_ID = re.compile(r"token_id:(\d+)")


class OpenAIBackend(Backend):
    """An OpenAI-compatible server as a DSL backend.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:30000/v1``.
        model: the ``model`` field of every request.
        api_key: sent as a bearer token, if given.
        tokenizer: the served model's tokenizer (a transformers tokenizer, or a name or
            path for ``AutoTokenizer``): completions mode. None: chat mode.
        dialect: which server extensions to use (see the module docstring).
        timeout: seconds per HTTP request.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, tokenizer: Any = None,
                 dialect: Dialect = "vllm", timeout: float = 600.0) -> None:
        if dialect not in ("vllm", "sglang", "openai"):
            raise ValueError(f"dialect must be 'vllm', 'sglang' or 'openai', got {dialect!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.dialect = dialect
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.codec: HFCodec | _ChatMarkup = HFCodec(tokenizer) if tokenizer is not None else _ChatMarkup()
        self._clients: dict[int, httpx.AsyncClient] = {}

    @property
    def chat_mode(self) -> bool:
        return isinstance(self.codec, _ChatMarkup)

    # ---- tokenizer side ----
    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.codec.render_chat(messages, add_generation_prompt)

    @cached_property
    def eos_token_ids(self) -> list[int]:  # type: ignore[override]
        if isinstance(self.codec, _ChatMarkup):
            return []
        eos = self.codec.tokenizer.eos_token_id
        return [] if eos is None else [eos]

    # ---- model side ----
    async def generate(self, input_ids: list[int], params: GenParams) -> AsyncIterator[GenChunk]:
        body = self._sampling(params)
        top_k = params.top_logprobs_num if params.return_logprob else 0
        if top_k and (self.chat_mode or self.dialect != "vllm"):
            raise GenerationError("top_logprobs_num needs the tokens' ids: completions mode (tokenizer=) "
                                  "with dialect='vllm'")
        if isinstance(self.codec, _ChatMarkup):
            path, body["messages"] = "/chat/completions", self.codec.messages_for_gen(input_ids)
        else:
            path, body["prompt"] = "/completions", list(input_ids)
            if self.dialect == "vllm":  # the model's own output ids, not a re-encoding
                body.update(logprobs=top_k, return_tokens_as_token_ids=True)
            elif params.return_logprob:
                body["logprobs"] = 0
        prompt_lps = await self._prompt_logprobs(input_ids, params)
        text, ids, logprobs, tops = "", list[int](), list[float](), list[dict[int, float]]()
        async for choice, usage in self._stream(path, body):
            delta_text, delta_ids, delta_lps = self._delta(choice)
            text, ids, logprobs = text + delta_text, ids + delta_ids, logprobs + delta_lps
            tops += _top_by_id((choice.get("logprobs") or {}).get("top_logprobs")) if top_k else []
            if (finish := choice.get("finish_reason")) is not None:
                cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                yield GenChunk(delta_text, delta_ids, text=text, token_ids=ids, finish_reason=finish,
                               logprobs=logprobs if params.return_logprob else None,
                               num_cached_tokens=cached or 0, constraint_check=choice.get("constraint_check"),
                               top_logprobs=tops if top_k else None, prompt_logprobs=prompt_lps)
                return
            yield GenChunk(delta_text, delta_ids)
        raise GenerationError("the server ended the stream without a finish_reason")

    async def _prompt_logprobs(self, input_ids: list[int], params: GenParams) -> list[float | None] | None:
        """Prompt logprobs from ``logprob_start_len`` on (one scoring request), when asked."""
        if not params.return_logprob or params.logprob_start_len is None:
            return None
        start = max(1, params.logprob_start_len)
        if start >= len(input_ids):
            return [None] * len(input_ids)
        return [None] * start + list[float | None](await self.score(input_ids, start))

    async def score(self, input_ids: list[int], start: int, run_id: str | None = None) -> list[float]:
        if self.chat_mode:
            raise GenerationError("select needs log-probabilities of given text, which chat completions "
                                  "cannot score; give OpenAIBackend the model's tokenizer= (completions mode)")
        body = {"model": self.model, "prompt": list(input_ids), "max_tokens": 0, "echo": True, "logprobs": 0}
        r = await self._post("/completions", body)
        lps = r["choices"][0]["logprobs"]["token_logprobs"]
        if len(lps) != len(input_ids) or any(lp is None for lp in lps[start:]):
            raise GenerationError("the server's echo logprobs do not cover the prompt; "
                                  "select needs echo=true with logprobs on /v1/completions")
        return [float(lp) for lp in lps[start:]]

    # ---- the wire ----
    def _sampling(self, params: GenParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if params.stop:
            body["stop"] = list(params.stop)
        for key in ("temperature", "top_p", "seed", "top_k", "min_p"):
            if (value := getattr(params, key)) is not None:
                if key in ("top_k", "min_p") and self.dialect == "openai":
                    raise GenerationError(f"{key} is not an OpenAI API field; use dialect='vllm' or 'sglang'")
                body[key] = value
        extras = params.engine_extras()  # stop ids/regexes, min_tokens, penalties, logprobs
        for key in ("frequency_penalty", "presence_penalty"):  # OpenAI's own fields
            if key in extras:
                body[key] = extras.pop(key)
        for key in ("top_logprobs", "prompt_logprobs", "logprob_start_len"):  # see generate
            extras.pop(key, None)
        for key, value in extras.items():  # vLLM's and SGLang's extra-body names
            if self.dialect == "openai":
                raise GenerationError(f"{key} is not an OpenAI API field; use dialect='vllm' or 'sglang'")
            body[key] = list(value) if isinstance(value, tuple) else value
        if (c := params.constraint) is not None:
            body.update(self._constraint(c))
        return body

    def _constraint(self, c: Any) -> dict[str, Any]:
        if c.kind == "json_schema":
            fields: dict[str, Any] = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "output", "schema": c.json_value(), "strict": c.strict}}}
            if not c.json_bounds and self.dialect == "vllm":
                fields["json_bounds"] = False
            return fields
        if c.kind == "regex" and self.dialect in _REGEX_FIELD:
            return {_REGEX_FIELD[self.dialect]: c.value}
        raise GenerationError(f"a {c.kind} constraint needs a server extension that dialect "
                              f"{self.dialect!r} does not have" + (
                                  "; use dialect='vllm' or 'sglang'" if c.kind == "regex" else ""))

    def _delta(self, choice: dict[str, Any]) -> tuple[str, list[int], list[float]]:
        """(text, ids, logprobs) new in one streamed choice."""
        if self.chat_mode:
            text = (choice.get("delta") or {}).get("content") or ""
            return text, self.encode(text), []
        text = choice.get("text") or ""
        lps = choice.get("logprobs") or {}
        tokens = lps.get("tokens") or []
        if tokens and all(_TOKEN_ID.fullmatch(t) for t in tokens):
            ids = [int(t.split(":")[1]) for t in tokens]
        else:
            ids = self.encode(text)
        return text, ids, [float(lp) for lp in lps.get("token_logprobs") or [] if lp is not None]

    def _client(self) -> httpx.AsyncClient:
        """The async client of the running loop (httpx pools belong to one loop)."""
        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            self._clients[key] = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                                   timeout=self.timeout)
        return self._clients[key]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self._client().post(path, json=body)
        if r.status_code != 200:
            raise GenerationError(f"{path} answered {r.status_code}: {_error_message(r.text)}")
        out: dict[str, Any] = r.json()
        return out

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[dict[str, Any], Any]]:
        """(choice, usage) of each streamed chunk; usage arrives on a later chunk, so the
        final choice is held until the stream ends."""
        held: dict[str, Any] | None = None
        usage = None
        async with self._client().stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise GenerationError(f"{path} answered {r.status_code}: {_error_message((await r.aread()).decode())}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise GenerationError(f"{path} failed mid-stream: {_error_message(json.dumps(event))}")
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason") is not None:
                        held = choice
                    else:
                        yield choice, None
        if held is not None:
            yield held, usage


def _top_by_id(top: list[dict[str, float]] | None) -> list[dict[int, float]]:
    """Completions' top_logprobs with "token_id:<id>" keys, as id -> logprob."""
    return [{int(k.split(":")[1]): float(v) for k, v in step.items()} for step in top or [] if step is not None]


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err or text)
    except (ValueError, AttributeError):
        return text[:500]


class _ChatMarkup:
    """Chat mode's codec: characters as token ids, and a role markup that round-trips to
    ``messages``: ``\\x02role\\x03content\\x04`` per message."""

    _MESSAGE = re.compile(r"\x02(\w+)\x03([^\x02\x04]*)(\x04|$)")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in token_ids)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"\x02{m['role']}\x03{m['content']}\x04" for m in messages)
        return text + ("\x02assistant\x03" if add_generation_prompt else "")

    def messages_for_gen(self, input_ids: Sequence[int]) -> list[dict[str, str]]:
        """The conversation before the open assistant turn a gen fills."""
        text = self.decode(input_ids)
        matches = list(self._MESSAGE.finditer(text))
        covered = "".join(m.group(0) for m in matches)
        if covered != text:
            raise GenerationError("in chat mode (no tokenizer) every piece of text must be inside a role; "
                                  "give OpenAIBackend tokenizer= for free-form prompts")
        if not matches or matches[-1].group(1) != "assistant" or matches[-1].group(3):
            raise GenerationError("in chat mode a gen must be inside an assistant message, e.g. assistant(gen(...))")
        if matches[-1].group(2):
            raise GenerationError("in chat mode a gen must start its assistant message (a chat API cannot "
                                  "continue one); give OpenAIBackend tokenizer= to continue text")
        return [{"role": m.group(1), "content": m.group(2)} for m in matches[:-1]]
