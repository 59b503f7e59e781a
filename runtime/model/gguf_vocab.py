"""The ``tokenizers`` backend a GGUF file's ``tokenizer.ggml.*`` metadata describes, built
without transformers (its import alone costs more than a warm load of the weights).

Two kinds are built here, each to be the very backend transformers' GGUF converter gives
(``transformers.integrations.gguf``; tests compare the two, JSON and token ids):

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen 2/2.5/3, Mistral Nemo...). Tokens are
  respelled in the byte alphabet where the file wrote them as text; the text is split by
  the regex the file's ``tokenizer.ggml.pre`` names (llama.cpp's ``llama-vocab.cpp`` maps
  each name to the expression of the model's own ``tokenizer.json``), else by GPT-2's.
- ``llama``: a sentencepiece vocabulary run as BPE with byte fallback (Llama 2, Mistral v1,
  Phi-3); merges from the file, else recovered from the pieces and their scores; every
  text gets sentencepiece's dummy-prefix space.

Anything else (Gemma's and T5's vocabularies, a sentencepiece file without the space
prefix) returns None: the caller builds it through transformers instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp's token types (gguf's ``TokenType``)
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer expressions as the models' own tokenizer.json files write them.
# Llama 3's: contractions, letters with one leading non-letter, 1-3 digits, punctuation runs.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2's: Llama 3's with single digits.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 3.5's: Qwen 2's with combining marks kept inside words.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken: cased words without contractions, single digits.
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k), also Llama 4's: cased words with contractions, 1-3 digits.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> its split. NOTE: exactly the names transformers' converter knows:
# a name missing here splits as GPT-2 (ByteLevel's own regex) in both, so the two agree.
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# architectures whose sentencepiece vocabulary transformers builds its own way (Gemma's
# respelled space tokens and merge order): built through transformers
_SENTENCEPIECE_ELSEWHERE = frozenset({"gemma", "gemma2", "gemma3"})
# the special tokens each converter class names by default: (bos, eos, unk)
_CLASS_SPECIALS = {"gpt2": ("<|endoftext|>",) * 3, "llama": ("<s>", "</s>", "<unk>")}
# tokenizer.* metadata key -> the name of the special token it gives
SPECIAL_ID_KEYS = {"bos_token": "ggml.bos_token_id", "eos_token": "ggml.eos_token_id",
                   "unk_token": "ggml.unknown_token_id", "pad_token": "ggml.padding_token_id"}


@dataclass(frozen=True)
class VocabSettings:
    """What the file says beside the vocabulary (the tokenizer_config of transformers)."""

    special_tokens: dict[str, str]  # "bos_token" / "eos_token" / "unk_token" / "pad_token" -> text
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def settings(meta: dict[str, Any]) -> VocabSettings:
    """The file's special tokens, BOS / EOS flags and chat template (llama.cpp adds BOS to
    a sentencepiece vocabulary whose file does not say otherwise)."""
    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for name, key in SPECIAL_ID_KEYS.items():
        token_id = meta.get(f"tokenizer.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = str(tokens[int(token_id)])
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = meta.get("tokenizer.ggml.model") == "llama"
    template = meta.get("tokenizer.chat_template")
    return VocabSettings(special, bool(add_bos), bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                         None if template is None else str(template))


def build_backend(meta: dict[str, Any], architecture: str) -> Tokenizer | None:
    """The backend for this file's tokenizer, or None where this module does not build its
    kind (then transformers' converter does; see the module docstring)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", ())]
    if kind == "gpt2":
        backend = _byte_level(tokens, list(meta.get("tokenizer.ggml.merges", ())), meta.get("tokenizer.ggml.pre"))
        if backend is None:
            return None
    elif (kind == "llama" and architecture not in _SENTENCEPIECE_ELSEWHERE
          and meta.get("tokenizer.ggml.add_space_prefix", True)):
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
        backend = _sentencepiece(tokens, scores, meta.get("tokenizer.ggml.merges"))
    else:
        return None
    _add_special_tokens(backend, tokens, types, kind, settings(meta))
    return backend


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for
    themselves, the rest take the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(extra)
            extra += 1
    return spelling


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer | None:
    spelling = byte_alphabet()
    alphabet = frozenset(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): i
             for i, token in enumerate(tokens)}
    split = [merge.split(" ") for merge in merges]
    if any(len(parts) != 2 for parts in split):
        return None  # a merge that is not two pieces: leave its reading to transformers
    pairs = [(parts[0], parts[1]) for parts in split]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    regex = PRE_TOKENIZER_SPLITS.get(str(pre))
    if regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], scores: list[float], merges: Sequence[str] | None) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    if merges is not None:
        pairs = [(parts[0], parts[1]) for parts in (str(m).split(" ") for m in merges)]
    else:
        pairs = recover_merges(vocab, dict(zip(tokens, scores, strict=False)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    # NOTE: a prefix space on every text, also one that starts with a space (sentencepiece's
    # add_dummy_prefix, llama.cpp's add_space_prefix): " x" -> "▁▁x", never "▁x".
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return backend


def recover_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a sentencepiece vocabulary implies: every split of a piece into two
    pieces of the vocabulary, best piece score first (ties: shorter left, then shorter
    right piece; within one piece, the pair of lower ids first)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, score) for left, right in splits)
    # NOTE: a stable sort, descending: equal keys keep the order above
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int], kind: str,
                        config: VocabSettings) -> None:
    """Added tokens in the order transformers adds them (a token missing from the
    vocabulary takes the next id): the converter class's own special tokens, the file's
    control tokens (special), its user-defined tokens (plain, whole), then the special
    tokens the file names. Then BOS / EOS around every encoded text, as the file says."""
    bos, eos, unk = _CLASS_SPECIALS[kind]
    _add_missing(backend, [AddedToken(t, special=True) for t in dict.fromkeys((bos, eos, unk))])
    alphabet = frozenset(byte_alphabet().values()) if kind == "gpt2" else None
    # NOTE: in a byte-level vocabulary a "control" token spelled outside the byte alphabet
    # is a converter's mislabel; adding it would grow the vocabulary past the model's.
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
    _add_missing(backend, [AddedToken(t, special=True) for t in config.special_tokens.values()])
    backend.post_processor = post_processor(backend, config)


def _add_missing(backend: Tokenizer, candidates: list[AddedToken]) -> None:
    added = {str(t) for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in candidates if t.content not in added]
    if missing:
        backend.add_tokens(missing)


def post_processor(backend: Tokenizer, config: VocabSettings) -> processors.TemplateProcessing:
    """BOS before / EOS after every text (and each of a pair), where the file asks for them."""
    bos, eos = config.special_tokens.get("bos_token"), config.special_tokens.get("eos_token")
    add_bos, add_eos = config.add_bos_token and bos is not None, config.add_eos_token and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(token, backend.token_to_id(token)) for token, wanted in ((bos, add_bos), (eos, add_eos))
               if wanted and token is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
