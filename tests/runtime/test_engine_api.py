"""Engine behaviour a user notices: seeds, bad input, stop handling, streaming, abort."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime import Engine, InvalidRequestError, ModelLoadError, PromptTooLongError, SamplingParams
from runtime.errors import EngineClosedError
from runtime.output.request_output import RequestOutput
from runtime.scheduler.batch import ScheduledBatch


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Engine:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=1024, max_model_len=256)
    yield engine
    engine.close()


@pytest.mark.slow
def test_seeded_request_same_alone_and_in_batch(default_engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    def chat(text: str) -> str:
        return default_engine.apply_chat_template([{"role": "user", "content": text}])

    prompt = chat("Write a short poem about the sea.")
    alone = default_engine.generate(prompt, params)[0]
    assert len(alone.token_ids) > 5
    others = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=i) for i in range(8)]
    batch = default_engine.generate([chat(f"Tell me about topic {i}.") for i in range(8)] + [prompt],
                                    others + [params])
    assert batch[-1].token_ids == alone.token_ids
    again = default_engine.generate(prompt, params)[0]
    assert again.token_ids == alone.token_ids
    different = default_engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.9, seed=99))[0]
    assert different.token_ids != alone.token_ids


@pytest.mark.parametrize(
    "make_params, message",
    [
        (lambda: SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
        (lambda: SamplingParams(top_k=-3), "top_k"),
        (lambda: SamplingParams(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params_raise(make_params, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match=message):
        make_params()


def test_bad_requests_raise_and_engine_keeps_serving(tiny: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.generate("", SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.generate(input_ids=[[]], sampling_params=SamplingParams(max_new_tokens=4))
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        tiny.generate(input_ids=[list(range(5, 300))], sampling_params=SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="input_ids"):
        tiny.generate(input_ids=[[1, 2, 10**9]], sampling_params=SamplingParams(max_new_tokens=4))
    out = tiny.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_unknown_model_and_corrupt_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model=str(tmp_path / "nope"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="GGUF"):
        Engine(model=str(bad))
    empty_dir = tmp_path / "dir"
    empty_dir.mkdir()
    (empty_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        Engine(model=str(empty_dir))


def test_unknown_engine_setting_raises(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="unknown engine setting"):
        Engine(model=str(tiny_llama_dir), page_sise=4)


def test_stop_strings_and_stop_ids(default_engine: Engine) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    free = default_engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0))[0]
    assert " 8" in free.text
    stopped = default_engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0, stop=[" 8"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(" 8")]
    first = free.token_ids[2]
    by_id = default_engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0,
                                                           stop_token_ids=[first]))[0]
    assert by_id.token_ids == free.token_ids[:2] and by_id.finish_reason == "stop"


def test_streaming_deltas_add_up_and_never_hold_stop_text(default_engine: Engine) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    params = SamplingParams(max_new_tokens=20, temperature=0, stop=[" 9,"])

    async def collect() -> list:  # type: ignore[type-arg]
        return [o async for o in default_engine.generate_stream(prompt, params)]

    outs = asyncio.run(collect())
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert all(" 9," not in o.text for o in outs)
    assert sum(len(o.delta_token_ids) for o in outs) == len(outs[-1].token_ids)


def test_utf8_never_split(default_engine: Engine) -> None:
    prompt = default_engine.apply_chat_template([{"role": "user", "content": "Write three emoji: 🎉🚀🌍"}])

    async def collect() -> list:  # type: ignore[type-arg]
        params = SamplingParams(max_new_tokens=24, temperature=0)
        return [o async for o in default_engine.generate_stream(prompt, params)]

    outs = asyncio.run(collect())
    assert all("\ufffd" not in o.delta_text for o in outs)
    assert "".join(o.delta_text for o in outs) == outs[-1].text


def test_abort_mid_stream_frees_pages(tiny: Engine) -> None:
    aborts = tiny.metrics()["num_aborts"]  # NOTE: the engine is shared: count this test's own

    async def run() -> None:
        gen = tiny.generate_stream(input_ids=list(range(10, 60)),
                                   sampling_params=SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True))
        async for out in gen:
            if len(out.token_ids) >= 3:
                break
        await gen.aclose()

    asyncio.run(run())
    assert tiny.wait_idle(5)
    tiny.check_integrity()
    assert tiny.metrics()["kv_pages_used"] == 0
    assert tiny.metrics()["num_aborts"] == aborts + 1


def test_chat_template_and_cli(default_engine: Engine) -> None:
    text = default_engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    out = default_engine.generate(default_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]),
        SamplingParams(max_new_tokens=16, temperature=0))[0]
    assert "Paris" in out.text


def test_close_ends_requests_in_flight_and_refuses_new_ones(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=256, max_model_len=256,
                    max_running_requests=1)
    engine.add_step_hook(lambda _: time.sleep(0.01))  # the requests are certainly unfinished at close
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, speculation=False)
    finals: list[RequestOutput] = []
    engine.add_request(input_ids=list(range(10, 40)), params=params,
                       callback=lambda out: finals.append(out) if out.finished else None)
    blocked: list[list[RequestOutput]] = []  # generate() in another thread, queued behind
    waiter = threading.Thread(target=lambda: blocked.append(engine.generate(input_ids=[list(range(50, 60))],
                                                                            sampling_params=params)),
                              daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while engine.metrics()["num_running"] < 1 or engine.metrics()["num_waiting"] < 1:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)

    engine.close()
    waiter.join(5)
    assert not waiter.is_alive(), "generate() still waits on a closed engine"
    for out in [*finals, *blocked[0]]:
        assert out.finish_reason == "abort" and out.error == "the engine was closed"
    engine.check_integrity()
    assert engine.metrics()["kv_pages_used"] == 0
    with pytest.raises(EngineClosedError):
        engine.add_request(input_ids=[1, 2, 3], params=params)
    engine.close()  # a second close does nothing


@pytest.mark.slow
def test_a_script_may_exit_while_its_engine_is_busy() -> None:
    # Without the engine's exit hook this aborted the interpreter ("terminate called
    # without an active exception", status 134) in 4 of 5 runs: the loop thread was
    # inside a forward pass at shutdown.
    # The script leaves as soon as the step hook has run: the loop thread is then starting
    # the forward pass of a 1,500-token prefill.
    script = (
        "import threading\n"
        "from runtime import Engine, SamplingParams\n"
        "engine = Engine(model='default')\n"
        "stepping = threading.Event()\n"
        "engine.add_step_hook(lambda batch: stepping.set())\n"
        "ids = [1 + (j * 7919) % 40000 for j in range(1500)]\n"
        "engine.add_request(input_ids=ids, params=SamplingParams(max_new_tokens=50))\n"
        "assert stepping.wait(60), 'the engine never stepped'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_ctrl_c_in_generate_aborts_its_requests(tiny: Engine) -> None:
    prompts = [list(range(10, 30)), list(range(40, 50))]
    interrupted = threading.Event()

    def interrupt_once_both_decode(batch: ScheduledBatch) -> None:
        time.sleep(0.01)  # a slowed step: 200 tokens take 2 s, so neither finishes first
        decoding = [r.prompt_ids for r in batch.decode]
        if all(p in decoding for p in prompts) and not interrupted.is_set():
            interrupted.set()
            # Raised on the engine thread, as an OS may deliver a Ctrl-C to any thread.
            signal.raise_signal(signal.SIGINT)

    assert tiny.wait_idle(10)
    remove_hook = tiny.add_step_hook(interrupt_once_both_decode)
    # NOTE: Python's own handler, whatever the launcher left: a shell's background job (and
    # so a Python started by one) ignores SIGINT.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    aborts = tiny.metrics()["num_aborts"]
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, speculation=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            tiny.generate(input_ids=prompts, sampling_params=params)
    finally:
        signal.signal(signal.SIGINT, previous)
        remove_hook()
    assert interrupted.is_set()
    assert tiny.wait_idle(5), "the interrupted requests kept running"
    assert tiny.metrics()["num_aborts"] == aborts + 2
    tiny.check_integrity()
    assert tiny.metrics()["kv_pages_used"] == 0


def test_a_duplicate_request_id_is_refused_while_the_first_is_live(tiny: Engine) -> None:
    """Live ids are the scheduler's (and the grammar queue's): the second submission of an
    id in flight is refused, and the id is free again once its request finished."""
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    finals: list[RequestOutput] = []
    tiny.add_request(input_ids=list(range(10, 30)), params=params, request_id="same",
                     callback=lambda out: finals.append(out) if out.finished else None)
    with pytest.raises(InvalidRequestError, match="duplicate request id 'same'"):
        tiny.add_request(input_ids=list(range(10, 30)), params=params, request_id="same")
    assert tiny.wait_idle(30) and [f.finish_reason for f in finals] == ["length"]
    again = tiny.generate(input_ids=[list(range(10, 30))], sampling_params=params)
    assert again[0].token_ids == finals[0].token_ids
    tiny.add_request(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=1), request_id="same")
    assert tiny.wait_idle(30)
    tiny.check_integrity()
