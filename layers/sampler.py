"""Sampling under the vocab-parallel head: temperature, min-p, top-k, top-p and per-request seeds, exact and the
same at every tensor-parallel size, without gathering the logits.

Rank r holds the logits z of ids [start, start + V'/p) of the padded vocabulary (padding ids are -inf). Per sampled
row, with temperature T > 0 and s = z / T (greedy rows, T = 0: s = z, no filter, no noise):

    candidates  each rank's top-c (z, id) pairs, sorted (z desc, id asc)     ★ all-gather [S, 2c] -> [S, 2cp]
                merged: the first c are exactly the global top c, so m = max z, the top-k cut and the top-N
                logprobs are known everywhere
    min-p       keep s_i >= m/T + log(min_p)                                 (vLLM's order: min-p, top-k, top-p)
    top-k       keep the k largest, ties to the lower id: (z, -id) >= the k-th candidate's
    top-p       keep the smallest prefix (z desc, id asc) of the survivors whose mass reaches top_p: the id j is
                kept iff the survivors' mass before it is < top_p. The mass needs the survivors' normaliser
                Z_K = sum exp(s_i - m/T)                                      ★ all-reduce [S, 2] (with logprobs'
                Z = sum exp(z_i - m)); the cut is inside the merged candidates when their kept mass reaches top_p,
                else c doubles and the candidates are gathered again (exact, rare)
    race        E_i ~ Exp(1) for every id from a counter-based hash of (seed, position, id): each rank draws its own
                ids only, the same numbers at any p; the kept id with the largest s_i - log E_i (Gumbel-max) is a
                sample of softmax(s) restricted to the kept ids; each rank's winner (value, id, z)
                                                                              ★ all-gather [S, 3] -> [S, 3p]
                and the largest value wins (ties to the lower rank, so the lower id)

A batch of greedy rows only takes today's path (★ all-gather of (max z, id) [S, 2]), bit for bit. With sampled
rows the greedy ones ride along (s = z, no noise: the same argmax). Logprobs are log softmax(z) (the raw logits,
as vLLM returns by default): z_i - m - log Z. Everything after the matmul is float64.

Bytes per sampled row per rank (ring model, float64): all-gathering the logits would be (p-1)/p * V' * 4 bytes in
float32; here the race is (p-1)/p * 3p * 8, the candidates (p-1)/p * 2cp * 8, the normalisers 2 * (p-1)/p * 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange

from tp.comm import gather_from_region, reduce_from_region

TOP_P_CANDIDATES = 32  # candidates per rank gathered for top-p at first; doubled until the cut is inside them
_M1, _M2, _GOLDEN = -4658895280553007687, -7723592293110705685, -7046029254386353131  # splitmix64's constants


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling parameters, built once on the host (identical on every rank) and moved once.

    temperature [S] (0: greedy), top_k [S] (0: off), top_p [S] (1: off), min_p [S] (0: off): float64 / int64;
    seed [S] int64 (the request's seed); position [S] int64 (which output token of the request this is);
    logprobs: the most top-N logprobs any row asks (-1: no row asks for logprobs; 0: the chosen token's only)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    logprobs: int
    any_random: bool
    any_top_p: bool
    candidates: int  # c: the top-k and logprobs' needs (top-p's start is added in sample())

    @classmethod
    def build(cls, rows: list[tuple[float, int, float, float, int, int]], logprobs: int, device) -> "SamplingBatch":
        """rows: (temperature, top_k, top_p, min_p, seed, position) per sampled row."""
        t, k, tp, mp, seed, pos = zip(*rows) if rows else ((),) * 6
        any_random = any(x > 0 for x in t)
        need = max([kk for kk, tt in zip(k, t) if tt > 0 and kk > 0] + [max(logprobs, 1) if logprobs >= 0 else 0]
                   + [1 for mm, tt in zip(mp, t) if tt > 0 and mm > 0], default=0)
        f64 = dict(dtype=torch.float64, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.tensor(t, **f64), torch.tensor([max(x, 0) for x in k], **i64), torch.tensor(tp, **f64),
                   torch.tensor(mp, **f64), torch.tensor(seed, **i64), torch.tensor(pos, **i64), logprobs, any_random,
                   any(x < 1 and tt > 0 for x, tt in zip(tp, t)), need)

    @property
    def greedy_only(self) -> bool:
        return not self.any_random and self.logprobs < 0

    @property
    def normalisers(self) -> bool:
        """Whether sample() all-reduces the normalisers (top-p or logprobs need them)."""
        return self.any_top_p or self.logprobs >= 0


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [S] int64
    logits: torch.Tensor  # [S] float64: z of the chosen id
    logprob: torch.Tensor | None = None  # [S] float64: log softmax(z) of the chosen id
    top_ids: torch.Tensor | None = None  # [S, N] int64, by logprob (desc), ties to the lower id
    top_logprobs: torch.Tensor | None = None  # [S, N] float64
    rounds: tuple[int, ...] = ()  # candidates gathered per rank, per round (the traffic model reads them)
    margin: torch.Tensor | None = None  # [S]: the winner's lead over the runner-up in the race (single device only)


def nothing_sampled() -> SampleResult:
    """An iteration whose rows are all prompt chunks that do not finish their prompt."""
    return SampleResult(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64))


# ---- the noise: a function of (seed, position, id) alone -----------------------------------------------------------


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): a bijection that scatters every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def request_seed(engine_seed: int, request_id: int) -> int:
    """A request without a seed of its own: one drawn from the engine's seed and its id (a run is reproducible)."""
    x = torch.tensor([engine_seed * 1_000_003 + request_id], dtype=torch.int64)
    return int(_mix(_mix(x) + _GOLDEN)[0] & ((1 << 53) - 1))


def exponential_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """E ~ Exp(1) for every (row, id): seed, position [S], ids [n] -> [S, n] float64. Counter-based: each rank draws
    its own ids and gets the numbers a single device would."""
    row = _mix(_mix(seed + _GOLDEN) + position * _GOLDEN)  # [S]
    bits = _mix(row[:, None] + (ids[None, :] + 1) * _GOLDEN)  # [S, n]
    u = (_shr(bits, 11).double() + 0.5) / 2.0 ** 53  # (0, 1), 53 random bits
    return -torch.log(u)


# ---- the sampler ------------------------------------------------------------------------------------------------------


def greedy_pick(local: torch.Tensor, start: int, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """local [S, V'/p] (padding -inf) -> (ids [S], their logits [S] float64), the same on every rank: each rank's
    (max, argmax); ★ one all-gather of the pairs [S, 2] -> [S, 2p]; the largest wins, ties to the lowest rank and so
    to the lowest id, exactly as torch.argmax over the full row."""
    best = local.argmax(dim=-1)  # first maximum: the lowest id within the slice
    pairs = torch.stack([local.gather(1, best[:, None])[:, 0].double(), (best + start).double()], dim=-1)  # [S, 2]
    if group is not None:
        pairs = gather_from_region(pairs, group, "head/argmax all-gather")  # ★ all-gather: [S, 2p]
    values, ids = rearrange(pairs, "s (p two) -> two s p", two=2)
    winner = values.argmax(dim=-1, keepdim=True)  # first maximum: the lowest rank, so the lowest id
    return ids.gather(1, winner)[:, 0].long(), values.gather(1, winner)[:, 0]


def _candidates(z: torch.Tensor, ids: torch.Tensor, c: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-c (z, id) of each row, sorted (z desc, id asc): [S, c] each; when c is every id a rank holds
    (c = V'/p), all p·c of them (the whole vocabulary, exact whatever is asked of it). ★ all-gather of every rank's
    top-c pairs [S, 2c] -> [S, 2cp]."""
    n = z.shape[1]
    top, where = z.topk(c, dim=-1)  # [S, c], sorted desc
    pairs = rearrange(torch.stack([top, ids[where].double()], dim=-1), "s c two -> s (c two)")
    if group is not None:
        pairs = gather_from_region(pairs, group, "head/candidates all-gather")  # ★ all-gather: [S, 2cp]
    values, cand = rearrange(pairs, "s (pc two) -> two s pc", two=2)
    order = torch.argsort(cand, dim=-1, stable=True)  # id asc, then z desc (stable): ties to the lower id
    values, cand = values.gather(1, order), cand.gather(1, order)
    order = torch.argsort(values, dim=-1, descending=True, stable=True)
    certain = values.shape[1] if c >= n else c  # the first c of the merged lists are the global top c
    return values.gather(1, order)[:, :certain], cand.gather(1, order)[:, :certain]


def _at_least(z, ids, cut_z, cut_id):
    """(z, -id) >= (cut_z, -cut_id), row-wise: the ids ranked at or above the cut."""
    return (z > cut_z[:, None]) | ((z == cut_z[:, None]) & (ids[None, :] <= cut_id[:, None]))


def sample(local: torch.Tensor, start: int, group: dist.ProcessGroup | None, batch: SamplingBatch | None,
           vocab_size: int) -> SampleResult:
    """local: this rank's logits [S, V'/p] (padding ids -inf); start: its first id; group: the vocab-parallel group
    (None: the whole vocabulary is here). One batched pass, no loop over rows."""
    if batch is None or batch.greedy_only:
        return SampleResult(*greedy_pick(local, start, group))
    z = local.double()  # [S, n]
    S, n = z.shape
    ids = torch.arange(start, start + n, device=z.device)
    p = 1 if group is None else dist.get_world_size(group)
    greedy = batch.temperature == 0
    T = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)[:, None]
    s = z / T
    keep = torch.isfinite(z)
    rounds: list[int] = []
    c = max(batch.candidates, TOP_P_CANDIDATES if batch.any_top_p else 0)
    top_z = top_id = None
    if c:
        c = min(c, n)
        top_z, top_id = _candidates(z, ids, c, group)
        rounds.append(c)
        m = top_z[:, :1]  # the global max of z
        certain = top_z.shape[1]
        sampled = ~greedy[:, None]
        # min-p on s: s_i >= m/T + log(min_p) (min_p 0: log 0 = -inf keeps all)
        keep &= ~sampled | (s >= m / T + torch.log(batch.min_p)[:, None])
        # top-k: at or above the k-th candidate
        k = batch.top_k.clamp(max=certain)
        on = (batch.top_k > 0) & ~greedy
        kth = (k - 1).clamp(min=0)[:, None]
        cut = _at_least(z, ids, top_z.gather(1, kth)[:, 0], top_id.gather(1, kth)[:, 0])
        keep &= ~on[:, None] | cut
    if batch.normalisers:
        # ★ all-reduce of each row's normalisers: the survivors' Z_K on s, and (logprobs) the full Z on z
        sums = torch.stack([torch.where(keep, torch.exp(s - m / T), 0).sum(-1),
                            torch.where(torch.isfinite(z), torch.exp(z - m), 0).sum(-1)], dim=-1)  # [S, 2]
        if group is not None:
            sums = reduce_from_region(sums, group, "head/normaliser all-reduce")
        z_kept, z_full = sums[:, 0], sums[:, 1]
    if batch.any_top_p:
        on = (batch.top_p < 1) & ~greedy
        while True:
            cand_kept = _kept_candidates(top_z, T, m, batch, greedy)  # [S, certain]: survivors of min-p, top-k
            mass = torch.where(cand_kept, torch.exp(top_z / T - m / T), 0) / z_kept[:, None]
            before = mass.cumsum(-1) - mass  # the survivors' mass ranked before each candidate
            inside = (mass.sum(-1) >= batch.top_p) | (c >= n)  # the cut is among the candidates (or all ids are)
            if bool((inside | ~on).all()):
                break
            c = min(2 * c, n)  # rare: the cut lies past every rank's candidates; gather more
            top_z, top_id = _candidates(z, ids, c, group)
            rounds.append(c)
        order = torch.arange(top_z.shape[1], device=z.device)
        last = torch.where(cand_kept & (before < batch.top_p[:, None]), order, -1).amax(-1)
        last = last.clamp(min=0)[:, None]
        cut = _at_least(z, ids, top_z.gather(1, last)[:, 0], top_id.gather(1, last)[:, 0])
        keep &= ~(on & inside)[:, None] | cut
    noise = exponential_noise(batch.seed, batch.position, ids)  # [S, n]
    race = torch.where(greedy[:, None], z, s - torch.log(noise))
    race = torch.where(keep, race, float("-inf"))
    best = race.argmax(dim=-1)  # first maximum: the lowest id within the slice
    triple = torch.stack([race.gather(1, best[:, None])[:, 0], (best + start).double(),
                          z.gather(1, best[:, None])[:, 0]], dim=-1)  # [S, 3]
    if group is not None:
        triple = gather_from_region(triple, group, "head/sample all-gather")  # ★ all-gather: [S, 3p]
    values, won, logit = rearrange(triple, "s (p three) -> three s p", three=3)
    winner = values.argmax(dim=-1, keepdim=True)  # the largest, ties to the lowest rank
    out = SampleResult(won.gather(1, winner)[:, 0].long(), logit.gather(1, winner)[:, 0], rounds=tuple(rounds))
    if group is None and n > 1:  # an oracle's near-tie rule: how close the race was
        two = race.topk(2, dim=-1).values
        out.margin = two[:, 0] - two[:, 1]
    if batch.logprobs >= 0:
        log_z = m[:, 0] + torch.log(z_full)
        out.logprob = out.logits - log_z
        out.top_ids = top_id[:, :batch.logprobs].long()
        out.top_logprobs = top_z[:, :batch.logprobs] - log_z[:, None]
    return out


def _kept_candidates(top_z, T, m, batch: SamplingBatch, greedy) -> torch.Tensor:
    """Which of the merged candidates survive min-p and top-k (the same rules as on each rank's own ids)."""
    kept = torch.isfinite(top_z) & (top_z / T >= m / T + torch.log(batch.min_p)[:, None])
    width = top_z.shape[1]
    k = torch.where((batch.top_k > 0) & ~greedy, batch.top_k, width + 1)
    return kept & (torch.arange(width, device=top_z.device)[None, :] < k[:, None])
