"""A tokenizer over a ``tokenizers`` backend that answers as transformers'
``PreTrainedTokenizerFast`` does, for what the engine, the server and the DSL ask of it,
without importing transformers (a GGUF's tokenizer, ``gguf_vocab.py``).

Encoding, decoding, the special tokens, the vocabulary and chat templates are answered
here. Anything else (and the rare arguments this class does not take) goes to the very
transformers tokenizer built over the same backend, made on first use; libraries that
need a transformers object (llguidance, xgrammar) get that one from ``as_transformers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

from runtime.model.chat_template import NotPlain, render_chat
from runtime.model.gguf_vocab import VocabSettings

# the named special tokens, in transformers' order (its ``special_tokens_map``)
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template arguments only transformers handles (tokenizing, padding, masks...)
_TRANSFORMERS_CHAT_ARGS = frozenset({"continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                                     "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                     "tokenizer_kwargs", "chat_template"})


class FastTokenizer:
    """The engine's tokenizer for a GGUF file: token ids, decoding and chat rendering equal
    to transformers' tokenizer of the same backend and settings."""

    def __init__(self, backend: Tokenizer, config: VocabSettings) -> None:
        self._backend = backend
        self._config = config
        self._transformers: Any = None
        self.chat_template = config.chat_template
        self.special_tokens_map = {name: config.special_tokens[name] for name in _NAMED
                                   if name in config.special_tokens}

    # ---- special tokens ------------------------------------------------------------------
    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def add_bos_token(self) -> bool:
        return self._config.add_bos_token and self.bos_token is not None

    @property
    def add_eos_token(self) -> bool:
        return self._config.add_eos_token and self.eos_token is not None

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._backend.token_to_id(t) for t in self.all_special_tokens) if i is not None]

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(sorted(self._backend.get_added_tokens_decoder().items()))

    # ---- vocabulary ----------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        token_id = self._backend.token_to_id(token)
        return self.unk_token_id if token_id is None else token_id

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return list(self.as_transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs))
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids", "attention_mask"}`` of a text or of each text of a list."""
        if kwargs or not isinstance(text, str | list):
            return self.as_transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        encodings = self._backend.encode_batch(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings], "attention_mask": [[1] * len(e.ids) for e in encodings]}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if clean_up_tokenization_spaces or kwargs:  # NOTE: off by default for these tokenizers
            return str(self.as_transformers().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                                     clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                                     **kwargs))
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False,
                     **kwargs: Any) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs) for ids in sequences]

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> Any:
        """The chat rendered with the file's template, as transformers renders it.

        Raises:
            ValueError: no chat template, or no messages.
            jinja2.TemplateError / TypeError: the template cannot render them.
        """
        if tokenize or _TRANSFORMERS_CHAT_ARGS & kwargs.keys() or not isinstance(self.chat_template, str):
            return self._transformers_chat(conversation, tools, documents, add_generation_prompt, tokenize, kwargs)
        if isinstance(conversation, list | tuple) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        try:
            return render_chat(self.chat_template, conversation, add_generation_prompt, tools, documents,
                               {**self.special_tokens_map, **kwargs})
        except NotPlain:
            return self._transformers_chat(conversation, tools, documents, add_generation_prompt, tokenize, kwargs)

    def _transformers_chat(self, conversation: Any, tools: Any, documents: Any, add_generation_prompt: bool,
                           tokenize: bool, kwargs: dict[str, Any]) -> Any:
        return self.as_transformers().apply_chat_template(conversation, tools=tools, documents=documents,
                                                          add_generation_prompt=add_generation_prompt,
                                                          tokenize=tokenize, **kwargs)

    # ---- the transformers tokenizer, for everything else ---------------------------------
    def as_transformers(self) -> Any:
        """transformers' ``PreTrainedTokenizerFast`` over this backend and these settings
        (imports transformers: made once, on first use)."""
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            config: dict[str, Any] = {**self._config.special_tokens, "chat_template": self.chat_template}
            if self._config.add_bos_token:
                config["add_bos_token"] = True
            if self._config.add_eos_token:
                config["add_eos_token"] = True
            self._transformers = PreTrainedTokenizerFast(tokenizer_object=self._backend, **config)
        return self._transformers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_backend", "_config", "_transformers"):
            raise AttributeError(name)
        return getattr(self.as_transformers(), name)
