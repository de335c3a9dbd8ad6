"""Prompt logprobs under the vocab-parallel head (vLLM's SamplingParams.prompt_logprobs): for each scored row, the
log-probability of a given id (the prompt's next token) and the top n, without gathering the logits.

Each rank holds the row's logits on its slice of the vocabulary [R, V'/p]. It packs, per row:

    m, s        its slice's max and sum exp(z - m) (the log-softmax normaliser's part)
    z_t         the given id's logit if the id is on this slice, else -inf
    top n       its slice's n largest logits and their ids

and one all-gather of [R, 3 + 2n] float64 per rank gives every rank every slice's pack (★). Then, the same on
every rank: log Z = M + log sum_r s_r exp(m_r - M) with M = max_r m_r; the given id's logprob z_t - log Z; the top n
of the p·n candidates (ties to the lower id, as the sampler's logprobs). What a row moves: (3 + 2n)·8 bytes per
rank, against (p - 1)/p · V' · 4 to all-gather the float32 logits (tp/traffic_model.predict_prompt_logprobs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp.comm import gather_from_region


def score_rows(local: torch.Tensor, start: int, group: dist.ProcessGroup | None, targets: torch.Tensor, n: int,
               vocab_size: int) -> torch.Tensor:
    """local: [R, V'/p] this rank's logits of the scored rows (its ids start..start + V'/p; ids >= vocab_size are
    padding); targets: [R] the id each row scores. Returns [R, 1 + 2n] float64: the target's logprob, then the top n
    ids and their logprobs (by logprob, descending; ties to the lower id)."""
    rows, width = local.shape
    z = local.double()
    ids = torch.arange(start, start + width, device=z.device)
    z = z.masked_fill(ids >= vocab_size, float("-inf"))
    m = z.max(dim=-1).values
    s = torch.exp(z - m[:, None]).sum(dim=-1)
    at = targets - start
    holds = (at >= 0) & (at < width)
    z_t = torch.where(holds, z.gather(1, at.clamp(0, width - 1)[:, None])[:, 0], torch.full_like(m, float("-inf")))
    k = min(n, width)
    top_z, top_at = z.topk(k, dim=-1) if k else (z[:, :0], ids[None, :0].expand(rows, 0))
    top_id = (top_at + start).double() if k else top_z
    if k < n:  # a slice narrower than n: -inf candidates that never win
        pad = torch.full((rows, n - k), float("-inf"), dtype=torch.float64, device=z.device)
        top_z, top_id = torch.cat([top_z, pad], 1), torch.cat([top_id, pad.clone().fill_(-1.0)], 1)
    pack = torch.cat([m[:, None], s[:, None], z_t[:, None], top_z, top_id], dim=1)  # [R, 3 + 2n]
    p = 1 if group is None else dist.get_world_size(group)
    if p > 1:
        pack = gather_from_region(pack, group, "head/prompt logprobs all-gather")  # ★ [R, p(3 + 2n)]
    pack = pack.view(rows, p, 3 + 2 * n)
    m_r, s_r, z_r = pack[..., 0], pack[..., 1], pack[..., 2]
    big = m_r.max(dim=1).values
    log_z = big + torch.log((s_r * torch.exp(m_r - big[:, None])).sum(dim=1))
    out = [(z_r.max(dim=1).values - log_z)[:, None]]
    if n:
        cand_z = pack[..., 3:3 + n].reshape(rows, p * n)
        cand_id = pack[..., 3 + n:].reshape(rows, p * n)
        by_id = cand_id.masked_fill(cand_id < 0, float("inf")).argsort(dim=1, stable=True)  # ties: the lower id
        cand_z, cand_id = cand_z.gather(1, by_id), cand_id.gather(1, by_id)
        order = cand_z.argsort(dim=1, descending=True, stable=True)[:, :n]
        out += [cand_id.gather(1, order), cand_z.gather(1, order) - log_z[:, None]]
    return torch.cat(out, dim=1)


def host_prompt_logprobs(row: list[float], target: int, n: int) -> dict[int, float]:
    """A host row of score_rows: {id: logprob} for the scored id and the top n (vLLM's prompt_logprobs entry)."""
    width = (len(row) - 1) // 2
    entry = {int(t): lp for t, lp in zip(row[1:1 + width][:n], row[1 + width:1 + 2 * width][:n])}
    entry[target] = row[0]
    return entry
