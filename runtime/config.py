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
CPU_PREFIX_CACHE_BYTES = 256 * 2**20  # KV the prefix cache keeps on the CPU by default (docs/memory.md)
# The ITL target, in decode-only steps of one stream, when the user sets none
# (scheduler/budget.py; chosen by a sweep, docs/serving-slo.md).
DEFAULT_ITL_SLO_STEPS = 32.0


def setting(default: Any, help: str) -> Any:
    """A config field with its help text: the CLI flag's ``--help`` and the generated
    reference (docs/cli.md) read it from the field's metadata."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting. Construct once; never mutated afterwards."""

    model: str = setting("default", "the model: 'default' (the embedded SmolLM2-135M-Instruct), an HF "
                         "directory (config.json, *.safetensors, tokenizer.json) or a .gguf file")
    device: str = setting("auto", "'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = setting("auto", "compute dtype: 'auto' (float32 on the CPU, bfloat16 on CUDA), "
                         "'float32', 'float16' or 'bfloat16'")
    max_model_len: int | None = setting(None, "tokens per request, prompt and output together "
                                        "(default: the model's context length)")
    page_size: int = setting(1, "tokens per KV-cache page")
    num_pages: int | None = setting(
        None, f"KV pool size in pages (default: --mem-fraction of free memory when given, else enough "
        f"for --max-running-requests x --max-model-len tokens, at most {DEFAULT_MEM_FRACTION} of free "
        f"memory)")
    mem_fraction: float | None = setting(
        None, "share of free memory given to the KV pool when --num-pages is not given; giving both "
        "is refused, as one would be ignored")
    max_running_requests: int = setting(256, "cap on the requests in the running batch")
    max_prefill_tokens: int = setting(2048, "prefill token budget of a step in which nothing decodes")
    # NOTE: on the CPU a step's cost grows with every row, so small chunks keep running
    # streams' inter-token latency near their pace alone; on CUDA it stays flat for a few
    # hundred rows (docs/benchmarks.md, chunked prefill).
    chunked_prefill_size: int | None = setting(
        None, "prefill tokens per step while other requests decode, so long prompts advance in "
        "chunks and running streams keep their pace (default: 16 on the CPU, 512 on CUDA)")
    decode_reserve_tokens: int = setting(16, "KV tokens reserved per running request at admission")
    # NOTE: a request's own targets (SamplingParams) win over these; None for both is the
    # fixed chunk, the baseline (scheduler/budget.py, docs/serving-slo.md).
    ttft_slo: float | None = setting(
        None, "time-to-first-token target in seconds: a prompt about to miss it gets a bigger "
        "prefill share (with --itl-slo, steps are sized from measured step costs)")
    itl_slo: float | None = setting(
        None, "inter-token latency target in seconds: each step's prefill chunk is the largest whose "
        "predicted step time keeps running streams within it (down to --chunked-prefill-size)")
    # NOTE: a target in seconds does not carry across models and machines; one in decode
    # steps (of the model, measured online) does, so it is the default when the user sets
    # neither a chunk nor a target.
    itl_slo_steps: float | None = setting(
        None, "inter-token latency target in decode steps: as --itl-slo, with the target this many "
        "times the measured time of a one-stream decode-only step, and at least two decode-only steps of "
        "the current batch (default: "
        f"{DEFAULT_ITL_SLO_STEPS:g} when none of --chunked-prefill-size, --itl-slo and --ttft-slo is "
        "given, else off; --chunked-prefill-size N alone keeps the fixed chunk)")
    itl_stretch: float = setting(
        2.0, "with --itl-slo and --ttft-slo: how far (x the tightest ITL target) a step may stretch "
        "to give a prompt about to miss its TTFT target the tokens it needs")
    # NOTE: on the CPU the KV pool is allocated untouched and a written page is resident
    # memory, so the cache's retained pages are RSS; on CUDA the pool is reserved up front.
    prefix_cache_max_pages: int | None = setting(
        None, "most KV pages the prefix cache keeps for finished requests; past it the least "
        f"recently used are freed at once (default: {CPU_PREFIX_CACHE_BYTES // 2**20} MiB worth on the "
        "CPU, where cached pages are resident memory; no bound but the pool on CUDA)")
    disable_prefix_cache: bool = setting(False, "use the do-nothing cache instead of the radix tree "
                                         "(the baseline for prefix-reuse measurements)")
    share_prefix_cache_across_tenants: bool = setting(
        False, "let one tenant's requests reuse prefixes another tenant's put in the cache (by default "
        "each tenant, and each cache_salt, has a namespace of its own: another tenant can never "
        "time whether a prompt is cached); cache_salt still separates requests")
    retention_ttl_s: float = setting(30.0, "how long a DSL program run's prefixes are kept after its "
                                     "latest request (pinned: evicted after unpinned ones; released "
                                     "when the run ends)")
    retention_max_ttl_s: float = setting(600.0, "cap on a request's retention TTL in seconds (an HTTP "
                                         "retention hint above it is refused with a 400)")
    retention_max_pages: int | None = setting(
        None, "KV pages one owner (a tenant, or a DSL run) may keep pinned by retention; a pin past "
        "it is refused and logged (default: a quarter of the KV pool)")
    kv_tier_dir: str | None = setting(
        None, "a directory on local disk for the KV cache's second tier: pages the prefix cache evicts "
        "are written there (in the background) and reloaded, instead of recomputed, by a later "
        "request with the same prefix; default: no tier (evicted pages are dropped)")
    kv_tier_max_bytes: int = setting(4 * 2**30, "size of the second tier's file in bytes (preallocated; "
                                     "least recently used pages go when it is full)")
    kv_tier_int8: bool = setting(False, "store a float KV pool's pages in the tier as int8 rows with one "
                                 "scale each (~3.8x the pages; a reload is then as exact as an int8 pool)")
    schedule_policy: SchedulePolicy = setting("lpm", "order of the waiting queue: 'lpm' (longest "
                                              "cached prefix first) or 'fcfs'")
    lpm_max_overtakes: int | None = setting(
        16, "LPM aging: once this many later arrivals were admitted ahead of a waiting request, it "
        "goes first; none: no bound (a cache-cold request can starve)")
    fair_scheduling: bool = setting(
        True, "priority classes (interactive before batch, which may yield its running slot) and a "
        "fair share between tenants on top of --schedule-policy; with one tenant and one class it "
        "orders exactly as the policy alone")
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "the KV cache's stored dtype: 'auto' (the model's), 'int8' or 'fp8' (e4m3): rows of "
        "head_dim 8-bit codes plus one fp32 scale per (token, head), ~3.8x the tokens in the same "
        "memory for an fp32 model; fp8 is computed in fp32 on the CPU")
    speculation: bool = setting(True, "speculative decoding: forced spans of constrained output and "
                                "prompt-lookup drafts, verified exactly (the output never changes)")
    spec_fixed_cost_rows: float | None = setting(
        None, "a forward pass's fixed cost in token rows, F in the break-even acceptance rate "
        "B / (F + B) that prompt-lookup drafts must beat with B requests decoding (default: 16 on "
        "the CPU, 256 on CUDA)")
    grammar_backend: str = setting("auto", "constrained-decoding engine: 'auto' (the best per kind), "
                                   "'llguidance', 'outlines' or 'xgrammar'")
    grammar_timeout_s: float = setting(30.0, "bound on one grammar compilation in seconds (then a "
                                       "ConstraintError)")
    # NOTE: real schemas reach ~0.9 MB (JSONSchemaBench's Kubernetes ones); the compile
    # timeout bounds the rest.
    grammar_max_bytes: int = setting(2 * 1024 * 1024, "bound on a constraint's source (schema JSON, "
                                     "regex, Lark) in bytes")
    # NOTE: a property counts two levels ("properties" and its schema); at most
    # grammars.MAX_SCHEMA_DEPTH, what the schema validator can check without recursing out.
    schema_max_depth: int = setting(64, f"bound on a JSON schema's nesting of objects and arrays (at "
                                    f"most {MAX_SCHEMA_DEPTH}); a deeper schema is refused with a 400")
    seed: int = setting(0, "seed of the engine's generator for requests without their own seed")
    prepack_weights: bool = setting(True, "CPU fp32: reorder every linear weight once for oneDNN "
                                    "(no-: plain F.linear, the baseline); ignored on CUDA")
    weights: WeightFormat = setting(
        "auto", "how the weights are held: 'fp32' (the checkpoint in --dtype), 'int8' (per channel), "
        "'int4' (groups of 32), 'gguf' (a GGUF file's own blocks, not dequantized) or 'auto' "
        "(the source's own: 'gguf' for a GGUF file, 'fp32' for an HF directory)")
    fused_decode: bool = setting(
        True, "CPU, block-quantized weights: a step that only decodes runs as one native call "
        "(kernels/cpu/decode_step.c) instead of layer by layer (no-: the reference path)")
    invariant_attention: bool = setting(
        True, "CPU: prefill attention through the native kernel whose rows do not depend on the "
        "batch, the prefill chunk or the cached prefix (docs/invariance.md); no-: torch's SDPA, "
        "faster on long prompts (windowed or soft-capped layers always take the native kernel)")
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's)")
    # NOTE: a full collection otherwise scans every live object (transformers' among them),
    # a stall of a whole step at random; process-wide, as vLLM's engine core does.
    freeze_gc: bool = setting(True, "once loaded, move every live Python object into the garbage "
                              "collector's permanent generation")
    debug: bool = setting(False, "run the cache and scheduler integrity checks whenever the engine "
                          "goes idle")
    tensor_parallel_size: int = setting(1, "tensor-parallel ranks (one process each) that split every "
                                        "layer; gloo on the CPU, NCCL on CUDA")
    nnodes: int = setting(1, "machines the ranks span (--tensor-parallel-size / --nnodes ranks each)")
    node_rank: int = setting(0, "this machine's index; 0 runs the engine, the others only ranks")
    dist_init_addr: str | None = setting(None, "host:port of node 0's rendezvous (default: a free "
                                         "local port)")
    dist_timeout_s: float = setting(60.0, "a collective waiting longer than this many seconds fails "
                                    "(a dead rank)")

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "page_size", "num_pages", "max_running_requests",
                     "max_prefill_tokens", "chunked_prefill_size", "num_threads", "tensor_parallel_size",
                     "nnodes", "grammar_max_bytes", "lpm_max_overtakes", "retention_max_pages",
                     "kv_tier_max_bytes"):
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
        if not 0 < self.retention_ttl_s <= self.retention_max_ttl_s:
            raise InvalidRequestError(f"retention_ttl_s must be in (0, retention_max_ttl_s={self.retention_max_ttl_s}], "
                                      f"got {self.retention_ttl_s!r}")
        if not self.grammar_timeout_s > 0:
            raise InvalidRequestError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s!r}")
        if self.spec_fixed_cost_rows is not None and not self.spec_fixed_cost_rows > 0:
            raise InvalidRequestError(f"spec_fixed_cost_rows must be > 0, got {self.spec_fixed_cost_rows!r}")
        for name in ("ttft_slo", "itl_slo"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise InvalidRequestError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.itl_slo_steps is not None and not (isinstance(self.itl_slo_steps, (int, float))
                                                   and self.itl_slo_steps > 1):
            raise InvalidRequestError(f"itl_slo_steps must be a number > 1 (a step that prefills costs more "
                                      f"than a decode-only step), got {self.itl_slo_steps!r}")
        if self.itl_slo_steps is not None and self.itl_slo is not None:
            raise InvalidRequestError("give one ITL target: itl_slo (seconds) or itl_slo_steps (decode "
                                      "steps), not both")
        if not (isinstance(self.itl_stretch, (int, float)) and self.itl_stretch >= 1):
            raise InvalidRequestError(f"itl_stretch must be a number >= 1, got {self.itl_stretch!r}")
        if self.ttft_slo is not None and self.itl_slo is not None and self.ttft_slo < self.itl_slo:
            raise InvalidRequestError(f"ttft_slo ({self.ttft_slo} s) below itl_slo ({self.itl_slo} s) cannot be "
                                      "met: a first token takes at least one step")
        if self.kv_tier_dir is not None and self.tensor_parallel_size > 1:
            # NOTE: a reload writes the leader's KV pool only; each rank holds its own shard
            raise InvalidRequestError("kv_tier_dir is not supported with tensor_parallel_size > 1")
        if self.num_pages is not None and self.num_pages < 2:
            raise InvalidRequestError("num_pages must be >= 2 (page 0 is the padding page)")
        if self.prefix_cache_max_pages is not None and not (
                isinstance(self.prefix_cache_max_pages, int) and self.prefix_cache_max_pages >= 0):
            raise InvalidRequestError(f"prefix_cache_max_pages must be an integer >= 0, got "
                                      f"{self.prefix_cache_max_pages!r}")

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
            itl_slo_steps=self._default_itl_slo_steps(),
            spec_fixed_cost_rows=self.spec_fixed_cost_rows or (256.0 if on_cuda else 16.0),
        )

    def _default_itl_slo_steps(self) -> float | None:
        """The relative ITL target: the user's, else the default when the user chose no
        chunk and no target of their own (a chunk alone means the fixed-chunk baseline)."""
        if self.itl_slo_steps is not None:
            return self.itl_slo_steps
        chosen = (self.chunked_prefill_size, self.itl_slo, self.ttft_slo)
        return DEFAULT_ITL_SLO_STEPS if all(v is None for v in chosen) else None

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
