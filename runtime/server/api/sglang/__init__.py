"""``POST /generate`` (Arbor's native fields and SGLang's, a superset) and SGLang's
info endpoints, for Arbor's own client and the unmodified ``sglang`` frontend."""
