"""The tokenizer a GGUF file describes, built from its metadata.

The kinds ``gguf_vocab.py`` builds (byte-level BPE, Llama-style sentencepiece) come as a
``FastTokenizer`` and never import transformers, whose import alone is most of a warm
load. The rest go through transformers' converters (``transformers.integrations.gguf``:
Gemma's sentencepiece, unigram...), which normally read the file with their own parser;
we hand them the metadata ``GGUFFile`` already read, so the file is parsed once. Both
give the same tokenizer for the kinds both build (tests compare them).
"""

from __future__ import annotations

from typing import Any

from runtime.errors import ModelLoadError
from runtime.model.fast_tokenizer import FastTokenizer
from runtime.model.gguf_file import GGUFFile
from runtime.model.gguf_vocab import build_backend, settings

# tokenizer.* metadata key -> the converters' tokenizer_dict name (transformers'
# GGUF_TOKENIZER_MAPPING["tokenizer"], which we import when it is there)
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """A tokenizer with the file's vocabulary, merges, special tokens, ``add_bos_token``
    and ``chat_template``: a ``FastTokenizer`` where ``gguf_vocab`` builds the kind, else
    transformers' ``PreTrainedTokenizerFast``.

    Raises:
        ModelLoadError: the file has no tokenizer, or one that cannot be built.
    """
    check_tokenizer(gguf)
    try:
        backend = build_backend(gguf.metadata, gguf.architecture)
    except Exception as exc:  # tokenizers raises for a bad vocabulary (a merge of unknown pieces...)
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer from the metadata: {exc}") from exc
    if backend is not None:
        return FastTokenizer(backend, settings(gguf.metadata))
    return transformers_tokenizer(gguf)


def transformers_tokenizer(gguf: GGUFFile) -> Any:
    """The file's tokenizer as transformers' converters build it (every kind they know).

    Raises:
        ModelLoadError: the file has no tokenizer, or one transformers cannot build.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    check_tokenizer(gguf)
    meta = gguf.metadata
    groups = {group: {name: _plain(meta[f"tokenizer.{key}"]) for key, name in renames.items()
                      if f"tokenizer.{key}" in meta}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece files
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            tokenizer_config[name] = tokens[int(token_id)]
    try:
        backend, extra = convert_gguf_tokenizer(gguf.architecture, tokenizer_dict)
        if tokenizer_dict.get("tokenizer_type") == "llama" and tokenizer_dict.get("add_prefix_space", True):
            _sentencepiece_space_prefix(backend)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
    except Exception as exc:  # transformers raises ValueError, KeyError... for what it cannot build
        raise ModelLoadError(f"{gguf.path}: cannot build the tokenizer from the metadata: {exc}") from exc


def check_tokenizer(gguf: GGUFFile) -> None:
    """Raise ``ModelLoadError`` when the file's metadata has no tokenizer (checked before
    anything is loaded; building it takes longer)."""
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        raise ModelLoadError(f"{gguf.path}: no tokenizer in the metadata (tokenizer.ggml.tokens missing)")


def _plain(value: Any) -> Any:
    """Numeric arrays (scores, token types) as lists, as the converters expect."""
    return value.tolist() if hasattr(value, "tolist") else value


def _sentencepiece_space_prefix(backend: Any) -> None:
    """Prefix every text with a space as sentencepiece's ``add_dummy_prefix`` and
    llama.cpp's ``add_space_prefix`` do, also one that starts with a space.

    The converter's ``Metaspace`` pre-tokenizer skips the prefix when the text already
    starts with one (" x" -> "▁x", where sentencepiece gives "▁▁x"); the normalizer of
    Llama 2's own tokenizer.json (prepend, then spaces to "▁") does not. Its decoder
    already strips the one leading space."""
    from tokenizers import normalizers

    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None

