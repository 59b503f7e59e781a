"""SGLang-style programs, written against ``frontend_dsl.sgl`` as SGLang's docs write them,
run on the in-process engine and on ``RuntimeEndpoint`` (a live HTTP server over the same
engine); greedy programs must give the same result on both."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import frontend_dsl.sgl as sgl
from frontend_dsl.errors import UnsupportedFeatureError

IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
SCHEMA = json.dumps({"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "digit"], "additionalProperties": False})


@pytest.fixture(params=["engine", "endpoint"])
def backend(request: pytest.FixtureRequest, tiny_engine: Any) -> Any:
    return tiny_engine if request.param == "engine" else request.getfixturevalue("endpoint")


# ---- the programs, in SGLang's style ----

@sgl.function
def few_shot_qa(s, question):  # type: ignore[no-untyped-def]
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=8)


@sgl.function
def multi_turn_question(s, question_1, question_2):  # type: ignore[no-untyped-def]
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=6))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=6))


@sgl.function
def self_consistency(s, question, n=3):  # type: ignore[no-untyped-def]
    s += sgl.user(question)
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += sgl.assistant(sgl.gen("reasoning", max_tokens=6, temperature=0.8, seed=i))
    forks.join()


@sgl.function
def tree_of_thought(s, question):  # type: ignore[no-untyped-def]
    s += sgl.user(question)
    plans = s.fork(2)
    plans += sgl.assistant("Plan:" + sgl.gen("plan", max_tokens=4))
    for plan in plans:
        plan += sgl.user("Carry it out.")
        steps = plan.fork(2)
        steps += sgl.assistant(sgl.gen("step", max_tokens=4))
        steps.join()
    plans.join()


@sgl.function
def regex_gen(s):  # type: ignore[no-untyped-def]
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen("answer", temperature=0, regex=IP_REGEX, max_tokens=24)


@sgl.function
def json_extract(s, text):  # type: ignore[no-untyped-def]
    s += "Extract from: " + text + "\n"
    s += sgl.gen("json_output", max_tokens=48, json_schema=SCHEMA, temperature=0)


@sgl.function
def pick(s, method):  # type: ignore[no-untyped-def]
    s += "Is the sky blue? Answer: "
    s += sgl.select("answer", choices=["yes", "no", "it depends"], choices_method=method)


class ShortestChoice(sgl.ChoicesSamplingMethod):
    """A method of the user's own: the choice with the fewest tokens."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,  # type: ignore[no-untyped-def]
                 output_token_logprobs, unconditional_token_logprobs=None):
        best = min(range(len(choices)), key=lambda i: len(input_token_logprobs[i]))
        return sgl.ChoicesDecision(choices[best], {"lengths": [len(t) for t in input_token_logprobs]})


@sgl.function
def streaming(s, question):  # type: ignore[no-untyped-def]
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


@sgl.function
def begin_end_roles(s, question):  # type: ignore[no-untyped-def]
    s += sgl.system("Be brief.")
    s += sgl.user_begin()
    s += "Question: " + question
    s += sgl.user_end()
    s += sgl.assistant_begin()
    s += sgl.gen("answer", max_tokens=4, temperature=0)
    s += sgl.assistant_end()


@sgl.function
def typed(s):  # type: ignore[no-untyped-def]
    s += "How many legs has a spider? " + sgl.gen_int("legs", max_tokens=4)
    s += "\nIs it an insect? " + sgl.gen("insect", dtype=bool, max_tokens=4)
    # NOTE: gen_string is tested on the fake backend: the tiny random model rarely closes a quote


@sgl.function
def concat_join(s):  # type: ignore[no-untyped-def]
    s += "Two tips:"
    tips = s.fork(2)
    tips += sgl.gen("tip", max_tokens=3, temperature=0)
    tips.join(mode="concate_and_append")
    s += "\nSummary:" + sgl.gen("summary", max_tokens=3, temperature=0)


@sgl.function
def scoped(s, name):  # type: ignore[no-untyped-def]
    s["name"] = name
    with s.var_scope("greeting"):
        s += "Hello " + name + "," + sgl.gen(max_tokens=3, temperature=0)
    s += "\nReply:" + sgl.gen("reply", max_tokens=3, temperature=0)
    return s["greeting"]


@sgl.function
def with_logprobs(s):  # type: ignore[no-untyped-def]
    s += "Count: one, two," + sgl.gen("next", max_tokens=3, temperature=0, return_logprob=True,
                                       top_logprobs_num=2, logprob_start_len=2)


@sgl.function
def run_level_defaults(s, topic):  # type: ignore[no-untyped-def]
    s += "About " + topic + ":" + sgl.gen("a") + sgl.gen("b", max_tokens=2)


# ---- the tests ----

def test_few_shot_qa(backend: Any) -> None:
    state = few_shot_qa.run(question="What is the capital of Italy?", backend=backend)
    assert "\n" not in state["answer"] and state.text().endswith(state["answer"])
    assert state.get_meta_info("answer")["finish_reason"] in ("stop", "length")


def test_multi_turn_messages(backend: Any) -> None:
    state = multi_turn_question.run(question_1="Hi?", question_2="And?", backend=backend, temperature=0)
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == state["answer_1"]
    assert state.messages()[4]["content"] == state["answer_2"]


def test_self_consistency_gathers_every_branch(backend: Any) -> None:
    state = self_consistency.run("What is 2+2?", backend=backend)
    assert len(state["reasoning"]) == 3 and all(isinstance(r, str) for r in state["reasoning"])


def test_tree_of_thought_nests(backend: Any) -> None:
    state = tree_of_thought.run("Plan a trip.", backend=backend, temperature=0)
    assert len(state["plan"]) == 2 and [len(x) for x in state["step"]] == [2, 2]


def test_regex_extraction(backend: Any) -> None:
    import re

    answer = regex_gen.run(backend=backend)["answer"]
    assert re.fullmatch(IP_REGEX, answer), answer


def test_json_schema_gives_text_as_sglang_does(backend: Any) -> None:
    state = json_extract.run("yes, 4", backend=backend)
    text = state["json_output"]
    assert isinstance(text, str)
    value = json.loads(text)
    assert value["answer"] in ("yes", "no") and 0 <= value["digit"] <= 9


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized, ShortestChoice()])
def test_select_with_each_method(backend: Any, method: Any) -> None:
    state = pick.run(method, backend=backend)
    assert state["answer"] in ("yes", "no", "it depends")
    assert state.text().endswith(state["answer"])
    if isinstance(method, ShortestChoice):
        assert state["answer"] in ("yes", "no")  # one token each; "it depends" has more
    else:
        scores = state.get_meta_info("answer")["scores"]
        assert max(scores, key=lambda c: scores[c]) == state["answer"]


def test_streaming_with_text_iter(backend: Any) -> None:
    state = streaming.run(question="Say something.", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state.sync()["answer"]
    assert "".join(streaming.run(question="Say something.", backend=backend, stream=True).text_iter()) \
        == state.text()

    async def collect() -> str:
        streamed = streaming.run(question="Say something.", backend=backend, stream=True)
        return "".join([p async for p in streamed.text_async_iter("answer")])

    assert asyncio.run(collect()) == state["answer"]


def test_run_batch_with_dicts(backend: Any) -> None:
    states = few_shot_qa.run_batch([{"question": "Capital of Spain?"}, {"question": "Capital of Peru?"}],
                                   backend=backend, num_threads=2, progress_bar=False)
    # NOTE: greedy, so each batched answer is the one a run of that question alone gives
    alone = [few_shot_qa.run(question=q, backend=backend)["answer"]
             for q in ("Capital of Spain?", "Capital of Peru?")]
    assert [s["answer"] for s in states] == alone
    assert states[0].text().endswith("Q: Capital of Spain?\nA:" + alone[0])
    assert states[0].text().count("Q: ") == 3


def test_role_begin_end(backend: Any) -> None:
    state = begin_end_roles.run("Why?", backend=backend)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[1]["content"] == "Question: Why?"


def test_typed_gens(backend: Any) -> None:
    state = typed.run(backend=backend, temperature=0)
    assert isinstance(state["legs"], int) and isinstance(state["insect"], bool)
    assert state.text().endswith(str(state["insect"]))


def test_concat_join_and_scopes(backend: Any) -> None:
    state = concat_join.run(backend=backend)
    tips = state["tip"]
    assert state.text().startswith("Two tips:" + tips[0] + tips[1])
    scoped_state = scoped.run("Ada", backend=backend)
    assert scoped_state["name"] == "Ada" and scoped_state["greeting"].startswith("Hello Ada,")
    assert scoped_state.ret_value == scoped_state["greeting"] and scoped_state.error() is None


def test_meta_info_logprobs(backend: Any) -> None:
    info = with_logprobs.run(backend=backend).get_meta_info("next")
    assert len(info["output_token_logprobs"]) == info["completion_tokens"]
    assert all(lp <= 0 and isinstance(t, int) for lp, t, _ in info["output_token_logprobs"])
    assert all(len(step) == 2 for step in info["output_top_logprobs"])
    assert len(info["input_token_logprobs"]) == info["prompt_tokens"] - 2


def test_run_level_defaults(backend: Any) -> None:
    state = run_level_defaults.run("cats", backend=backend, max_new_tokens=3, temperature=0)
    assert state.get_meta_info("a")["completion_tokens"] <= 3
    assert state.get_meta_info("b")["completion_tokens"] <= 2


def test_same_greedy_results_in_process_and_over_http(tiny_engine: Any, endpoint: Any) -> None:
    programs = [(few_shot_qa, {"question": "Capital of Italy?"}), (regex_gen, {}),
                (begin_end_roles, {"question": "Why?"}), (json_extract, {"text": "no, 3"}),
                (pick, {"method": sgl.greedy_token_selection})]
    for fn, kwargs in programs:
        local, remote = fn.run(backend=tiny_engine, **kwargs), fn.run(backend=endpoint, **kwargs)
        assert local.text() == remote.text(), fn.name


def test_bind_fixes_arguments(backend: Any) -> None:
    italy = few_shot_qa.bind(question="Capital of Italy?")
    assert italy.run(backend=backend).text() == few_shot_qa.run("Capital of Italy?", backend=backend).text()
    with pytest.raises(sgl.ProgramDefinitionError, match="no parameters"):
        few_shot_qa.bind(topic="x")


def test_unmappable_features_name_themselves() -> None:
    for call, name in [(lambda: sgl.image("cat.png"), "sgl.image"), (lambda: sgl.video("v.mp4", 4), "sgl.video"),
                       (lambda: sgl.Runtime(model_path="x"), "sgl.Runtime"),
                       (lambda: sgl.separate_reasoning(), "separate_reasoning"),
                       (lambda: sgl.function(num_api_spec_tokens=4), "num_api_spec_tokens"),
                       (lambda: sgl.RuntimeEndpoint("http://x", chat_template_name="llama"), "chat_template_name"),
                       (lambda: sgl.Anthropic("claude"), "sgl.Anthropic"), (lambda: sgl.flush_cache(), "flush_cache")]:
        with pytest.raises(UnsupportedFeatureError, match=name):
            call()


def test_openai_maps_to_openai_backend() -> None:
    backend = sgl.OpenAI("gpt-4o-mini", api_key="k")
    assert (backend.model, backend.dialect) == ("gpt-4o-mini", "openai")


def test_set_default_backend(tiny_engine: Any) -> None:
    sgl.set_default_backend(tiny_engine)
    try:
        assert few_shot_qa.run(question="Capital of Italy?").text().startswith("The following")
    finally:
        import frontend_dsl.default_backend as default_backend

        default_backend._default_backend = None


@pytest.mark.slow
def test_sglang_programs_on_the_default_model(default_engine: Any) -> None:
    import re

    assert few_shot_qa.run(default_engine, "What is the capital of Italy?")["answer"] == " Rome"
    assert re.fullmatch(IP_REGEX, regex_gen.run(backend=default_engine)["answer"])
    value = json.loads(json_extract.run("yes, 4", backend=default_engine)["json_output"])
    assert value == {"answer": "yes", "digit": 4}
    state = multi_turn_question.run("What is the capital of France?", "And of Spain?",
                                    backend=default_engine, temperature=0, max_new_tokens=16)
    assert "Paris" in state["answer_1"]
