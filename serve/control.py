"""What the ranks of one engine tell each other besides the model's collectives: rank 0's control message, and the
agreement checks.

    control   ★ rank 0 broadcasts what arrived and what was aborted since the last step: a header of
              CONTROL_HEADER float64 numbers (new requests, aborts, payload length, flag, proposals), then the
              payload when there is one. flag: RUN a step | IDLE (a keep-alive, no step) | STOP (leave the loop);
              proposals: how many tokens speculative decoding proposes per request this step (rank 0's Tuner)
    agree     ★ one all-gather of FINGERPRINT_SIZE numbers (a plan's, a workload's); a rank that differs raises on
              every rank, before a forward could issue collectives of different sizes

Both are CPU tensors over the group's gloo backend (under NCCL too: tp/dist.py), so they never wait for a GPU, and
both go into the step's ledger, which the model predicts (tp/traffic_model.py: predict_control, the plan check).
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from serve.config import EngineConfig

from serve.plan import FINGERPRINT_SIZE
from serve.request import Request
from serve.sampling_params import GREEDY, SamplingParams
from tp.comm import broadcast_from_main, gather_from_region
from tp.dist import TPContext, control_device, host_control

CONTROL_HEADER = 5  # (new requests, aborted requests, payload length, flag, proposals), float64
REQUEST_FIELDS = 17  # per new request, before its stop ids, prompt and output: see encode
RUN, IDLE, STOP = 0, 1, 2  # the header's flag: run a step | rank 0 is idle (keep-alive, no step) | end the loop


class PlanMismatch(RuntimeError):
    """Ranks scheduled different rows: their collectives would no longer describe the same tensors."""


def broadcast_control(ctx: TPContext, flag: int, new: list[Request], aborts: list[int], proposals: int = 0
                      ) -> tuple[int, list[Request], list[int], int, int]:
    """★ rank 0's control message to every rank of ctx.group: every rank returns (flag, new requests, aborted ids,
    payload length, proposals); rank 0 passes what it has, the others empty lists. A group of one rank sends
    nothing."""
    if ctx.world_size == 1:
        return flag, new, aborts, 0, proposals
    device = control_device(ctx.group)
    payload = encode(new, aborts)  # rank 0's (the others' is empty: rank 0's header tells them its length)
    length = len(payload)
    with host_control():  # CPU tensors over the group's gloo backend: no wait for the GPU
        header = torch.tensor([len(new), len(aborts), length, flag, proposals], dtype=torch.float64, device=device)
        header = broadcast_from_main(header, ctx.group, "engine/control header")
        if not ctx.is_main:
            n_new, n_abort, length, flag, proposals = (int(v) for v in header.tolist())
        if length:
            body = torch.tensor(payload, dtype=torch.float64, device=device) if ctx.is_main else \
                torch.zeros(length, dtype=torch.float64, device=device)
            body = broadcast_from_main(body, ctx.group, "engine/control payload")
            if not ctx.is_main:
                new, aborts = decode(body.tolist(), n_new, n_abort)
    return flag, new, aborts, length, proposals


def encode(new: list[Request], aborts: list[int]) -> list[float]:
    """Each new request: REQUEST_FIELDS numbers (its seed is the one it samples with: every rank draws the same
    noise), its stop ids, its prompt, the tokens it already has; then the aborted ids. float64 holds ids and seeds
    below 2**53 exactly (SamplingParams refuses larger seeds, request_seed draws below 2**53)."""
    out: list[float] = []
    for r in new:
        q = r.params or GREEDY
        out += [r.id, r.arrival, r.max_new_tokens, len(r.prompt), len(r.stop_ids), len(r.output),
                r.num_computed_tokens, r.params is not None, q.temperature, q.top_k, q.top_p, q.min_p,
                q.seed is not None, r.sampling_seed or 0, -1 if q.logprobs is None else q.logprobs, r.priority,
                -1 if q.prompt_logprobs is None else q.prompt_logprobs]
        out += sorted(r.stop_ids) + r.prompt + r.output
    return out + aborts


def decode(payload: list[float], n_new: int, n_abort: int) -> tuple[list[Request], list[int]]:
    """encode's inverse: the new requests and the aborted ids."""
    values = iter(payload)

    def ints(n: float) -> list[int]:  # the next n numbers, as integers
        return [int(next(values)) for _ in range(int(n))]

    new = []
    for _ in range(n_new):
        (rid, arrival, max_tokens, n_prompt, n_stop, n_output, computed, has_params, temp, top_k, top_p, min_p,
         has_seed, seed, logprobs, priority, prompt_logprobs) = (next(values) for _ in range(REQUEST_FIELDS))
        stop, prompt, output = frozenset(ints(n_stop)), ints(n_prompt), ints(n_output)
        params = SamplingParams(int(max_tokens), temp, int(top_k), top_p, min_p, int(seed) if has_seed else None,
                                logprobs=None if logprobs < 0 else int(logprobs),
                                prompt_logprobs=None if prompt_logprobs < 0 else int(prompt_logprobs)) \
            if has_params else None
        new.append(Request(int(rid), prompt, int(max_tokens), int(arrival), output, int(computed), stop_ids=stop,
                           params=params, sampling_seed=None if params is None else int(seed), priority=int(priority)))
    return new, ints(n_abort)


def agree(ctx: TPContext, fingerprint, what: str, error: type[Exception] = PlanMismatch) -> None:
    """★ Every rank's FINGERPRINT_SIZE numbers (or a function giving them) against every other's (one all-gather, host control); `error` on every
    rank, naming `what`, when any differ. The one rank agreement of the engines (the plan of each step, a workload's
    requests and settings). A group of one rank agrees with itself."""
    if ctx.world_size == 1:
        return
    fingerprint = fingerprint() if callable(fingerprint) else fingerprint  # a plan's, computed only when sent
    assert len(fingerprint) == FINGERPRINT_SIZE, fingerprint
    with host_control():
        mine = torch.tensor([fingerprint], dtype=torch.float64, device=control_device(ctx.group))
        every = gather_from_region(mine, ctx.group, "engine/plan check").view(-1, FINGERPRINT_SIZE).tolist()
    if any(row != every[0] for row in every):
        raise error(f"{what} (fingerprints {every})")


def digest(rows: list[tuple]) -> list[float]:
    """FINGERPRINT_SIZE numbers from rows of integers (a workload's requests, settings): the count, and three
    position-weighted sums that differ, with overwhelming likelihood, when any value or order differs."""
    flat = [float(v) for row in rows for v in row]
    return [float(len(rows)), sum((i + 1) * v for i, v in enumerate(flat)),
            sum((i + 1) * (j + 1) * float(v) for i, row in enumerate(rows) for j, v in enumerate(row)),
            sum(((i % 7) + 1) * v * v for i, v in enumerate(flat))]


def request_rows(requests: list[Request]) -> list[tuple]:
    """What every rank must hold the same of a workload's requests (for digest)."""
    return [(r.id, len(r.prompt), sum(r.prompt), r.max_new_tokens, r.arrival, r.num_computed_tokens,
             sum((i + 1) * t for i, t in enumerate(sorted(r.stop_ids))), r.priority) for r in requests]


def settings_row(config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> tuple:
    """The engine settings and stop ids every rank must hold the same, as numbers (for digest): a number as itself,
    None as -1, anything else (a name, speculative_config) by a checksum of its repr, so a new field of any type is
    compared too."""
    values = [-1 if v is None else int(v) if isinstance(v, (bool, int)) else v if isinstance(v, float)
              else zlib.crc32(repr(v).encode()) for v in (getattr(config, f.name) for f in dataclasses.fields(config))]
    return (*values, sum((i + 1) * (t + 1) for i, t in enumerate(sorted(eos_token_ids))))
