"""The real ``sglang`` package's frontend (``sgl.RuntimeEndpoint``) running its programs
against a live Arbor server, and through ``arbor router``: gen with max_tokens / stop /
regex / json_schema, select, fork, roles, run_batch, streaming and logprobs.

The package is installed without its dependencies (``pip install --no-deps sglang`` plus
the few light modules its frontend imports: the ``sglang-frontend`` extra); see
docs/http-api.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from server_helpers import API_KEY, LiveServer

from runtime import SamplingParams

sgl = pytest.importorskip("sglang", reason="sglang frontend not installed")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def backend(server: LiveServer) -> Any:
    return sgl.RuntimeEndpoint(server.url, api_key=API_KEY, chat_template_name="chatml")


@pytest.fixture(scope="module")
def routed_backend(server: LiveServer) -> Iterator[Any]:
    from runtime.router.app import create_router_app

    with LiveServer(create_router_app([server.url], api_key=API_KEY)) as router:
        yield sgl.RuntimeEndpoint(router.url, api_key=API_KEY, chat_template_name="chatml")


def evictable(engine: Any) -> float:
    """Prefix-cache pages no request holds (what a flush frees)."""
    m = engine.metrics()
    return float(m["kv_pages_total"] - m["kv_pages_free"] - m["kv_pages_used"])


def greedy(engine: Any, prompt: str, max_new_tokens: int, **kw: Any) -> Any:
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw))[0]


@sgl.function
def complete(s: Any, prompt: str, max_tokens: int = 6, stop_at: Any = ()) -> None:
    # NOTE: not "stop": run() takes that keyword itself (a default for every gen)
    s += prompt
    s += sgl.gen("x", max_tokens=max_tokens, temperature=0, stop=stop_at)


def test_the_constructor_reads_the_model_info(backend: Any, server: LiveServer, engine: Any) -> None:
    assert backend.get_model_name() == engine.config.model
    info = backend.get_server_info()
    assert info["served_model_name"] == "m" and info["context_length"] == engine.max_model_len
    backend.flush_cache()


def test_gen_with_max_tokens_and_stop_equals_the_engine(backend: Any, engine: Any) -> None:
    state = complete.run(PROMPT, backend=backend)
    want = greedy(engine, PROMPT, 6)
    assert state["x"] == want.text
    meta = state.get_meta_info("x")
    assert meta["completion_tokens"] == 6 and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(want.prompt_token_ids)
    stop = want.text[len(want.text) // 2:][:2]
    assert stop.strip()
    cut = complete.run(PROMPT, stop_at=stop, backend=backend)
    assert cut["x"] == greedy(engine, PROMPT, 6, stop=(stop,)).text
    assert stop not in cut["x"] and cut.get_meta_info("x")["finish_reason"]["type"] == "stop"


def test_gen_with_regex_and_json_schema(backend: Any) -> None:
    @sgl.function
    def constrained(s: Any) -> None:
        s += "Numbers: "
        s += sgl.gen("code", max_tokens=8, regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0)
        s += "\nJSON: "
        s += sgl.gen("obj", max_tokens=40, json_schema=json.dumps(SCHEMA), temperature=1.0)
        s += "\nInt: "
        s += sgl.gen("i", max_tokens=8, dtype=int, temperature=1.0)

    state = constrained.run(backend=backend)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", state["code"]), state["code"]
    jsonschema.validate(json.loads(state["obj"]), SCHEMA)
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", state["i"]) or state.get_meta_info("i")["finish_reason"]["type"] \
        == "length"


def test_select_picks_the_best_scored_choice(backend: Any) -> None:
    @sgl.function
    def pick(s: Any) -> None:
        s += "My favourite colour is "
        s += sgl.select("c", choices=["red", "blue", "dark green"])

    state = pick.run(backend=backend)
    meta = state.get_meta_info("c")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 3 and all(isinstance(v, float) for v in scores)
    assert state["c"] == ["red", "blue", "dark green"][scores.index(max(scores))]
    assert all(lp[0] is None or lp[0] <= 0 for lps in meta["input_token_logprobs"] for lp in lps)


def test_fork_roles_and_run_batch(backend: Any, engine: Any) -> None:
    @sgl.function
    def branches(s: Any) -> None:
        s += "List:"
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen("item", max_tokens=3, temperature=0)
        forks.join()
        s["items"] = [f["item"] for f in forks]

    state = branches.run(backend=backend)
    want = greedy(engine, "List:", 3).text
    assert state["items"] == [want, want]

    @sgl.function
    def chat(s: Any, question: str) -> None:
        s += sgl.system("You are terse.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=5, temperature=0))

    state = chat.run("Name a colour.", backend=backend)
    prompt = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n" \
             "<|im_start|>assistant\n"
    assert state.text().startswith(prompt)
    assert state["answer"] == greedy(engine, prompt, 5).text

    batch = complete.run_batch([{"prompt": p, "max_tokens": 4} for p in ("Hello", "One two", PROMPT)],
                               backend=backend)
    assert [s["x"] for s in batch] == [greedy(engine, p, 4).text for p in ("Hello", "One two", PROMPT)]


def test_streaming_yields_the_same_text(backend: Any, engine: Any) -> None:
    state = complete.run(PROMPT, max_tokens=8, stream=True, backend=backend)
    pieces = list(state.text_iter("x"))
    assert len(pieces) > 1
    assert "".join(pieces) == greedy(engine, PROMPT, 8).text == state["x"]


def test_logprobs_of_the_generated_tokens(backend: Any, engine: Any) -> None:
    @sgl.function
    def scored(s: Any) -> None:
        s += PROMPT
        s += sgl.gen("x", max_tokens=4, temperature=0, return_logprob=True, top_logprobs_num=3,
                     return_text_in_logprobs=True)

    state = scored.run(backend=backend)
    meta = state.get_meta_info("x")
    want = greedy(engine, PROMPT, 4, logprobs=True, top_logprobs=3)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want.token_ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(want.logprobs, abs=1e-4)
    assert "".join(text for _, _, text in meta["output_token_logprobs"]) == state["x"]
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == token and top[0][0] == pytest.approx(lp)  # greedy: the best


def test_programs_run_through_the_router(routed_backend: Any, engine: Any) -> None:
    complete.run(PROMPT * 6, backend=routed_backend)
    assert engine.wait_idle(30) and evictable(engine) > 0
    routed_backend.flush_cache()  # the router sends it to every worker
    assert evictable(engine) == 0  # pages other tests hold locked may stay
    state = complete.run(PROMPT, backend=routed_backend)
    assert state["x"] == greedy(engine, PROMPT, 6).text
    streamed = complete.run(PROMPT, max_tokens=5, stream=True, backend=routed_backend)
    assert "".join(streamed.text_iter("x")) == greedy(engine, PROMPT, 5).text
