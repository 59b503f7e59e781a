"""Arbor's tokenizer endpoints, retention sessions and engine metrics."""
