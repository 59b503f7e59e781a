"""What a family's own files carry, end to end: the tokenizer read from a GGUF gives
transformers' token ids on a multilingual and code text set, and ``arbor serve`` on a
family's GGUF answers an OpenAI chat call with the file's chat template, stopping on the
file's stop token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from family_models import hf_greedy, write_family_gguf
from test_families import GEMMA_TEMPLATE, GGUF_ARCH, _save
from test_moe_families import save_tiny_moe, write_moe_gguf

from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_tokenizer import gguf_tokenizer
from runtime.model.loader import gguf_file, resolve_model_dir
from tests.runtime.server.server_helpers import start_server

# English, German, French, Chinese, Japanese, Russian, Arabic, emoji (skin tone, ZWJ
# family, a flag), Python, JSON, runs of spaces / tabs / newlines, and edge cases
# (empty, only whitespace, the special tokens written as text).
MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "Größere Straßenbahnhaltestellen müssen barrierefrei sein, oder? Übermäßig!",
    "L'été dernier, nous sommes allés à Marseille — c'était génial ! « Très » bien.",
    "人工智能正在改变世界。我们今天去北京吧！",
    "吾輩は猫である。名前はまだ無い。カタカナとひらがな、ｶﾀｶﾅ。",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "اللغة العربية جميلة جدا، أليس كذلك؟ ١٢٣",
    "emoji 😀👍🏽👨‍👩‍👧‍👦🇩🇪 ✨🤖",
    "import json\n\n\nclass A:\n    def f(self, x: int) -> int:\n        return x ** 2  # square\n",
    '{"name": "Arbor", "tags": ["a", "b"], "n": 1.5e3, "ok": true, "nested": {"k": null}}',
    "a    b\t\t\tc\n\n\n\n  d      \n", "   ", "\n", "", " x", "x ", "\r\n\r\n",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>",
]


def test_the_gguf_tokenizer_equals_transformers_on_many_languages_and_code() -> None:
    """The default model's GGUF tokenizer against transformers' tokenizer of the same
    model (its tokenizer.json): equal ids, decoding that round-trips the text, and
    decoding equal to transformers' (special tokens kept)."""
    from transformers import AutoTokenizer

    file = GGUFFile(gguf_file("default"))
    try:
        ours = gguf_tokenizer(file)
    finally:
        file.close()
    ref = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    for text in MULTILINGUAL:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == text, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    batch = ours(MULTILINGUAL)["input_ids"]
    assert batch == ref(MULTILINGUAL)["input_ids"]


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_the_tokenizer_of_the_real_shape_files_equals_transformers(vocab: int, tmp_path: Path) -> None:
    """The tokenizer metadata ``benchmarks/bench_scale.py`` writes into its 1B file (the
    default model's 49,152 tokens) and its 8B-shape file (those, then reserved tokens up to
    Llama 3's 128,256), read back from a GGUF: transformers' ids of the default model on
    the multilingual set, every id of the file's vocabulary, decoding that round-trips."""
    import gguf
    from transformers import AutoTokenizer

    source = GGUFFile(gguf_file("default"))
    meta = source.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(tmp_path / "shape.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))])
    writer.add_token_types(meta["tokenizer.ggml.token_type"].tolist() + [1] * (vocab - len(tokens)))
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    source.close()
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    file = GGUFFile(tmp_path / "shape.gguf")
    try:
        ours = gguf_tokenizer(file)
    finally:
        file.close()
    ref = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    assert len(ours) == vocab and ours.convert_ids_to_tokens(vocab - 1) == (
        "<|reserved_79103|>" if vocab > len(tokens) else tokens[-1])
    assert ours(MULTILINGUAL)["input_ids"] == ref(MULTILINGUAL)["input_ids"]
    for text in MULTILINGUAL:
        assert ours.decode(ours(text)["input_ids"]) == text, text


# ---- arbor serve on a family's GGUF ------------------------------------------------------
MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]
STOP_AT = 3  # the greedy token generated at this step is written as the file's end-of-turn id
SLOW_SERVE = {"llama3", "mistral", "phi3", "gemma2"}  # ~9 s each; qwen3 and gemma3 stay fast
MOE = {"qwen3_moe", "mixtral"}  # test_moe_families.py's tiny models and files


@pytest.fixture(scope="module")
def default_gguf() -> Iterator[GGUFFile]:
    file = GGUFFile(gguf_file("default"))
    yield file
    file.close()


# Small faithful versions of the templates each family's own files carry. Their markers
# are not single tokens of the test vocabulary (SmolLM2's) except ChatML's: they are
# plain text there, rendered and counted the same way by the file's tokenizer and the server.
QWEN3_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                  "{% if enable_thinking is defined and enable_thinking is false %}"
                  "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
LLAMA3_TEMPLATE = ("{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + "
                   "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' %}"
                   "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
                   "{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
                    "{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
# Qwen 2.5's ChatML: its own system prompt when the messages carry none
QWEN25_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + "
                   "'<|im_end|>\\n' }}{% else %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
                   "You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{% for m in messages %}"
                   "{% if not (m['role'] == 'system' and loop.first) %}{{ '<|im_start|>' + m['role'] + '\\n' + "
                   "m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Mixtral-Instruct's: user and assistant turns alternating, checked. NOTE: not yet in FAMILY_CHAT: served
# from its F32 GGUF, the tiny Mixtral's answer did not reach the stop token (finish "length"; open)
MIXTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                    "{% endif %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% else %}"
                    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
PHI3_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ '<|system|>\\n' + m['content'] + "
                 "'<|end|>\\n' }}{% elif m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + '<|end|>\\n' }}"
                 "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\\n' + m['content'] + '<|end|>\\n' }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
                 "{% else %}{{ eos_token }}{% endif %}")
# family -> (its template, how the rendered prompt ends, chat_template_kwargs of the call)
FAMILY_CHAT: dict[str, tuple[str, str, dict[str, Any]]] = {
    # thinking off, as Qwen 3's template writes it (an empty span): else the server opens one
    "qwen3": (QWEN3_TEMPLATE, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False}),
    "qwen2": (QWEN25_TEMPLATE, "assistant.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
                               "<|im_start|>assistant\n", {}),
    "qwen3_moe": (QWEN3_TEMPLATE, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False}),
    "llama3": (LLAMA3_TEMPLATE, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", {}),
    "mistral": (MISTRAL_TEMPLATE, "[INST] Name a colour. [/INST]", {}),
    "phi3": (PHI3_TEMPLATE, "<|end|>\n<|assistant|>\n", {}),
    "gemma2": (GEMMA_TEMPLATE, "<start_of_turn>model\n", {}),
    "gemma3": (GEMMA_TEMPLATE, "<start_of_turn>model\n", {}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_SERVE else [])
                                  for n in FAMILY_CHAT])
def test_arbor_serve_uses_the_files_template_and_stop_token(name: str, tmp_path: Path,
                                                            default_gguf: GGUFFile) -> None:
    """Each family's GGUF carrying its own chat template (Qwen 3's ChatML with thinking
    off, Llama 3's headers, Mistral's ``[INST]``, Phi-3's ``<|user|>``, Gemma's turns)
    served by a real ``arbor serve``: the chat call's prompt is exactly the file's
    template rendered by the file's tokenizer (its token count, and a greedy answer equal to
    transformers' continuation of that rendering), and generation ends with "stop" on
    the file's ``tokenizer.ggml.eot_token_id``, which is not the EOS id."""
    import openai

    template, ending, kwargs = FAMILY_CHAT[name]
    hf_dir = save_tiny_moe(name, tmp_path / "hf") if name in MOE else _save(name, tmp_path / "hf")
    probe = GGUFFile(_write_gguf(name, hf_dir, tmp_path / "probe.gguf", default_gguf, chat_template=template))
    try:
        tokenizer = gguf_tokenizer(probe)
    finally:
        probe.close()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert rendered.endswith(ending), rendered
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    want, _ = hf_greedy(hf_dir, ids, 8)
    stop = want[STOP_AT]
    assert stop != 2, "the stop token must differ from EOS (the test would not show the file's own)"
    end = min(i for i, t in enumerate(want) if t in (stop, 2))
    path = _write_gguf(name, hf_dir, tmp_path / f"{name}.gguf", default_gguf, chat_template=template,
                       metadata={"tokenizer.ggml.eot_token_id": stop})
    proc, url = start_server(path, "--num-pages", "256", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0,
                                             extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens in (end, end + 1)  # the stop token counted or not
    assert got.choices[0].message.content == tokenizer.decode(want[:end], skip_special_tokens=True)


def _write_gguf(name: str, hf_dir: Path, path: Path, default_gguf: GGUFFile, **options: Any) -> Path:
    """The family's GGUF (F32) as llama.cpp's converter writes it, with ``options``
    (``chat_template``, ``metadata``)."""
    if name in MOE:
        return write_moe_gguf(hf_dir, path, **options)
    arch, permute = GGUF_ARCH[name]
    return write_family_gguf(hf_dir, path, arch, default_gguf, permute_qk=permute, **options)
