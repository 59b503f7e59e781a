"""The GGUF tokenizer built without transformers (``gguf_vocab.py``, ``fast_tokenizer.py``,
``chat_template.py``) is the tokenizer transformers' converter builds from the same file:
the same backend (JSON), ids, decoding, special tokens and chat rendering, for every
pre-tokenizer kind; kinds it does not build go through transformers; and loading an
engine from a GGUF file never imports transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import jinja2
import pytest
from test_family_files import MULTILINGUAL

from runtime.errors import ModelLoadError
from runtime.model.fast_tokenizer import FastTokenizer
from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_tokenizer import gguf_tokenizer, transformers_tokenizer
from runtime.model.loader import gguf_file

REPO = Path(__file__).resolve().parents[3]
TEXTS = [*MULTILINGUAL, "I'M GOING, they'LL see 12345678 3.14", "ǅemo x̃ a\u0301b", "path/to\r\nfile//x",
         "   \n\n  \t", "<|im_end|><|im_start|>", "<think>hm</think>"]
# (tokenizer.ggml.pre, what else the file says): every split transformers knows, one name
# it does not (split as GPT-2), and files that rename EOS, add user tokens, BOS, EOS, pad
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm": ("smollm", {}),
    "llama3": ("llama-bpe", {"add_bos": True}),
    "qwen2": ("qwen2", {"user_defined": ["<think>", "</think>"]}),
    "qwen35": ("qwen35", {}),
    "tekken": ("tekken", {"add_eos": True}),
    "gpt-4o": ("gpt-4o", {"pad": 0}),
    "unknown-pre": ("deepseek-llm", {}),
    "no-endoftext": ("llama-bpe", {"rename": {0: "<|end_of_text|>"}, "add_bos": True, "add_eos": True}),
}


@pytest.fixture(scope="module")
def default_meta() -> dict[str, Any]:
    file = GGUFFile(gguf_file("default"))
    try:
        return dict(file.metadata)
    finally:
        file.close()


def write_byte_level(path: Path, meta: dict[str, Any], pre: str, rename: dict[int, str] | None = None,
                     user_defined: list[str] | None = None, add_bos: bool | None = None,
                     add_eos: bool | None = None, pad: int | None = None) -> Path:
    """A tokenizer-only GGUF of the default model's byte-level vocabulary, with ``pre`` and
    the given changes (tokens renamed, tokens re-typed as user-defined, flags)."""
    import gguf

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    for index, token in (rename or {}).items():
        tokens[index] = token
    for token in user_defined or []:
        tokens.append(token)
        types.append(4)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if pad is not None:
        writer.add_pad_token_id(pad)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    return path


def both(path: Path) -> tuple[Any, Any]:
    """(Arbor's tokenizer of the file, transformers' converter's of the same metadata)."""
    file = GGUFFile(path)
    try:
        return gguf_tokenizer(file), transformers_tokenizer(file)
    finally:
        file.close()


def assert_same_tokenizer(ours: Any, ref: Any, texts: list[str]) -> None:
    assert isinstance(ours, FastTokenizer)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert ours(texts)["input_ids"] == ref(texts)["input_ids"]
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "bos_token", "eos_token",
                 "special_tokens_map", "chat_template", "vocab_size"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert set(ours.all_special_ids) == set(ref.all_special_ids)
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}
    last = len(ours) - 1
    assert ours.convert_ids_to_tokens([0, 1, last]) == ref.convert_ids_to_tokens([0, 1, last])


@pytest.mark.parametrize("kind", list(KINDS))
def test_byte_level_kinds_equal_the_transformers_converter(kind: str, tmp_path: Path,
                                                           default_meta: dict[str, Any]) -> None:
    """Each pre-tokenizer kind (Llama 3, Qwen 2 / 3.5, Tekken, GPT-4o, a name transformers
    does not know), and files with user-defined tokens, BOS / EOS flags, a pad token and no
    ``<|endoftext|>`` (the converter adds one): the same tokenizer, text by text."""
    pre, changes = KINDS[kind]
    ours, ref = both(write_byte_level(tmp_path / f"{kind}.gguf", default_meta, pre, **changes))
    assert_same_tokenizer(ours, ref, TEXTS)
    for text in MULTILINGUAL:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text, text
    if "user_defined" in changes:
        assert ours.encode("<think>", add_special_tokens=False) == [len(default_meta["tokenizer.ggml.tokens"])]


def test_the_default_model_tokenizer_needs_no_transformers() -> None:
    """The default model's file: a ``FastTokenizer`` equal to the converter's."""
    ours, ref = both(gguf_file("default"))
    assert_same_tokenizer(ours, ref, TEXTS)


def test_a_bad_vocabulary_is_a_model_load_error(tmp_path: Path, default_meta: dict[str, Any]) -> None:
    """A merge of pieces that are not in the vocabulary: a typed error naming the file."""
    meta = dict(default_meta, **{"tokenizer.ggml.merges": ["no_such_piece another_one"]})
    path = write_byte_level(tmp_path / "bad.gguf", meta, "smollm")
    file = GGUFFile(path)
    try:
        with pytest.raises(ModelLoadError, match="cannot build the tokenizer"):
            gguf_tokenizer(file)
    finally:
        file.close()


# ---- chat templates ------------------------------------------------------------------
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{% if 'tool_calls' in m %}[calls]{% endif %}{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{{ ns.n }}{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ dict(a=1) | tojson }}")
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. «ü» <b>"},
    {"role": "user", "content": "  What is 2 + 2?  "},
    {"role": "assistant", "content": "4", "thinking": "add them", "tool_calls": None},
    {"role": "stop", "content": "never shown"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def default_tokenizer() -> FastTokenizer:
    file = GGUFFile(gguf_file("default"))
    try:
        tokenizer = gguf_tokenizer(file)
    finally:
        file.close()
    assert isinstance(tokenizer, FastTokenizer)
    return tokenizer


def with_template(tokenizer: FastTokenizer, template: str) -> FastTokenizer:
    return FastTokenizer(tokenizer.backend_tokenizer, replace(tokenizer._config, chat_template=template))


@pytest.mark.parametrize("template", ["file", "tools"])
def test_chat_rendering_equals_transformers(template: str, default_tokenizer: FastTokenizer) -> None:
    """The file's template and one using tools, ``tojson``, ``namespace``, ``break``,
    ``dict``, ``trim``, template variables and a message's reasoning under another name
    (and a None-valued key, dropped): rendered as transformers renders them."""
    ours = default_tokenizer if template == "file" else with_template(default_tokenizer, TOOLS_TEMPLATE)
    ref = ours.as_transformers()
    for messages in (MESSAGES[:1], MESSAGES[1:2], MESSAGES):
        for generation in (True, False):
            for extra in ({}, {"tools": TOOLS, "enable_thinking": False}):
                want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)
                got = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)
                assert got == want, (messages, generation, extra)
    if template == "tools":
        assert "[calls]" not in got and "<think>add them</think>" in got and "never shown" not in got


def test_chat_errors_and_what_transformers_renders(default_tokenizer: FastTokenizer) -> None:
    """``raise_exception`` is a jinja2 ``TemplateError``, private namespace names are
    refused, no messages is a ValueError; a ``{% generation %}`` block, continuing the last
    message and tokenizing go to transformers and give its answer."""
    raising = with_template(default_tokenizer, "{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        raising.apply_chat_template(MESSAGES, tokenize=False)
    private = with_template(default_tokenizer, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        private.apply_chat_template(MESSAGES, tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        default_tokenizer.apply_chat_template([], tokenize=False)
    tracked = with_template(default_tokenizer, "{% for m in messages %}{% generation %}{{ m['content'] }}"
                                               "{% endgeneration %}{% endfor %}")
    assert tracked.apply_chat_template(MESSAGES[:2], tokenize=False) == "Be brief. «ü» <b>  What is 2 + 2?  "
    ref = default_tokenizer.as_transformers()
    prefix = [*MESSAGES[1:2], {"role": "assistant", "content": "The answer is"}]
    assert (default_tokenizer.apply_chat_template(prefix, tokenize=False, continue_final_message=True)
            == ref.apply_chat_template(prefix, tokenize=False, continue_final_message=True))
    assert (list(default_tokenizer.apply_chat_template(MESSAGES[:2], return_dict=False))
            == list(ref.apply_chat_template(MESSAGES[:2], return_dict=False)))


def test_other_attributes_come_from_the_transformers_twin(default_tokenizer: FastTokenizer) -> None:
    """What ``FastTokenizer`` does not answer itself, transformers' tokenizer of the same
    backend does; grammar backends get that tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from runtime.constrained.registry import create_backend

    twin = default_tokenizer.as_transformers()
    assert isinstance(twin, PreTrainedTokenizerFast) and twin is default_tokenizer.as_transformers()
    assert default_tokenizer.model_input_names == twin.model_input_names
    assert default_tokenizer.encode("a  b", add_special_tokens=False, truncation=True, max_length=1) == \
        twin.encode("a  b", add_special_tokens=False)[:1]
    backend = create_backend("llguidance", default_tokenizer)
    assert backend.eos_token_id == default_tokenizer.eos_token_id


def test_loading_an_engine_from_a_gguf_never_imports_transformers() -> None:
    """The whole load (Engine on the default model's GGUF), then encoding, chat rendering
    and decoding: ``transformers`` is never imported."""
    code = ("import sys\nfrom runtime import Engine\n"
            "e = Engine(model='default', max_running_requests=1, max_model_len=128, num_pages=16)\n"
            "p = e.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "e.tokenizer.decode(e.tokenizer.encode(p))\ne.close()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
