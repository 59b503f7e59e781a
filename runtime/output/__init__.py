"""From logits to the caller: the output processor (drafts, sampling and verification,
stop checks, detokenization, emitted outputs) and the incremental detokenizer."""
