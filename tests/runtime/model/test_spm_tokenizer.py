"""Sentencepiece vocabularies in a GGUF file (``tokenizer.ggml.model = "llama"``: pieces,
scores and token types, as Llama 2, Mistral v1 and Gemma ship): Arbor's GGUF tokenizer
gives the ids of transformers' tokenizer built from the very same ``tokenizer.model``.

A small sentencepiece model is trained here (``sentencepiece``), and written into a GGUF
file the way llama.cpp's converter does (``_set_vocab_sentencepiece``: piece, score and
type per id, the special ids, ``add_space_prefix`` from the model's normalizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_family_files import MULTILINGUAL

from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_tokenizer import gguf_tokenizer

# llama.cpp's SentencePieceTokenTypes
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6
CORPUS = MULTILINGUAL[:10] + [
    "Sentencepiece splits text into pieces; unseen characters fall back to bytes.",
    "Die Katze schläft auf dem warmen Stein, während die Fischer zurückkehren.",
    "北京的冬天很冷，但是上海的冬天比较暖和。東京は雨でした。",
    "for i in range(10):\n    total += values[i] * 2\nprint(f\"{total=}\")\n",
]
# (HF tokenizer class, GGUF architecture, the model's dummy prefix, sentencepiece model type)
KINDS = {
    "llama2-bpe": ("LlamaTokenizer", "llama", True, "bpe"),
    "mistral-unigram": ("LlamaTokenizer", "llama", True, "unigram"),
    "gemma-bpe": ("GemmaTokenizer", "gemma2", False, "bpe"),
}


def _train(out: Path, model_type: str, dummy_prefix: bool) -> Path:
    import sentencepiece as spm

    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=520, model_type=model_type,
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", add_dummy_prefix=dummy_prefix, minloglevel=2)
    return out / "tokenizer.model"


def _write_gguf(model: Path, out: Path, arch: str) -> Path:
    """llama.cpp's ``_set_vocab_sentencepiece`` (convert_hf_to_gguf.py), metadata only."""
    import gguf
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = NORMAL
        if sp.IsUnknown(i):
            kind = UNKNOWN
        elif sp.IsControl(i):
            kind = CONTROL
        elif sp.IsUnused(i):
            kind = UNUSED
        elif sp.IsByte(i):
            kind = BYTE
        tokens.append(sp.IdToPiece(i).encode())
        scores.append(sp.GetScore(i))
        types.append(kind)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=list(KINDS))
def tokenizers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """(Arbor's tokenizer from the GGUF file, transformers' from the same tokenizer.model,
    sentencepiece's own processor)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    cls, arch, dummy_prefix, model_type = KINDS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = _train(tmp, model_type, dummy_prefix)
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": cls, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "additional_special_tokens": []}))
    path = _write_gguf(model, tmp / "tokenizer.gguf", arch)
    file = GGUFFile(path)
    try:
        ours = gguf_tokenizer(file)
    finally:
        file.close()
    return ours, AutoTokenizer.from_pretrained(str(tmp)), spm.SentencePieceProcessor(model_file=str(model))


UNSEEN = ["안녕하세요 세계", "Ελληνικά γράμματα", "ŉ ǅ ﬁ"]  # never in the corpus: bytes
TEXTS = [*MULTILINGUAL, *UNSEEN, "9876543210", "  leading", "trailing  ", "\tx", " <s> b"]


@pytest.mark.parametrize("tokenizers", ["llama2-bpe", "gemma-bpe"], indirect=True)
def test_sentencepiece_gguf_ids_equal_sentencepiece(tokenizers: tuple[Any, Any, Any]) -> None:
    """A BPE sentencepiece model (Llama 2, Mistral v1, Gemma): BOS, then sentencepiece's
    own ids, leading spaces included (what llama.cpp's tokenizer gives too)."""
    ours, _, sp = tokenizers
    for text in TEXTS:
        if "<" not in text:  # control tokens written as text are whole tokens for us (and llama.cpp)
            assert ours(text)["input_ids"] == [sp.bos_id(), *sp.encode(text)], text
    assert sum(sp.IsByte(i) for i in sp.encode(UNSEEN[0])) >= 3 * 7, "the unseen text falls back to bytes"


def test_sentencepiece_gguf_ids_equal_transformers(tokenizers: tuple[Any, Any, Any]) -> None:
    """transformers' tokenizer of the same tokenizer.model, on every text that does not
    start with whitespace: there transformers' ``Metaspace`` omits the space prefix that
    sentencepiece (and so we) add, " x" -> "▁x" against "▁▁x"."""
    ours, ref, _ = tokenizers
    texts = [t for t in TEXTS if t[:1] not in (" ", "\t", "\n", "\r")]
    for text in texts:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert ours(texts)["input_ids"] == ref(texts)["input_ids"]


def test_sentencepiece_gguf_decoding_round_trips(tokenizers: tuple[Any, Any, Any]) -> None:
    ours, ref, _ = tokenizers
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        if "<s>" not in text:  # NOTE: the text after a control token gets a space prefix of its own
            assert ours.decode(ids, skip_special_tokens=True) == text, text
        assert ours.decode(ids) == ref.decode(ids), text
