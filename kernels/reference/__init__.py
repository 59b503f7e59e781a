"""Pure-torch reference ops: the specification of every kernel, and the CPU path wherever
``kernels.cpu`` has no native kernel (or none could be built)."""

from kernels.reference.attention import (
    decode_attention,
    extend_attention,
    merge_shared_prefixes,
    plan_decode,
    plan_extend,
    store_kv,
)
from kernels.reference.norm import rms_norm

__all__ = [
    "decode_attention", "extend_attention", "merge_shared_prefixes", "plan_decode", "plan_extend",
    "rms_norm", "store_kv",
]
