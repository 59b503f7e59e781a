"""OpenAI's embeddings API: ``/v1/embeddings``."""
