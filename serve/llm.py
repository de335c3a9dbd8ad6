"""The engine as a library: `LLM(model, tensor_parallel_size=p).generate(prompts, SamplingParams(...))`.

    from serve import LLM, SamplingParams
    with LLM("path/to/save_pretrained_dir", tensor_parallel_size=2) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        print(out[0].outputs[0].text)

The caller's process is a driver: it starts p rank processes itself (no torchrun: serve/executor.py), which meet in a
file store and form one TP group (gloo on CPU; NCCL with one GPU per rank where there are enough GPUs: tp/dist.py
decides). Rank 0 takes the driver's calls over a pipe and every rank runs the same LLMEngine (serve/engine.py); the driver holds
no process group and no model, only the tokenizer: text in (encoded here), text out (decoded here as tokens
arrive, serve/detokenizer.py), stop strings matched on that text.

Conversations: `llm.chat(messages, params)` renders them with the checkpoint's chat template (the server's plain
template, "role: content" lines then "assistant:", where it has none). `llm.get_tokenizer()` is the tokenizer the
driver encodes with; `max_model_len=N` caps prompt + output tokens per request (vLLM's meaning; at most the model's
context, its default).

Online use, vLLM's LLMEngine calls on the same object: `add_request(request_id, prompt, params)`, `step()` (a
RequestOutput per request that moved), `abort_request(request_id)`, `has_unfinished_requests()`. With
`scheduling_policy="priority"`, `generate(..., priority=[...])` and `add_request(..., priority=p)` order the requests
(lower first, ties by arrival; serve/scheduler.py).

Every bad input is a one-line ValueError in the caller before anything runs; a rank that fails or dies makes the
next call raise RuntimeError within a second, and every rank is stopped. Ranks never outlive the caller.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import time
from pathlib import Path

from serve.config import EngineConfig
from serve.detokenizer import IncrementalDetokenizer
from serve.executor import MultiprocExecutor
from serve.outputs import RequestOutput
from serve.sampling_params import FieldError, SamplingParams
from serve.worker import RankSpec
from tp.dist import DEFAULT_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "conf" / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def resolve_model(model: str, p: int, moe_parallel: str):
    """(model config, checkpoint directory or None, preset name or None), valid at tensor-parallel size p."""
    from layers.models.families import validate
    from layers.models.hf import read_config
    from tp.dist import ConfigError

    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model={model!r} must be a save_pretrained directory or a preset name")
    check_model_exists(model)
    path = Path(model)
    try:
        if path.is_dir():
            cfg, checkpoint = read_config(path), str(path)
        else:
            cfg, checkpoint = _preset(str(model)), None
        validate(cfg, p, moe_parallel)
    except ConfigError as exc:
        raise ValueError(f"tensor_parallel_size={p}: {exc}" if "divisible" in str(exc) or "split" in str(exc)
                         else str(exc)) from None
    return cfg, checkpoint


def python_command() -> str:
    """How a hint writes this interpreter: as the README does (.venv/bin/python) when it lies under the current
    directory, else its full path."""
    try:
        rel = os.path.relpath(sys.executable)
    except ValueError:  # another drive
        return sys.executable
    return sys.executable if rel.startswith("..") else rel


def check_model_exists(model, what: str = "model=") -> None:
    """ValueError (one line) unless model is a directory or a preset's name."""
    if not Path(model).is_dir() and not (PRESETS / f"{model}.yaml").is_file():
        presets = sorted(f.stem for f in PRESETS.glob("*.yaml"))
        raise ValueError(f"{what}{str(model)!r}: no such directory or preset (presets: {', '.join(presets)}; "
                         f"{python_command()} -m serve.toy_model DIR writes a small text model)")


def _preset(name: str):
    from omegaconf import OmegaConf

    from layers.models.families import config_class

    fields = OmegaConf.to_container(OmegaConf.load(PRESETS / f"{name}.yaml"), resolve=True)
    return config_class(fields.pop("family", "gpt2")).from_settings(fields)


def load_tokenizer(source: str | None):
    """transformers' AutoTokenizer from a directory that has tokenizer files; None where there are none."""
    if source is None or not has_tokenizer(source):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype="auto", seed: int = 0, *,
                 pipeline_parallel_size: int = 1, context_parallel_size: int = 1, data_parallel_size: int = 1,
                 router_policy: str = "cache_aware", tokenizer: str | None = None,
                 backend: str = "auto",
                 device: str = "auto", moe_parallel: str = "tp", timeout_s: float = DEFAULT_TIMEOUT_S,
                 check: bool = False, threads_per_rank: int | None = None, **engine_settings):
        """model: a save_pretrained directory (GPT-2, Llama, Mixtral; sharded or not) or a preset (conf/model/).
        pipeline_parallel_size: pp stages of tensor_parallel_size ranks each (pp · tp ranks; layers/models/pipeline.py's
        split of the layers, serve/pipeline.py's engine with up to pp micro-batches in flight).
        context_parallel_size: cp ranks per TP rank (cp · tp ranks) holding the same heads and each 1/cp of every
        request's K,V (layers/attention/context_parallel.py's split cache: token t on cp rank t % cp, one log-sum-exp
        merge per layer); GPT-2 and Llama, pp = 1, block_size a multiple of cp.
        data_parallel_size: replicas of the whole (each tp · pp · cp ranks, its own pool) behind this one LLM
        (serve/replicas.py); router_policy: how a request's replica is chosen (serve/router.py): cache_aware
        (SGLang's: the longest prefix a replica was sent, balanced by load) or round_robin.
        threads_per_rank: each rank's intra-op threads (None: tp/dist.py threads_per_rank's choice from the cores
        this process may use, or OMP_NUM_THREADS; `LLM.threads_per_rank` says which ran, and why).
        check: every finished request against the dense model recomputed without a cache (RequestOutput.oracle;
        rank 0 holds the dense model too). dtype: "auto" (the checkpoint's torch_dtype; float32 for presets), a name
        or a torch.dtype; `LLM.dtype` says which ran, as a name. engine_settings: EngineConfig's fields (vLLM's
        names: serve/config.py); check_ledger (every step's collectives against the model) is on by default."""
        from layers.models.hf import resolve_dtype
        from tp.dist import ConfigError, resolve_backend, resolve_device
        from tp.dist import threads_per_rank as resolve_threads

        self.executor = None
        p = tensor_parallel_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"tensor_parallel_size={p!r} must be a positive integer")
        pp = pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size={pp!r} must be a positive integer")
        cp = context_parallel_size
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(f"context_parallel_size={cp!r} must be a positive integer")
        dp = data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size={dp!r} must be a positive integer")
        from serve.router import POLICIES

        if router_policy not in POLICIES:
            raise ValueError(f"router_policy={router_policy!r}: choose {' or '.join(POLICIES)}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32)")
        if not isinstance(check, bool):
            raise ValueError(f"check={check!r} must be True or False")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.config = EngineConfig.from_kwargs(**engine_settings)
        if self.config.kv_transfer_config is not None:  # the disk tier's directory, before any rank starts
            if self.config.kv_transfer_config.kv_connector == "PDConnector":
                raise ValueError("kv_transfer_config PDConnector (P/D's hand-over) runs two groups of ranks in one "
                                 "world: launch/serve.py pd.prefill_ranks=... pd.decode_ranks=..., not LLM")
            self.config.kv_transfer_config.check_disk()
        if check and self.config.kv_cache_dtype != "auto":
            raise ValueError(f"check=True compares with the dense model's unquantized K,V: with kv_cache_dtype="
                             f"{self.config.kv_cache_dtype}, check with launch/serve.py (its oracle round-trips K,V with "
                             f"the engine's scales)")
        spec_config = self.config.speculative_config
        try:
            backend = resolve_backend(backend, p * pp * cp * dp)  # every replica's ranks on this machine
            device = resolve_device(device, backend)
            if self.config.batch_invariant:  # one thread per rank (serve/model_runner.check_invariant says why)
                if threads_per_rank not in (None, 1):
                    raise ValueError(f"batch_invariant runs each rank on one thread: threads_per_rank="
                                     f"{threads_per_rank} is refused; leave it unset or 1")
                threads_per_rank = 1
            self.threads_per_rank, self.threads_why = resolve_threads(p * pp * cp * dp, device, threads_per_rank)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        self.model_config, checkpoint = resolve_model(model, p, moe_parallel)
        self.config.check_model_len(self.model_config.max_seq_len)
        self.max_model_len = self.config.max_model_len or self.model_config.max_seq_len
        draft = None
        if spec_config is not None and spec_config.method == "draft_model":  # whole on every rank: checked at p = 1
            from serve.spec_decode import check_draft

            try:
                draft = resolve_model(spec_config.model, 1, "tp")
            except ValueError as exc:
                raise ValueError(f"speculative_config model: {exc}") from None
            check_draft(draft[0], self.model_config, spec_config.model)
        try:
            torch_dtype, _ = resolve_dtype(dtype, checkpoint)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        from layers.models.hf import checkpoint_eos

        self.eos_token_ids = checkpoint_eos(checkpoint, self.model_config.vocab_size)
        spec = RankSpec(self.model_config, checkpoint, torch_dtype, seed, backend, device, self.config,
                        tuple(self.eos_token_ids), moe_parallel, check, pp=pp, cp=cp, timeout_s=float(timeout_s),
                        draft=draft, threads=self.threads_per_rank)
        spec.validate(p * pp * cp, "pipeline_parallel_size", "context_parallel_size")
        self.dtype = str(torch_dtype).removeprefix("torch.")  # what the ranks run: "auto" resolved
        self.block_bytes = None  # one block's bytes on a rank, where kv_cache_memory_bytes sizes the pool
        if self.config.kv_cache_memory_bytes is not None:  # checked here, before any rank starts
            from serve.kv_cache import cache_layout_of, layout_block_bytes

            self.block_bytes = layout_block_bytes(self.model_config.n_layers, cache_layout_of(self.model_config, p),
                                                  self.config.block_size // cp, torch_dtype, self.config.kv_cache_dtype)
            self.config.pool_blocks(self.model_config.max_seq_len, None, self.block_bytes)
        if checkpoint is not None:
            from layers.models.checkpoint import Checkpoint
            from layers.models.hf import check_state

            try:
                check_state(self.model_config, Checkpoint(checkpoint), lm=True)  # headers only: no tensor is read
            except (ConfigError, OSError) as exc:
                raise ValueError(f"model={checkpoint}: {exc}") from None
        self.tokenizer = load_tokenizer(tokenizer or checkpoint)
        self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size = p, pp, cp
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stopped: set[str] = set()  # ended by a stop string here: the engine's later output is dropped
        self._count = 0
        self.last_stats: dict | None = None  # rank 0's stats() after the last step()
        self._prefix = f"generate-{secrets.token_hex(4)}-"  # generate()'s request ids: no clash with the caller's
        self.data_parallel_size, self.router_policy = dp, router_policy
        if dp == 1:
            self.executor = MultiprocExecutor(spec, p * pp * cp)
        else:
            from serve.replicas import Replicas
            from serve.router import Router

            self.executor = Replicas(spec, p * pp * cp, dp, Router(dp, router_policy, self.config.block_size),
                                     restarted=self._restarted)
        self.backend, self.device = self.executor.info["backend"], self.executor.info["device"]
        self.num_blocks = self.executor.info["num_blocks"]  # each rank's pool, as rank 0 sized it

    def settings_summary(self) -> str:
        """One line of what runs: the parallel sizes, the dtype, where, each rank's threads, and every engine setting
        that differs from its default (read off EngineConfig's fields, so a new setting is never left out)."""
        parts = [f"tensor_parallel_size={self.tensor_parallel_size}",
                 f"pipeline_parallel_size={self.pipeline_parallel_size}",
                 f"context_parallel_size={self.context_parallel_size}",
                 *([f"data_parallel_size={self.data_parallel_size} ({self.router_policy})"]
                   if self.data_parallel_size > 1 else []), f"dtype {self.dtype}",
                 f"{self.backend}, {self.device}",
                 f"{self.threads_per_rank} thread{'s' if self.threads_per_rank > 1 else ''} per rank "
                 f"({self.threads_why})"]
        default = EngineConfig()
        for f in dataclasses.fields(self.config):
            value = getattr(self.config, f.name)
            if value != getattr(default, f.name):
                if dataclasses.is_dataclass(value):  # speculative_config: its fields that are set
                    value = "{" + ", ".join(f"{g.name}={getattr(value, g.name)}" for g in dataclasses.fields(value)
                                            if getattr(value, g.name) is not None) + "}"
                parts.append(f"{f.name}={value}")
        return ", ".join(parts)

    def get_tokenizer(self):
        """The tokenizer text is encoded and decoded with here (transformers'), None where the model has none."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop every rank (harmless when called again)."""
        if self.executor is not None:
            self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- online: vLLM's LLMEngine calls --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, wait: bool = True,
                    priority: int = 0) -> None:
        """prompt: a string (needs a tokenizer), a list of token ids, or {"prompt_token_ids": [...]}/{"prompt": ...}.
        Checked here (ValueError); wait=False: sent without waiting for rank 0's answer (as under serve()), for
        callers whose request ids never repeat while running: rank 0 refusing it then fails the engine. priority:
        scheduling_policy "priority" only (lower first)."""
        _check_id(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        text, ids = self._encode(prompt)
        self._check(ids, params, priority)
        if wait:
            self.executor.call("add_request", request_id, ids, params, text, priority)
        else:
            self.executor.send("add_nowait", request_id, ids, params, text, priority)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)

    def abort_request(self, request_id: str, wait: bool = True) -> bool | None:
        """Aborted at the next step (its blocks freed before anything is scheduled); step() then returns it with
        finish_reason "abort" and the text of the tokens it had. False if no such request is running. wait=False:
        sent without waiting for the answer (None), as under serve()."""
        _check_id(request_id)
        if not wait:
            self.executor.send("abort_nowait", request_id)
            return None
        return self.executor.call("abort_request", request_id)

    def has_unfinished_requests(self) -> bool:
        return self.executor.call("has_unfinished_requests")

    def step(self) -> list[RequestOutput]:
        """One iteration on every rank; a RequestOutput for each request that got a token or finished."""
        outputs, self.last_stats = self.executor.call("step")
        return self._receive(outputs)

    # -- serving: rank 0 steps on its own ----------------------------------------------------------------------------

    def serve(self) -> None:
        """From now on rank 0 steps by itself whenever a request is unfinished, sending each step's outputs without
        waiting (a server's loop: its own work never delays a step). Then only add_request / abort_request with
        wait=False, serve_outputs() and shutdown() may be called."""
        self.executor.check("serve")
        self.executor.send("serve")

    def serve_outputs(self, timeout: float) -> list[RequestOutput] | None:
        """The next step's outputs as rank 0 sent them (rank 0's stats after it in last_stats), or None if none came
        within timeout seconds; RuntimeError (every rank stopped) if a rank has died. Text: detokenize(outputs)."""
        if not self.executor.poll("serve", timeout):
            return None
        outputs, self.last_stats = self.executor.wait("serve")[1]
        return outputs

    def _restarted(self, args: tuple) -> None:
        """A request moved off a dead replica runs again from its prompt: its text starts again too."""
        request_id, ids, params = args[:3]
        self._stopped.discard(request_id)
        if request_id in self._detok:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)

    def detokenize(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Text (and stop strings) for outputs taken from serve_outputs(), in the order they came."""
        return self._receive(outputs)

    def _receive(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Text for rank 0's outputs, and stop strings: a request whose text now holds one ends here ("stop") and is
        aborted in the engine (abort_nowait: no answer, so it can never be mistaken for the answer to a later call);
        the engine's own output for it later is dropped."""
        out = []
        for o in outputs:
            rid = o.request_id
            if rid in self._stopped:  # already ended here by a stop string
                if o.finished:
                    self._stopped.discard(rid)
                continue
            detok = self._detok.get(rid)
            if detok is not None:
                c = o.outputs[0]
                detok.add(c.token_ids[len(detok.ids):])
                if o.finished:
                    detok.finish()  # flushes held-back text, which may complete a stop string
                    del self._detok[rid]
                if detok.stopped_by is not None:
                    if not o.finished:  # ended here, before the engine would have ended it
                        self.executor.send("abort_nowait", rid)
                        self._stopped.add(rid)
                        o.finished, o.metrics.finished_time = True, time.time()
                        del self._detok[rid]
                    c.finish_reason, c.stop_reason = "stop", detok.stopped_by
                    c.token_ids = c.token_ids[:len(detok.ids)]
                c.text = detok.text
            out.append(o)
        return out

    def check_health(self) -> None:
        """RuntimeError (every rank stopped) if a rank has failed or died; nothing is sent to the ranks."""
        self.executor.check("check_health")

    def stats(self) -> dict:
        """Rank 0's view: num_blocks, free_blocks, running, waiting, iterations, preemptions, prefix-cache hit and
        queried tokens, collective bytes sent per rank so far, and the last iteration's record (its collectives,
        bytes per rank, and whether they equal the model's). After each step() the same dict is in last_stats."""
        self.last_stats = self.executor.call("stats")
        return self.last_stats

    # -- offline: generate --------------------------------------------------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token-id lists, or vLLM's {"prompt_token_ids": [...]}
        (one or a list). sampling_params: one for all, or one per prompt. priority: one per prompt, lower first
        (scheduling_policy "priority"). One RequestOutput per prompt, in order.
        Rank 0 steps until every request has ended (requests added online before are run to their end too; their
        outputs are not returned here), sending each step's outputs while it goes on with the next."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of strings, token-id lists or dicts (and not empty)")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise ValueError("prompts is one flat list of ints: pass a list of token-id lists ([[464, 3290]]) or "
                             "{'prompt_token_ids': [...]}")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        params = [SamplingParams() if q is None else q for q in params]
        priority = [0] * len(prompts) if priority is None else priority
        if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority={priority!r}: give one priority per prompt ({len(prompts)})")
        for q in params:
            if not isinstance(q, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, not {type(q).__name__}")
        encoded = [self._encode(pr) for pr in prompts]
        for (_, ids), q, rank in zip(encoded, params, priority):  # every prompt is checked before the first is added
            self._check(ids, q, rank)
        names = []
        try:
            for (text, ids), q, rank in zip(encoded, params, priority):
                names.append(f"{self._prefix}{self._count}")
                self._count += 1
                self.add_request(names[-1], {"prompt_token_ids": ids, "prompt": text}, q, priority=rank)
        except BaseException:
            if not self.executor.closed:  # (interrupted or failed: the ranks are stopped already)
                for name in names[:-1]:  # nothing half-added stays behind to run in a later call
                    self.executor.call("abort_request", name)
            raise
        done: dict[str, RequestOutput] = {}
        wanted = set(names)
        bar = _progress(len(names)) if use_tqdm else None
        self.executor.send("run")  # rank 0 steps until all have ended, sending each step's outputs as they come
        while (reply := self.executor.wait("generate"))[0] == "outputs":
            for o in self._receive(reply[1]):
                if o.finished and o.request_id in wanted:
                    done[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[n] for n in names]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation ([{"role": "user", "content": "..."}, ...]) or a list of them. Each is rendered
        with the checkpoint's chat template and the generation prompt (the plain "role: content" lines, then
        "assistant:", where it has none; serve/detokenizer.render_chat), encoded without adding special tokens (the
        template writes its own) and generated as generate() does: one RequestOutput per conversation, in order."""
        from serve.detokenizer import render_chat

        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: this model has none (a preset, or a directory without "
                             "tokenizer files); pass tokenizer=DIR")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            if not isinstance(conversation, (list, tuple)) or not conversation:
                raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
            text = render_chat(self.tokenizer, list(conversation))
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise FieldError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}",
                                 "prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FieldError("a text prompt needs a tokenizer: this model has none (a preset, or a directory "
                                 "without tokenizer files); pass token ids, or tokenizer=DIR", "prompt")
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        elif not isinstance(prompt, dict):
            ids = prompt
        if not isinstance(ids, (list, tuple)):
            raise FieldError(f"a prompt is a string, a list of token ids or a dict, not {type(ids).__name__}",
                             "prompt")
        return text, list(ids)

    def _check(self, ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        from serve.scheduler import check_request

        if params.stop and self.tokenizer is None:
            raise FieldError(f"stop={list(params.stop)}: stop strings need a tokenizer (this model has none)", "stop")
        if params.prompt_logprobs is not None and (self.pipeline_parallel_size > 1 or self.context_parallel_size > 1):
            raise FieldError("prompt_logprobs with pipeline_parallel_size or context_parallel_size above 1 is not "
                             "built: drop prompt_logprobs, or serve with tensor parallelism alone", "prompt_logprobs")
        check_request(self.config, self.model_config, self.num_blocks, self.block_bytes, ids, params, priority)


def _check_id(request_id) -> None:
    if not isinstance(request_id, str):
        raise ValueError(f"request_id={request_id!r} must be a string")


def has_tokenizer(model: str, tokenizer: str | None = None) -> bool:
    """Whether text prompts can be encoded for this model (a directory with tokenizer files, or tokenizer=DIR)."""
    source = tokenizer or model
    return Path(source).is_dir() and any((Path(source) / f).is_file() for f in TOKENIZER_FILES)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req")
