"""The wire APIs added beside the native and OpenAI chat/completions ones, one module pair
per API (``<api>_schema.py``: pydantic wire shapes; ``<api>_routes.py``: the routes, which
translate a wire request into engine requests and the outputs back):

    sglang_*      SGLang's native protocol (``/generate`` superset, ``/get_model_info``,
                  ``/server_info``, ``/flush_cache``) for the unmodified ``sglang`` frontend
    responses_*   OpenAI's Responses API (``/v1/responses``)
    anthropic_*   Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)

Shared by every API: ``fields.py`` (unknown fields are an error, explicit null is the
default) and ``constraint_fields.py`` (other servers' constraint fields → one constraint).
"""
