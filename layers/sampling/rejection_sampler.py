"""Speculative sampling's verifier under the vocab-parallel head: exact, and nothing gathered but a few numbers per row.

A verified row j of a request has the target's distribution p_j (its logits' slice on this rank, after the request's
temperature, min-p, top-k and top-p: `filtered_logprobs`), a proposal x_j drawn from the draft's q_j, and q_j on the
same slice (the draft's head is split over the vocabulary as the target's, so each rank holds q_j for its own ids).
The last row of a request has no proposal: its bonus token comes from p. Per row (Leviathan et al. 2023):

    accept     x_j with probability min(1, p_j(x_j) / q_j(x_j)): u_j < p_j(x_j) / q_j(x_j) with u_j ~ U(0, 1) keyed by
               (seed, position) on its own stream, the same on every rank; p_j(x_j), q_j(x_j) from the rank that holds
               x_j                                                            ★ all-reduce [S, 2]
    residual   a draw from normalize(max(0, p_j − q_j)) by the exponential race: the largest log r_i − log E_i over
               ids with r_i = max(0, p_j,i − q_j,i) > 0 (no normaliser needed); E keyed by (seed, position, id) as the
               sampler's noise, so a bonus row (r = p) draws the very token plain sampling would
                                                                              ★ all-gather of (value, id) [S, 2p]
    host       a request takes x_1..x_n while accepted, then the residual's token of row n (the bonus row's if all
               k were accepted): `verify`

Greedy rows are the same formulas with p and q point masses (accept iff x is the target's argmax; the residual is
the argmax). Every row is computed at once (no loop over rows or requests); what a row moves per rank is 3 float64
numbers in the accept all-reduce (p(x), q(x) and the target's logit of x) and 3p in the all-gather (the race's value,
id and logit), plus filtered_logprobs' candidates and normaliser, against (p − 1)/p · V' · 4 bytes to all-gather the
float32 logits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from einops import rearrange

from layers.sampling.sampler import SamplingBatch, apply_filters, gumbel_noise, shift_right, splitmix64
from tp.comm import gather_from_region, reduce_from_region

ACCEPT_STREAM = 0x5DEECE66D  # the accept uniforms' key is (seed ^ this, position): a stream apart from the race's
DRAFT_STREAM = 0x2545F4914F6CDD1D  # the draft's own sampling noise: seeds ^ this (independent of the target's)


def filtered_logprobs(local: torch.Tensor, start: int, group: dist.ProcessGroup | None,
                      batch: SamplingBatch) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """log of the distribution the sampler draws from, on this rank's ids: softmax(z/T) restricted to the ids every
    filter keeps and renormalised; -inf elsewhere (padding, filtered); greedy rows: 0 at the argmax, -inf elsewhere.
    [S, V'/p] float64. The kept ids are a prefix of the vocabulary sorted by (z desc, id asc), so a row's cut is one
    (z, id) pair: the sampler's candidates find it, and ★ one all-reduce [S] gives the kept ids' normaliser. Also
    what the traffic model needs: the candidates gathered per round, and whether the normalisers were all-reduced."""
    S, n = local.shape
    dev = local.device
    ids = torch.arange(start, start + n, device=dev)
    need = max(batch.candidates, 1)  # at least the global max (and argmax) of every row
    batch = dataclasses.replace(batch, candidates=need)
    cut = apply_filters(local, ids, group, batch)
    z = local.double()
    s = z / cut.T
    m = cut.m / cut.T
    kept = torch.isfinite(z) & (s >= m + cut.log_min_p)  # min-p (every open row's only filter)
    closed = cut.closed[:, None]
    last = cut.kept.sum(-1, keepdim=True).clamp(min=1) - 1  # the kept prefix's last candidate
    z_cut, id_cut = cut.top_z.gather(1, last), cut.top_id.gather(1, last)
    in_prefix = (z > z_cut) | ((z == z_cut) & (ids[None, :] <= id_cut))
    kept = torch.where(closed, kept & in_prefix, kept)
    kept = torch.where(cut.greedy[:, None], ids[None, :] == cut.top_id[:, :1], kept)
    total = torch.where(kept, torch.exp(s - m), 0).sum(-1)
    if group is not None:
        total = reduce_from_region(total, group, "head/kept normaliser all-reduce")  # ★ [S]
    return torch.where(kept, s - m - torch.log(total)[:, None], float("-inf")), tuple(cut.rounds), batch.normalisers


def accept_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """u ~ U(0, 1) per row, counter-based on (seed, position): the same on every rank, independent of the race."""
    bits = splitmix64(splitmix64(seed ^ ACCEPT_STREAM) + (position + 1) * -7046029254386353131)
    return (shift_right(bits, 11).double() + 0.5) / 2.0 ** 53


def rejection_sample(p_logp: torch.Tensor, q_logp: torch.Tensor, proposal: torch.Tensor, local: torch.Tensor,
                     start: int, group: dist.ProcessGroup | None, batch: SamplingBatch
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p_logp, q_logp: [S, V'/p] filtered log-probs on this rank's ids (filtered_logprobs of the target's and the
    draft's logits; q ignored on rows without a proposal); proposal [S] int64, -1 on a request's bonus row; local:
    the target's logits on this slice; batch: the rows' sampling parameters (seed, position = the output position
    the row's token takes). Returns, the same on every rank: accepted [S] bool (the row's proposal is accepted),
    token [S] int64 (the proposal where accepted; else the residual's draw, or the bonus row's from p) and its
    logit [S] float64 (the target's z of that token: the oracle's near-tie rule reads it)."""
    S, n = p_logp.shape
    dev = p_logp.device
    ids = torch.arange(start, start + n, device=dev)
    has = proposal >= 0
    here = has & (proposal >= start) & (proposal < start + n)
    at = (proposal - start).clamp(0, n - 1)[:, None]
    z = local.double()
    held = torch.stack([p_logp.gather(1, at)[:, 0].exp(), q_logp.gather(1, at)[:, 0].exp(), z.gather(1, at)[:, 0]],
                       dim=-1)
    pqz = torch.where(here[:, None], held, 0)  # [S, 3]: p(x), q(x), z(x) from the rank that holds x
    if group is not None:
        pqz = reduce_from_region(pqz, group, "head/accept all-reduce")  # ★ [S, 3]
    u = accept_uniform(batch.seed, batch.position)
    accepted = has & (u * pqz[:, 1] < pqz[:, 0])  # u < min(1, p/q)
    p = p_logp.exp()
    r = torch.where(has[:, None], (p - q_logp.exp()).clamp(min=0), p)  # the residual; the bonus row: p itself
    race = torch.where(r > 0, torch.log(r) + gumbel_noise(batch.seed, batch.position, ids), float("-inf"))
    best = race.argmax(dim=-1, keepdim=True)  # the lowest id among equals
    triple = torch.cat([race.gather(1, best), (best + start).double(), z.gather(1, best)], dim=-1)  # [S, 3]
    if group is not None:
        triple = gather_from_region(triple, group, "head/residual all-gather")  # ★ [S, 3p]
    values, won, logit = rearrange(triple, "s (p three) -> three s p", three=3)
    winner = values.argmax(dim=-1, keepdim=True)  # ties: the lowest rank, so the lowest id
    token = torch.where(accepted, proposal, won.gather(1, winner)[:, 0].long())
    return accepted, token, torch.where(accepted, pqz[:, 2], logit.gather(1, winner)[:, 0])


def verify(accepted: list[bool], tokens: list[int]) -> list[int]:
    """Host, one request: its rows' verdicts and tokens (k + 1 rows, the last without a proposal) -> the tokens it
    gets: the accepted proposals while they last, then the first row's that was not accepted."""
    n = 0
    while n < len(tokens) - 1 and accepted[n]:
        n += 1
    return list(tokens[:n + 1])
