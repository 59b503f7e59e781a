"""Attention and friends for Arbor's model runner.

Each op has a pure-torch reference in ``kernels/reference`` (the specification, and the
CPU path by default) and, where it pays, a Triton kernel in ``kernels/triton`` (the GPU
path) and a C kernel in ``kernels/cpu`` (the CPU path once ``enable_cpu_kernels`` built it). The runtime
calls these ops only through ``kernels.dispatch``. This package imports nothing from the
rest of the project.

KV pool layout (shared by every op)::

    k_buffer, v_buffer : [num_slots, num_kv_heads, head_dim]   one pair per layer
    slot = page_idx * page_size + offset_in_page
    page_table         : [batch, max_pages] int32, row b lists request b's pages in order;
                         entries past the request's last page are ignored (any value)
    k_scale, v_scale   : [num_slots, num_kv_heads] fp32, only beside an int8 / fp8 pool:
                         one scale per (token, head) row (``kernels.reference.kv_quant``)
"""

from kernels.cpu.decode_step import (
    DecodeExperts,
    DecodeLayerWeights,
    DecodeModelWeights,
    DecodePool,
    UnsupportedDecodeModel,
)
from kernels.dispatch import (
    AttentionPlan,
    SharedPrefix,
    add_rms_norm,
    apply_rotary,
    bind_decode_step,
    decode_attention,
    enable_cpu_kernels,
    extend_attention,
    get_kernel_backend,
    group_by_expert,
    moe_experts,
    plan_decode,
    plan_extend,
    prepare_quantized,
    quant_kernel_max_rows,
    quantized_linear,
    reads_tiles,
    rms_norm,
    route_topk,
    set_kernel_backend,
    silu_and_mul,
    store_kv,
    tile8_blocks,
    tile_q4_blocks,
    tile_q5_blocks,
    tile_q6_k_blocks,
)
from kernels.reference.kv_quant import KV_QUANT_QMAX, dequantize_kv, is_quantized_kv, quantize_kv
from kernels.reference.moe import ExpertGroups, ExpertWeights
from kernels.reference.quant import QuantizedWeight

__all__ = [
    "KV_QUANT_QMAX",
    "AttentionPlan",
    "DecodeExperts",
    "DecodeLayerWeights",
    "DecodeModelWeights",
    "DecodePool",
    "ExpertGroups",
    "ExpertWeights",
    "SharedPrefix",
    "UnsupportedDecodeModel",
    "add_rms_norm",
    "apply_rotary",
    "bind_decode_step",
    "decode_attention",
    "dequantize_kv",
    "enable_cpu_kernels",
    "extend_attention",
    "get_kernel_backend",
    "group_by_expert",
    "moe_experts",
    "is_quantized_kv",
    "plan_decode",
    "plan_extend",
    "prepare_quantized",
    "reads_tiles",
    "tile8_blocks",
    "tile_q4_blocks",
    "tile_q6_k_blocks",
    "tile_q5_blocks",
    "quantize_kv",
    "QuantizedWeight",
    "quant_kernel_max_rows",
    "quantized_linear",
    "rms_norm",
    "route_topk",
    "set_kernel_backend",
    "silu_and_mul",
    "store_kv",
]
