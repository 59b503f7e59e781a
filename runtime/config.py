"""Engine settings: one frozen dataclass, validated at construction.

Field names follow the field (SGLang / vLLM) and map 1:1 to ``arbor`` CLI flags
(``max_model_len`` ↔ ``--max-model-len``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from grammars.schema_check import MAX_SCHEMA_DEPTH
from runtime.errors import InvalidRequestError

WeightFormat = Literal["fp32", "int8", "int4", "gguf", "auto"]
WEIGHT_FORMATS = ("fp32", "int8", "int4", "gguf", "auto")

SchedulePolicy = Literal["lpm", "fcfs"]
KVCacheDtype = Literal["auto", "int8", "fp8"]
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
DEFAULT_MEM_FRACTION = 0.15  # of free memory, for the KV pool when neither size is given


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting. Construct once; never mutated afterwards."""

    model: str = "default"  # "default", an HF directory, or a .gguf file
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1"...
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "float16", "bfloat16"
    max_model_len: int | None = None  # tokens per request (prompt + output); None: model's
    page_size: int = 1  # tokens per KV page
    num_pages: int | None = None  # KV pool size; None: derived from mem_fraction
    # Share of free memory given to the KV pool; None: DEFAULT_MEM_FRACTION. Only without
    # num_pages: giving both is refused (one would be ignored).
    mem_fraction: float | None = None
    max_running_requests: int = 256  # cap on requests in the running batch
    max_prefill_tokens: int = 2048  # prefill token budget of a step in which nothing decodes
    # Prefill tokens per step while other requests decode (stall-free batching): long
    # prompts advance in chunks this small so running streams keep their pace. None: 16 on
    # the CPU, where a step's cost grows with every row (measured, 16 streams decoding
    # while a 2,000-token prompt arrives: their p99 inter-token latency 1.4-1.7x their ITL
    # alone with 16-token chunks, 2.3-3.6x with 32), and 512 on CUDA, where it stays flat
    # for a few hundred rows.
    chunked_prefill_size: int | None = None
    decode_reserve_tokens: int = 16  # KV tokens reserved per running request at admission
    disable_prefix_cache: bool = False  # True: the do-nothing cache (baseline)
    schedule_policy: SchedulePolicy = "lpm"  # "lpm" longest-prefix-match, or "fcfs"
    # LPM aging: once this many later arrivals were admitted ahead of a waiting request, it
    # goes first (scheduler/policy.py); None: no bound (a cache-cold request can starve).
    lpm_max_overtakes: int | None = 16
    # Priority classes and a fair share between tenants on top of schedule_policy
    # (scheduler/policy.py FairPolicy): interactive requests go first and may take a batch
    # request's running slot; tenants take turns. With one tenant and one class it orders
    # exactly as schedule_policy alone. False: schedule_policy alone (the baseline).
    fair_scheduling: bool = True
    # The KV cache's stored dtype: "auto" (the model's), "int8" or "fp8" (e4m3), each row
    # of head_dim values as 8-bit codes plus one fp32 scale per (token, head), so the same
    # memory holds ~3.8x the tokens (fp32 model, head_dim 64). fp8 needs a CUDA device with
    # fp8 (compute capability >= 8.9); on the CPU it is stored as fp8 and computed in fp32
    # (no CPU has fp8 arithmetic; the memory saving is the same as int8's).
    kv_cache_dtype: KVCacheDtype = "auto"
    speculation: bool = True  # draft sources for constrained spans (when available)
    # A forward pass's fixed cost in token rows: F in the break-even acceptance rate
    # B / (F + B) that prompt-lookup drafts must beat with B requests decoding. None: 16 on
    # the CPU (a batch-1 decode step there costs ~16 extra rows: 46 ms vs 2.6 ms a row),
    # 256 on CUDA (a pass's cost is flat until a few hundred rows).
    spec_fixed_cost_rows: float | None = None
    grammar_backend: str = "auto"  # constrained decoding engine ("auto" = best per kind)
    grammar_timeout_s: float = 30.0  # bound on one grammar compilation (then ConstraintError)
    # Bound on a constraint's source (schema JSON, regex, Lark). Real schemas reach ~0.9 MB
    # (JSONSchemaBench's Kubernetes ones), so 2 MiB; the compile timeout bounds the rest.
    grammar_max_bytes: int = field(default=2 * 1024 * 1024, metadata={
        "help": "bound on a constraint's source in bytes (schema JSON, regex, Lark); larger: 400"})
    # Bound on a JSON schema's nesting, in levels of objects and arrays (a property is two:
    # "properties" and its schema); a deeper schema is refused (400) before any compile
    # work. At most grammars.MAX_SCHEMA_DEPTH (64), what the schema validator can check.
    schema_max_depth: int = field(default=64, metadata={
        "help": "bound on a JSON schema's nesting of objects and arrays (at most 64); deeper: 400"})
    seed: int = 0  # seed of the engine's generator for requests without their own seed
    # CPU fp32: reorder every linear weight once for oneDNN (2-3x faster decode matmuls;
    # False: plain F.linear, the baseline). Ignored on CUDA and without oneDNN.
    prepack_weights: bool = True
    # How the model's weights are held (runtime/model/quant.py): "fp32" (the checkpoint's
    # weights in ``dtype``), "int8" (per channel), "int4" (groups of 32), "gguf" (a GGUF
    # model's own Q4_0/Q4_1/Q8_0 blocks, not dequantized), or "auto" (see
    # ``engine_setup.resolve_weights``). Quantized weights compute in fp32.
    weights: WeightFormat = "auto"
    # CPU, block-quantized weights: a step that only decodes runs as one native call, the
    # whole forward pass in one OpenMP region (kernels/cpu/decode_step.c), instead of
    # ~12 kernel calls a layer. False: the layer-by-layer path (the baseline and reference).
    # Ignored where it does not apply (fp32 weights, CUDA, no C compiler).
    fused_decode: bool = True
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    # Once loaded, move every live Python object into the GC's permanent generation: a full
    # collection otherwise scans them all (~180 ms with transformers imported, measured),
    # a stall of a whole step at random. Process-wide, like vLLM's engine core does.
    freeze_gc: bool = True
    debug: bool = False  # run integrity checks whenever the engine goes idle
    # Tensor parallelism (runtime/tensor_parallel.py): ranks (one process each) that split
    # every layer; torch.distributed over gloo on the CPU, NCCL on CUDA.
    tensor_parallel_size: int = 1
    nnodes: int = 1  # machines the ranks span (tensor_parallel_size / nnodes ranks each)
    node_rank: int = 0  # this machine's index; 0 runs the engine, the others only ranks
    dist_init_addr: str | None = None  # "host:port" of node 0's rendezvous; None: a free local port
    dist_timeout_s: float = 60.0  # a collective waiting longer than this fails (a dead rank)

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "page_size", "num_pages", "max_running_requests",
                     "max_prefill_tokens", "chunked_prefill_size", "num_threads", "tensor_parallel_size",
                     "nnodes", "grammar_max_bytes", "lpm_max_overtakes"):
            positive(name)
        self._check_distributed()
        if self.decode_reserve_tokens < 0:
            raise InvalidRequestError("decode_reserve_tokens must be >= 0")
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction <= 0.95:
            raise InvalidRequestError(f"mem_fraction must be in (0, 0.95], got {self.mem_fraction}")
        if self.mem_fraction is not None and self.num_pages is not None:
            raise InvalidRequestError("give num_pages or mem_fraction, not both (num_pages fixes the "
                                      "KV pool size, mem_fraction derives it from free memory)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise InvalidRequestError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise InvalidRequestError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if not 1 <= self.schema_max_depth <= MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"schema_max_depth must be in [1, {MAX_SCHEMA_DEPTH}], got {self.schema_max_depth!r}")
        if not self.grammar_timeout_s > 0:
            raise InvalidRequestError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s!r}")
        if self.spec_fixed_cost_rows is not None and not self.spec_fixed_cost_rows > 0:
            raise InvalidRequestError(f"spec_fixed_cost_rows must be > 0, got {self.spec_fixed_cost_rows!r}")
        if self.num_pages is not None and self.num_pages < 2:
            raise InvalidRequestError("num_pages must be >= 2 (page 0 is the padding page)")

    def _check_distributed(self) -> None:
        if self.tensor_parallel_size > 1 and self.weights not in ("fp32", "auto"):
            raise InvalidRequestError(f"tensor parallelism shards fp32 weights only: weights={self.weights!r} "
                                      "with tensor_parallel_size > 1 is not supported")
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidRequestError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple "
                                      f"of nnodes ({self.nnodes}): each node runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise InvalidRequestError("more than one node needs dist_init_addr (host:port of node 0)")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise InvalidRequestError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if not self.dist_timeout_s > 0:
            raise InvalidRequestError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the settings left to the device (None) filled in: the values
        measured for the CPU, or for CUDA (see each field's comment)."""
        on_cuda = device_type == "cuda"
        return replace(
            self,
            chunked_prefill_size=self.chunked_prefill_size or (512 if on_cuda else 16),
            spec_fixed_cost_rows=self.spec_fixed_cost_rows or (256.0 if on_cuda else 16.0),
        )

    def version(self) -> str:
        """A short hash of every setting (12 hex digits): two engines with the same version
        run the same configuration, so a canary and its baseline can be told apart."""
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
