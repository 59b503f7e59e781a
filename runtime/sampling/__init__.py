"""Sampling: from a batch of logits rows to token ids (temperature, top-k/p, min-p, seeds)."""
