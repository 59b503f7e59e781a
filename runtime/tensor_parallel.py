"""Tensor-parallel ranks: one process per rank, a ``torch.distributed`` process group, and
the runner of rank 0 that broadcasts each step's ``ForwardBatch`` to the others.

The scheduler, the radix tree, grammars and sampling run once, on rank 0 (the engine's
process). Each step rank 0 broadcasts the plain-value batch (token ids, positions, page
tables) and every rank runs the same forward on its shard (``runtime.model.parallel``), so
the ranks never disagree about pages: each holds the same page ids over its own KV heads.
Every rank ends with the full logits (the LM head's gather); rank 0 samples.

Two groups: the default one (gloo on the CPU, NCCL on CUDA) carries the model's
collectives with ``dist_timeout_s``, so a rank that died or hangs fails the step instead
of hanging it; a gloo control group carries the batches without a timeout (an idle engine
sends nothing for as long as it likes).

    node 0:  rank 0 (engine)  + ranks 1 .. per_node-1   (spawned by the engine)
    node k:  ranks k*per_node .. (k+1)*per_node-1       (``arbor serve --node-rank k``)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.config import EngineConfig
from runtime.errors import ArborError
from runtime.model.kv_cache import KVCache
from runtime.model.runner import ForwardOutput, ModelRunner
from runtime.scheduler.batch import ForwardBatch

log = logging.getLogger("arbor.tp")
CONTROL_TIMEOUT = timedelta(days=365)  # the batch broadcast: an idle engine waits


class TensorParallelError(ArborError, RuntimeError):
    """A tensor-parallel rank failed or stopped answering; the engine cannot step."""


def with_rendezvous(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with a rendezvous address (a free loopback port when none was given) and,
    without ``num_threads``, an equal share of this machine's cores per local rank."""
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // per_node)
    addr = cfg.dist_init_addr
    if addr is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{sock.getsockname()[1]}"
    return dataclasses.replace(cfg, dist_init_addr=addr, num_threads=threads)


def local_ranks(cfg: EngineConfig) -> range:
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def init_group(cfg: EngineConfig, rank: int) -> dist.ProcessGroup:
    """Join the world as ``rank``; returns the control group (gloo, no timeout)."""
    backend = "nccl" if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()) \
        else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{cfg.dist_init_addr}", rank=rank,
                            world_size=cfg.tensor_parallel_size, timeout=timedelta(seconds=cfg.dist_timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    assert control is not None
    return control


def spawn_ranks(cfg: EngineConfig, ranks: range) -> list[Any]:
    """Start a follower process per rank of ``ranks`` (spawned: a fresh interpreter)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(cfg, r), name=f"arbor-tp-rank{r}", daemon=True) for r in ranks]
    for p in procs:
        p.start()
    return procs


class LeaderGroup:
    """Rank 0's side: the follower processes it started and the control group."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.procs = spawn_ranks(cfg, range(1, len(local_ranks(cfg))))
        try:
            self.control = init_group(cfg, 0)
        except BaseException:
            self._stop_procs()
            raise
        self.failed: str | None = None
        self.closed = False

    def send(self, message: object) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop the followers (idempotent; after the engine loop stopped)."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None:
            try:
                self.send(None)  # followers leave their loop
            except RuntimeError as exc:
                log.warning("could not stop the tensor-parallel ranks: %s", exc)
        for p in self.procs:
            p.join(timeout=10)
        self._stop_procs()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_procs(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class BroadcastingRunner(ModelRunner):
    """Rank 0's runner: sends each batch to the other ranks, then runs its own shard."""

    def __init__(self, model: Any, kv: KVCache, device: torch.device, group: LeaderGroup) -> None:
        super().__init__(model, kv, device)
        self.group = group

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.group.failed is not None:
            raise TensorParallelError(f"a tensor-parallel rank failed earlier: {self.group.failed}")
        try:
            self.group.send(batch)
            return super().forward(batch)
        except RuntimeError as exc:  # gloo / NCCL: a peer closed its connection, or a timeout
            self.group.failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            dead = [p.name for p in self.group.procs if not p.is_alive()]
            raise TensorParallelError(f"a tensor-parallel rank failed ({', '.join(dead) or 'a remote rank'}"
                                      f"): {self.group.failed}") from exc


def follower_main(cfg: EngineConfig, rank: int) -> None:
    """A rank other than 0: load and shard the model, then run every broadcast batch."""
    from runtime.engine_setup import load_engine_model

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    control = init_group(cfg, rank)
    loaded = load_engine_model(cfg, rank=rank)
    args = loaded.model.args
    [setup] = _receive(control)
    kv = KVCache(args.num_layers, setup["num_pages"], loaded.config.page_size, args.num_kv_heads,
                 args.head_dim, loaded.kv_dtype, loaded.device)
    runner = ModelRunner(loaded.model, kv, loaded.device)
    with torch.inference_mode():
        while (batch := _receive(control)[0]) is not None:
            runner.forward(batch)
    dist.destroy_process_group()


def run_node(cfg: EngineConfig) -> int:
    """``arbor serve --node-rank k`` (k > 0): this node's ranks, until rank 0 stops them."""
    cfg = with_rendezvous(cfg)
    procs = spawn_ranks(cfg, local_ranks(cfg))
    log.info("node %d: ranks %s joining %s", cfg.node_rank, list(local_ranks(cfg)), cfg.dist_init_addr)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


def _receive(control: dist.ProcessGroup) -> list[Any]:
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    return message
