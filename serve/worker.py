"""The rank processes behind `LLM`: each joins the TP group, builds its shard of the model and its LLMEngine, then
loops on steps. Rank 0 also takes the driver's calls over a pipe (add_request, abort_request, step, ...).

    driver (the caller's process)  --pipe-->  rank 0  --★ control broadcast-->  ranks 1 .. p-1

Each rank is a fresh `python -c "from serve.worker import main; main()"` process (not multiprocessing: the caller's script is never
re-imported, so it needs no `if __name__ == "__main__"` guard). The ranks meet in a file store in the driver's
directory; rank 0 connects to the driver's socket there (authenticated with a key from the environment).

Every rank ends when it is told (shutdown), when its step raises (the traceback goes to error-RANK.txt for the
driver, and the exit code is 1), or when the driver's process is gone (a watcher thread sees the parent change and
exits at once: no orphan ranks, even when the caller is killed).
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass

KEEP_ALIVE_S = 5.0  # the other ranks hear from rank 0 at least this often (and 4 times per group timeout)


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its part of the engine from: the one record of LLM's ranks (pickled to each) and of the
    launcher's (launch/serve_settings.Settings is this record with the launcher's workload and report added)."""

    model: object  # ModelConfig | LlamaConfig | MoEConfig | ...
    checkpoint: object  # a save_pretrained directory (or its Checkpoint, headers read), or None: random from seed
    dtype: object  # torch.dtype
    seed: int
    backend: str
    device: str
    engine: object  # EngineConfig
    eos_token_ids: tuple[int, ...] = ()
    moe_parallel: str = "tp"  # MoE models: where the experts live (tp: split; ep: whole experts per rank)
    check: bool = False  # requests checked against the dense oracle (LLM: on rank 0; the launcher: by every rank)
    pp: int = 1  # pipeline stages (layers/models/pipeline.py): the world is pp stages of world / pp TP ranks
    pp_boundary: str = "whole"  # whole | scatter: what each TP rank sends across a stage boundary
    cp: int = 1  # context parallelism (layers/attention/context_parallel.py): cp × tp ranks, the KV cache split
    variant: str = "v2"  # the blocks served: v2 (Megatron) or v1 (all column-parallel)
    vocab_parallel: bool = True  # the embedding and head split over the ranks (False: whole on each)
    timeout_s: float | None = None  # the group's timeout (None: tp/dist.py DEFAULT_TIMEOUT_S)
    draft: tuple | None = None  # speculative decoding's draft model: (its config, its checkpoint or None)
    threads: int = 1  # each rank's intra-op threads (tp/dist.py threads_per_rank)

    def validate(self, world_size: int, pp_name: str = "pp", cp_name: str = "cp") -> None:
        """The rules between the model, the parallel layout and the engine's settings: the one copy LLM (before any
        rank starts) and the launcher (on every rank, before any collective) call. ValueError, one line, naming the
        setting as the caller spells it (LLM: pipeline_parallel_size, context_parallel_size)."""
        from layers.models.families import FAMILIES, family, of
        from layers.models.pipeline import check_pipeline

        self.engine.check_pipeline(self.pp)
        self.engine.check_context_parallel(self.cp, self.pp, cp_name)
        if self.engine.batch_invariant and getattr(self, "pd", None) is not None:
            raise ValueError("batch_invariant with P/D disaggregation is not built: serve it colocated")
        if self.engine.batch_invariant:
            self.engine.check_batch_invariant(world_size // (self.cp * self.pp))
            if not of(self.model).quantization:  # a matmul outside the linears (MoE's experts, MLA's absorbed decode)
                raise ValueError(f"batch_invariant with {self.model.family} models is not built (not every matmul is "
                                 f"a linear the mode tiles): serve a GPT-2, Llama or Qwen3 model")
        if self.engine.quantization is not None and not of(self.model).quantization:
            raise ValueError(f"quantization={self.engine.quantization!r} with {self.model.family} models is not built "
                             f"(their experts' or latent projections' weights are not column- and row-parallel "
                             f"linears); serve them unquantized")
        if self.engine.quantization is not None and self.pp > 1:
            raise ValueError(f"quantization={self.engine.quantization!r} with pipeline stages ({pp_name}={self.pp}) is "
                             f"not built: use {pp_name}=1")
        if self.engine.kv_eviction is not None and not of(self.model).kv_eviction:
            raise ValueError(f"kv_eviction with {self.model.family} models is not built (MLA's prefill attends its "
                             f"decompressed keys its own way); serve without it")
        if self.cp > 1 and not of(self.model).context_parallel:
            built = ", ".join(family(f).title for f in FAMILIES if family(f).context_parallel)
            raise ValueError(f"{cp_name}={self.cp}: {self.model.family} models are not built for context parallelism "
                             f"({built} are)")
        try:
            check_pipeline(self.model, world_size // self.cp, self.pp, self.variant, self.vocab_parallel)
        except ValueError as exc:
            named = pp_name != "pp" and str(exc).startswith("pp=")
            raise ValueError(f"{pp_name}={self.pp}: {exc}" if named else str(exc)) from None


def _watch_parent(parent: int, directory: str, rank: int) -> None:
    """Exit the moment the driver is gone (its pid is no longer our parent); rank 0 removes the driver's directory,
    which the driver, killed, could not."""
    while True:
        if os.getppid() != parent:
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
            os._exit(3)
        time.sleep(0.5)


AUTHKEY_ENV = "TPREF_LLM_AUTHKEY"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--rank", type=int, required=True)
    args.add_argument("--world-size", type=int, required=True)
    args.add_argument("--dir", required=True)
    args = args.parse_args()
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent, args.dir, args.rank), daemon=True).start()
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_WORLD_SIZE=str(args.world_size))
    code = 0
    try:
        with open(os.path.join(args.dir, "spec.pkl"), "rb") as f:
            spec = pickle.load(f)
        conn = None
        if args.rank == 0:
            from multiprocessing.connection import Client

            conn = Client(os.path.join(args.dir, "driver.sock"), "AF_UNIX",
                          authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
        _serve(args.rank, args.world_size, os.path.join(args.dir, "store"), spec, conn)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the driver, then the rank exits non-zero
        with open(os.path.join(args.dir, f"error-{args.rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    if args.rank == 0 and os.getppid() != parent:  # the driver was killed: nobody else will remove its directory
        shutil.rmtree(args.dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running interpreter teardown: the process group's threads are gone already (destroyed in
    # _serve) or this rank failed; either way there is nothing left to flush, and no destructor can abort the exit.
    os._exit(code)


def build_engine(ctx, spec: RankSpec):
    from layers.models.lm import NEAR_TIE
    from serve.build import build_rank, dense_model, new_engine, rank_weights
    from serve.hooks import LedgerCheck, OracleCheck

    lm, dense, cp_group = build_rank(spec, ctx)
    hooks = [LedgerCheck()] if spec.engine.check_ledger else []
    if spec.check and ctx.is_main:  # the dense model, on rank 0 only: random weights as made, a checkpoint read whole
        hooks.append(OracleCheck(dense_model(spec.model, spec.checkpoint, spec.dtype, ctx.device, dense, lm),
                                 NEAR_TIE[spec.dtype]))
    del dense
    draft_lm = None
    if spec.draft is not None:  # whole on every rank: sharded over a group of this rank alone
        from layers.models.lm import shard_lm
        from serve.build import own_group, prepare_weights

        draft_weights, _ = rank_weights(*spec.draft, spec.dtype, ctx.device, spec.seed)
        draft_lm = prepare_weights(shard_lm(draft_weights, "v2", own_group(ctx)), spec.engine)
    return new_engine(lm, ctx, spec.engine, spec.eos_token_ids, spec.seed, hooks, draft_lm, cp_group)


def _serve(rank: int, world_size: int, store: str, spec: RankSpec, conn) -> None:
    import torch
    import torch.distributed as dist

    from serve.offline import drive
    from tp.dist import DEFAULT_TIMEOUT_S, init_from_env

    torch.set_num_threads(spec.threads)  # OMP_NUM_THREADS was set to it before torch loaded (serve/executor.py)
    timeout_s = spec.timeout_s or DEFAULT_TIMEOUT_S
    ctx = init_from_env(spec.backend, timeout_s=timeout_s, init_method=f"file://{store}", device=spec.device)
    engine = build_engine(ctx, spec)
    feed = DriverFeed(conn, min(KEEP_ALIVE_S, timeout_s / 4)) if rank == 0 else None
    if feed is not None:
        conn.send(("ready", {"num_blocks": engine.num_blocks, "backend": ctx.backend, "device": str(ctx.device),
                             "threads": torch.get_num_threads()}))
    drive(engine, feed, None if feed is None else feed.sink)  # the one step loop; rank 0 fed by the driver's calls
    dist.barrier(group=ctx.group)  # everyone is out of its loop before the group goes away
    dist.destroy_process_group()


class DriverFeed:
    """Rank 0's feed and sink in the step loop (serve/offline.py drive) behind LLM: the driver's calls over the pipe.

    Waiting for a call, it answers the calls that are not steps (add_request, abort_request, stats, ...) and, whenever
    the other ranks have had no control message for `every` seconds (the driver idle, or busy with calls that are
    not steps), sends an IDLE one, so their wait never reaches the group's timeout. A step is due when the driver
    asks for one ("step"), and for as long as any request is unfinished after "run" (generate(): each step's outputs
    sent without waiting for the driver, which decodes them while the next step runs; then "ok") or "serve" (a
    server: the outputs with the stats, requests and aborts taken between steps without an answer). The loop ends
    at "shutdown", or when the driver's end of the pipe closes; the other ranks are told to stop."""

    def __init__(self, conn, every: float):
        self.conn, self.every = conn, every
        self.mode: str | None = None  # None: waiting for a call; "step", "run" or "serve": stepping for it

    def __call__(self, engine) -> bool:
        """Take the driver's calls until a step is due (True), or the loop ends (False)."""
        self.engine = engine
        while True:
            if self.mode in ("run", "serve"):
                while self.conn.poll(0):  # between steps: what came meanwhile, without waiting
                    if not self._take(engine):
                        return False
                if engine.has_unfinished_requests():
                    return True
                if self.mode == "run":  # generate() is done: its answer, then back to waiting for calls
                    self.conn.send(("ok", None))
                    self.mode = None
            if self.mode == "step":
                return True
            quiet = time.monotonic() - engine.last_control
            if quiet >= self.every:
                engine.keep_alive()
            elif self.conn.poll(self.every - quiet) and not self._take(engine):
                return False

    def sink(self, outputs: list) -> None:
        """Each step's outputs to the driver: a step's answer (with the pool and queues after it, which a server's
        /metrics reads), or sent without waiting while generate() or a server runs."""
        if self.mode == "step":
            self.conn.send(("ok", (outputs, self.engine.stats())))
            self.mode = None
        else:
            self.conn.send(("outputs", outputs if self.mode == "run" else (outputs, self.engine.stats())))

    def _take(self, engine) -> bool:
        """One call from the driver; False when the loop ends (shutdown, or the driver is gone)."""
        try:
            op, args = self.conn.recv()
        except EOFError:  # the driver is gone
            engine.shutdown()
            return False
        if op == "shutdown":
            engine.shutdown()
            self.conn.send(("ok", None))
            return False
        if op == "abort_nowait":  # a stop string matched in the driver, or a caller that does not wait
            engine.abort_request(*args)
        elif self.mode == "serve" and op == "add_nowait":  # checked by the driver: a refusal fails the engine
            engine.add_request(*args)
        elif self.mode is not None:
            raise RuntimeError(f"{op} while {'generate() runs' if self.mode == 'run' else 'serving'}: only "
                               f"{'aborts are' if self.mode == 'run' else 'add_nowait, abort_nowait, shutdown are'} "
                               f"taken then")
        elif op in ("run", "serve", "step"):
            self.mode = op
        else:
            calls = {"add_request": engine.add_request, "abort_request": engine.abort_request,
                     "has_unfinished_requests": engine.has_unfinished_requests, "stats": engine.stats}
            try:  # the other calls change nothing when they refuse: the caller's error, and the engine goes on
                self.conn.send(("ok", calls[op](*args)))
            except (ValueError, TypeError, KeyError) as exc:
                self.conn.send(("ValueError", f"{exc}" if isinstance(exc, ValueError) else
                                f"{type(exc).__name__}: {exc}"))
        return True
