"""Server tests: a tiny random Llama engine behind a live uvicorn server on 127.0.0.1.

The model directory comes from the shared session fixture ``tiny_llama_dir``
(tests/conftest.py) when it exists, else it is built here the same way: a 2-layer random
Llama with the SmolLM2 tokenizer, so every request is fast on two CPU cores.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import API_KEY, LiveServer, auth

from runtime.model.default_model import default_model_dir  # noqa: E402

SMOLLM2_DIR = default_model_dir()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROGRAMS_FILE = Path(__file__).parent / "programs_fixture.py"


def _build_tiny_llama(out: Path) -> Path:
    import torch
    import transformers

    if not (SMOLLM2_DIR / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 tokenizer is not cached in {SMOLLM2_DIR} (run `make setup`)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (SMOLLM2_DIR / name).exists():
            shutil.copy(SMOLLM2_DIR / name, out / name)
    return out


@pytest.fixture(scope="session")
def server_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared ``tiny_llama_dir`` if another conftest provides it, else our own."""
    try:
        return Path(request.getfixturevalue("tiny_llama_dir"))
    except pytest.FixtureLookupError:
        return _build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engine(server_model_dir: Path) -> Iterator[Any]:
    from runtime import Engine

    eng = Engine(model=str(server_model_dir), num_pages=2048, max_model_len=512,
                 max_running_requests=32, num_threads=1, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def programs() -> dict[str, Any]:
    from runtime.server.hosting import load_programs

    return load_programs(PROGRAMS_FILE)


@pytest.fixture(scope="session")
def server(engine: Any, programs: dict[str, Any]) -> Iterator[LiveServer]:
    """One live server for the session: API key on, modest limits."""
    from runtime.server import ServerLimits, create_app

    limits = ServerLimits(max_inflight=64, max_body_bytes=256 * 1024, max_tokens=256,
                          request_timeout_s=30.0)
    app = create_app(engine, programs=programs, api_key=API_KEY, limits=limits)
    with LiveServer(app) as live:
        yield live


@pytest.fixture()
def idle_engine(engine: Any) -> Any:
    """The engine, idle and with sound page accounting before and after the test."""
    assert engine.wait_idle(30)
    engine.check_integrity()
    yield engine
    assert engine.wait_idle(30)
    engine.check_integrity()


@pytest.fixture()
def http(server: LiveServer) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=server.url, headers=auth(), timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def constraints_honoured(engine: Any) -> bool:
    """Whether the engine applies ``SamplingParams(constraint=...)`` (being wired in)."""
    try:
        from grammars import ChoiceConstraint
        from runtime import SamplingParams

        params = SamplingParams(max_new_tokens=4, temperature=0, constraint=ChoiceConstraint(("yes", "no")))
        out = engine.generate(input_ids=[1, 2, 3], sampling_params=params)[0]
    except Exception:
        return False
    return out.error is None and out.text in ("yes", "no")


