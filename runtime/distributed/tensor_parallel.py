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
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.config import EngineConfig
from runtime.distributed.child_watch import exit_message, stderr_to_file, tail_of_file
from runtime.errors import ArborError
from runtime.model.kv_cache import KVCache
from runtime.model.runner import ForwardOutput, ModelRunner
from runtime.scheduler.batch import ForwardBatch

log = logging.getLogger("arbor.tp")
CONTROL_TIMEOUT = timedelta(days=365)  # the batch broadcast: an idle engine waits
WATCH_INTERVAL_S = 0.2  # how often rank 0 looks at its followers' exit codes


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
    """Start a follower process per rank of ``ranks`` (spawned: a fresh interpreter). Each
    writes its stderr to a file of its own (``proc.stderr_path``) from its first line on."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(cfg, r), name=f"arbor-tp-rank{r}", daemon=True) for r in ranks]
    for p in procs:
        with stderr_to_file(f"{p.name}-") as path:
            p.start()
        p.stderr_path = path  # type: ignore[attr-defined]
        log.info("%s (pid %d) logs to %s", p.name, p.pid, path)
    return procs


def rank_exit_message(proc: Any) -> str:
    """How a follower ended, with its stderr's tail (and the `spawn` hint where it applies)."""
    return exit_message(f"tensor-parallel {proc.name.removeprefix('arbor-tp-')} (pid {proc.pid})",
                        proc.exitcode, tail_of_file(proc.stderr_path), spawned=True)


class LeaderGroup:
    """Rank 0's side: the follower processes it started and the control group.

    The followers are watched from the start: one that exits before the group forms
    fails the start within ``WATCH_INTERVAL_S``, and one that exits later marks the group
    ``failed`` and calls ``on_failure`` (the engine fails its requests and reports unhealthy).
    """

    def __init__(self, cfg: EngineConfig) -> None:
        self.failed: str | None = None
        self.closed = False
        self.on_failure: Callable[[str], None] | None = None  # set by the engine once it runs
        self.procs = spawn_ranks(cfg, range(1, len(local_ranks(cfg))))
        try:
            self.control = self._join(cfg)
        except BaseException:
            self._stop_procs()
            raise
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="arbor-tp-watch", daemon=True)
        self._watcher.start()

    def _join(self, cfg: EngineConfig) -> dist.ProcessGroup:
        """``init_group`` as rank 0, on a thread, while this one watches the followers.

        NOTE: a rendezvous cannot be interrupted: after a follower died, the joining thread
        keeps waiting (daemon) until ``dist_timeout_s``, but the caller is told at once.
        """
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["control"] = init_group(cfg, 0)
            except BaseException as exc:  # handed to the waiting thread
                joined["error"] = exc

        thread = threading.Thread(target=join, name="arbor-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_INTERVAL_S)
            dead = self.dead_ranks()
            if dead and thread.is_alive():
                raise TensorParallelError("a tensor-parallel rank died before joining: "
                                          + "\n".join(rank_exit_message(p) for p in dead))
        if "error" in joined:
            raise joined["error"]
        return joined["control"]

    def dead_ranks(self) -> list[Any]:
        return [p for p in self.procs if p.exitcode is not None]

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            dead = self.dead_ranks()
            if dead and not self.closed:
                self.fail("; ".join(rank_exit_message(p) for p in dead))
                return

    def fail(self, reason: str) -> None:
        """Mark the group failed (first reason wins) and tell the engine."""
        if self.failed is not None:
            return
        self.failed = reason
        log.error("tensor parallelism failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def send(self, message: object) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop the followers (idempotent; after the engine loop stopped)."""
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
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
            # NOTE: the collective can fail before the dead rank's exit is visible here.
            time.sleep(WATCH_INTERVAL_S)
            dead = self.group.dead_ranks()
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            reason = "; ".join(rank_exit_message(p) for p in dead) if dead else f"a remote rank: {first_line}"
            self.group.fail(reason)
            raise TensorParallelError(f"a tensor-parallel rank failed: {self.group.failed}") from exc


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
    runner = ModelRunner(loaded.model, kv, loaded.device, invariant_attention=cfg.invariant_attention)
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
        if p.exitcode != 0:
            log.error("%s", rank_exit_message(p))
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _receive(control: dist.ProcessGroup) -> list[Any]:
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    return message
