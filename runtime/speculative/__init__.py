"""Speculative decoding: cheap drafts verified by the target model in one forward pass.

Draft sources (``drafts.py``): tokens the grammar forces, and n-grams copied from the
request's own prompt and output (prompt lookup). Verification (``verify.py``) accepts a
draft token only when the target model would have produced it: exact match for greedy,
the distribution-preserving rule for sampling, with the grammar mask applied at every
position. Whether drafts are worth verifying at all (``gate.py``) is decided per request
and draft source, from their acceptance and the measured cost of verify rows. A
speculative path changes speed, never the output.
"""

from runtime.speculative.drafts import DraftProposer, Proposal, SpecStats
from runtime.speculative.gate import Candidate, RequestSpeculation, Shadow, SpeculationGate
from runtime.speculative.verify import verify_drafts

__all__ = ["Candidate", "DraftProposer", "Proposal", "RequestSpeculation", "Shadow", "SpecStats",
           "SpeculationGate", "verify_drafts"]
