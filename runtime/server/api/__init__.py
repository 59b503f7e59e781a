"""Every wire API the server speaks, one folder per API family, each a module pair
(``schema.py``: the pydantic wire shapes; ``routes.py``: ``build_router(ctx)``, whose routes
translate a wire request into engine requests and the outputs back):

    sglang/       ``POST /generate`` (Arbor's native fields and SGLang's, a superset),
                  ``/get_model_info``, ``/server_info``, ``/flush_cache``
    native/       ``/tokenize``, ``/detokenize``, ``/apply_chat_template``,
                  ``/tokenizer_info``, ``DELETE /sessions/{id}``, ``/engine_metrics``
    openai/       ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
    responses/    OpenAI's Responses API (``/v1/responses``)
    anthropic/    Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)
    embeddings/   ``/v1/embeddings``
    programs/     the hosted programs (``/programs``)

A family imports no other family: what several share is neutral, in ``common/`` (field
checking, other servers' constraint fields, the shared wire shapes, the chat turns and
their prompt) or in ``runtime/server/`` itself (``serving``, ``formats/``,
``engine_constraints``, ``errors``, ``sse``...). The app mounts every family from one list
(``app.API_FAMILIES``); tests/test_architecture.py keeps both rules.
"""
