"""What ``arbor eval`` replays its samples on: an in-process engine with given settings,
or a running server. Both answer the same questions (``Target``), so a replay compares
any two: two settings of one model, two weight formats, or a canary and production.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, Union, get_args, get_origin, get_type_hints

import torch

from runtime.config import EngineConfig
from runtime.errors import InvalidRequestError

TOP_K = 20  # top logprobs per position: the most a server returns (SamplingParams' cap)
T = TypeVar("T")


@dataclass(frozen=True)
class PositionDists:
    """Next-token distributions at positions ``1 .. L-1`` of a sequence (row ``i``: the
    token at position ``i + 1`` given the ones before it)."""

    top_ids: torch.Tensor  # [L-1, k] int64, most likely first
    top_logprobs: torch.Tensor  # [L-1, k] fp32
    full: torch.Tensor | None  # [L-1, vocab] fp32 log-probs; None where only top-k is exposed


@dataclass(frozen=True)
class GenParams:
    """One greedy generation of the replay (the same for both targets)."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    json_schema: dict[str, Any] | None = None  # constrain the output to this schema
    ignore_eos: bool = False  # speed runs: every request makes exactly max_new_tokens


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str


class Target(Protocol):
    """A model to replay samples on."""

    label: str  # how the report names it ("kv_cache_dtype=int8", "http://host:port")

    def encode(self, text: str) -> list[int]: ...
    def chat_prompt(self, user_message: str) -> str: ...
    def position_dists(self, ids: list[int]) -> PositionDists: ...
    def token_logprobs(self, ids: list[int]) -> list[float]: ...  # positions 1 .. L-1
    def generate(self, prompts: list[list[int]], params: GenParams) -> list[Generation]: ...
    def close(self) -> None: ...


def parse_settings(text: str) -> dict[str, Any]:
    """``"kv_cache_dtype=int8,page_size=16"`` → engine settings, typed by ``EngineConfig``.

    Raises:
        InvalidRequestError: not ``key=value`` pairs, an unknown key, or a bad value.
    """
    hints = get_type_hints(EngineConfig)
    settings: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise InvalidRequestError(f"engine settings are key=value pairs, got {item!r}")
        if key not in hints:
            raise InvalidRequestError(f"unknown engine setting {key!r} in {text!r}")
        settings[key] = _typed(key, value.strip(), hints[key])
    EngineConfig.from_kwargs(**settings)  # NOTE: bad values fail here, before any load
    return settings


def _typed(key: str, value: str, hint: Any) -> Any:
    args = get_args(hint) if get_origin(hint) is Union or type(hint).__name__ == "UnionType" else (hint,)
    if value.lower() == "none" and type(None) in args:
        return None
    for kind in (bool, int, float):
        if kind in args:
            try:
                if kind is bool:
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    return value.lower() in ("true", "1")
                return kind(value)
            except ValueError:
                raise InvalidRequestError(f"{key} takes a value of type {kind.__name__}, got {value!r}") from None
    return value


class EngineTarget:
    """An in-process ``Engine`` built from ``settings`` (any ``EngineConfig`` fields)."""

    def __init__(self, settings: dict[str, Any], label: str | None = None) -> None:
        from runtime.engine import Engine  # NOTE: torch and the model load only here

        self.label = label or (",".join(f"{k}={v}" for k, v in settings.items()) or "defaults")
        self.engine = Engine(**settings)
        self.settings = dataclasses.asdict(self.engine.config)

    def encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text)["input_ids"])

    def chat_prompt(self, user_message: str) -> str:
        return self.engine.apply_chat_template([{"role": "user", "content": user_message}])

    def position_dists(self, ids: list[int]) -> PositionDists:
        logp = torch.log_softmax(self.engine.score(ids)[:-1].float(), dim=-1)
        top = logp.topk(TOP_K, dim=-1)
        return PositionDists(top.indices, top.values, logp)

    def token_logprobs(self, ids: list[int]) -> list[float]:
        logp = torch.log_softmax(self.engine.score(ids)[:-1].float(), dim=-1)
        return logp.gather(1, torch.tensor(ids[1:])[:, None]).flatten().tolist()

    def generate(self, prompts: list[list[int]], params: GenParams) -> list[Generation]:
        from runtime.sampling.params import SamplingParams

        sp = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0, stop=params.stop,
                            ignore_eos=params.ignore_eos, constraint=params.json_schema)
        outs = self.engine.generate(input_ids=prompts, sampling_params=sp)
        return [Generation(list(o.token_ids), o.text) for o in outs]

    def close(self) -> None:
        self.engine.close()


class ServerTarget:
    """A running Arbor server (native API): the same questions over HTTP.

    Whole distributions do not cross the wire: each position's top-20 logprobs come from
    a one-token generation of its prefix (the server's prefix cache makes that a
    one-token prefill), so KL against a server is truncated to the top 20 (see
    ``replay.mean_kl``).
    """

    def __init__(self, url: str, api_key: str | None = None, concurrency: int = 8) -> None:
        from runtime.server.client import ArborClient

        self.label = url
        self.client = ArborClient(url, api_key=api_key)
        self.settings: dict[str, Any] = {"url": url}
        self._loop = asyncio.new_event_loop()
        self._limit = asyncio.Semaphore(concurrency)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    async def _gen(self, ids: list[int], **params: Any) -> Any:
        from runtime.server.api.sglang.schema import NativeSamplingParams

        async with self._limit:
            return await self.client.generate(ids, NativeSamplingParams(temperature=0.0, **params))

    def encode(self, text: str) -> list[int]:
        return self.client.encode(text, add_special_tokens=True)

    def chat_prompt(self, user_message: str) -> str:
        return self.client.apply_chat_template([{"role": "user", "content": user_message}])

    def position_dists(self, ids: list[int]) -> PositionDists:
        async def all_positions() -> list[Any]:
            return await asyncio.gather(*(self._gen(ids[:p], max_new_tokens=1, ignore_eos=True, logprobs=True,
                                                    top_logprobs=TOP_K) for p in range(1, len(ids))))

        tops = [sorted(((int(t), float(lp)) for t, lp in out.meta.top_logprobs[0].items()),
                       key=lambda item: -item[1]) for out in self._run(all_positions())]
        return PositionDists(torch.tensor([[t for t, _ in top] for top in tops]),
                             torch.tensor([[lp for _, lp in top] for top in tops]), None)

    def token_logprobs(self, ids: list[int]) -> list[float]:
        return self._run(self.client.score(ids, start=1))

    def generate(self, prompts: list[list[int]], params: GenParams) -> list[Generation]:
        constraint = {"json_schema": params.json_schema} if params.json_schema is not None else None

        async def all_prompts() -> list[Any]:
            return await asyncio.gather(*(self._gen(ids, max_new_tokens=params.max_new_tokens, stop=list(params.stop),
                                                    ignore_eos=params.ignore_eos, constraint=constraint)
                                          for ids in prompts))

        return [Generation(list(out.output_ids), out.text) for out in self._run(all_prompts())]

    def close(self) -> None:
        self._loop.close()
