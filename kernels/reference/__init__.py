"""Pure-torch reference ops: the specification of every kernel, and the CPU path wherever
``kernels.cpu`` has no native kernel (or none could be built)."""

from kernels.reference.activation import silu_and_mul
from kernels.reference.attention import (
    decode_attention,
    extend_attention,
    merge_shared_prefixes,
    plan_decode,
    plan_extend,
    store_kv,
)
from kernels.reference.moe import (
    ExpertGroups,
    ExpertWeights,
    group_by_expert,
    moe_experts,
    route_topk,
)
from kernels.reference.norm import add_rms_norm, rms_norm
from kernels.reference.quant import QuantizedWeight, bf16_linear, quantized_linear
from kernels.reference.rotary import apply_rotary

__all__ = [
    "add_rms_norm", "apply_rotary", "bf16_linear", "decode_attention", "ExpertGroups", "ExpertWeights",
    "extend_attention", "group_by_expert", "merge_shared_prefixes", "moe_experts", "plan_decode", "plan_extend",
    "route_topk", "QuantizedWeight", "quantized_linear", "rms_norm", "silu_and_mul", "store_kv",
]
