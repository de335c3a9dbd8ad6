"""The draft model of speculative decoding (docs/spec_decode.md, "A draft model"): a smaller LM with the target's
vocabulary, whole on every rank (tensor-parallel size 1 over a group of one: its forwards issue no collective), with
its own paged KV pool of the target's blocks, read through the target's block tables.

Per step, for the scheduled requests (serve/spec_decode.py has the step's order):

    forward 1   for each request verifying k >= 1 proposals, its rows the draft has not computed: its last token
                (two rows after a step that accepted all K: the last proposal and the bonus token), or all its
                tokens since the draft last ran for it (its prompt the first time: a request's chunks without
                proposals, prompt chunks and steps where the Tuner chose k = 0, skip the draft, so speculation
                turned off costs nothing); samples x_1 from the draft's last row
    forward j   (j = 2..K) one row per request still proposing: x_{j-1} at its position; samples x_j

Each proposal is sampled with the request's filters. Under shared noise (the default) it is drawn with the noise of
the target's row that verifies it, and the plain sampler verifies (its tokens are plain sampling's); under the
rejection sampler it is drawn from a noise stream of its own (the seed ^ DRAFT_STREAM), and q_j, the filtered
distribution it was drawn from, goes to the verifier on this rank's ids of the target's split.
`Request.draft_computed` counts the positions whose K,V the draft holds for the request's blocks: it reads only what
it wrote itself (from position 0 for a new request, prefix hits or not; from 0 again after a preemption, when the
blocks may come back as another request's), so the prefix cache names blocks without waiting for it.
"""

from __future__ import annotations

import dataclasses

import torch

from layers.parallel.weight_format import model_dtype
from layers.sampling.rejection_sampler import DRAFT_STREAM, filtered_logprobs, verify
from layers.sampling.sampler import SamplingBatch, sample
from serve.kv_cache import KVPool
from serve.model_runner import prepare_step, sampling_rows
from serve.plan import ScheduledRequest, SchedulerOutput
from serve.request import Request
from serve.spec_decode import Proposer, SpeculativeConfig, accept


class DraftRunner(Proposer):
    """The draft model as speculative decoding's Proposer: k placeholders per decoding request before planning (the
    scheduler gives their rows), filled by the draft's forwards once the plan is made (propose), verified by the
    rejection sampler (its verdict rides in each row of the table: accept)."""

    def __init__(self, config: SpeculativeConfig, lm, num_blocks: int, block_size: int, attention: str, device,
                 vocab_slice: tuple[int, int]):
        """lm: the draft's TPLM (or TPLlamaLM) over a group of one rank; vocab_slice: (start, n) of the target's
        vocabulary split on this rank (q is kept on those ids)."""
        super().__init__(config)
        self.lm, self.block_size, self.attention, self.device = lm, block_size, attention, device
        self.start, self.n = vocab_slice
        self.cache = KVPool.for_model(lm, num_blocks, block_size, model_dtype(lm), device)
        # shared_noise: the draft races with the target's noise and the plain sampler verifies (no q); else the
        # rejection sampler with q, the draft drawing from a stream of its own
        self.shared_noise = config.draft_acceptance == "shared_noise"

    def proposals(self, r: Request, k: int) -> list[int]:
        return [-1] * k  # placeholders: the draft fills them once the plan is made

    def fill(self, plan: SchedulerOutput, requests: dict[int, Request]) -> SchedulerOutput:
        """The draft's forwards (no collective: it is whole on every rank), before the ranks agree on the plan."""
        plan, *verify = self.propose(plan, requests)
        self.verify = verify if any(c.spec for c in plan.scheduled) and not self.shared_noise else None
        return plan

    def accept(self, rows: list[list[float]], spec: tuple[int, ...]) -> list[int]:
        if self.shared_noise:  # the rows are plain sampling's tokens: proposals stand while they equal them
            return accept([int(row[0]) for row in rows], spec)
        return verify([bool(row[-1]) for row in rows], [int(row[0]) for row in rows])  # the verdict: the last column

    @torch.no_grad()
    def propose(self, plan: SchedulerOutput, requests: dict[int, Request]
                ) -> tuple[SchedulerOutput, torch.Tensor | None, torch.Tensor | None]:
        """The plan with each verified chunk's proposals filled in (its spec held placeholders: how many rows the
        scheduler gave), and for the rejection sampler, for the verified rows in plan order: the proposal each row
        verifies ([R] int64, -1 on a request's last row) and q on this rank's ids of the target's split ([R, V'/p]
        float64 log-probs); (None, None) under shared noise. Each forward's proposals feed the next on the device:
        the host reads them once, at the end."""
        verified = [c for c in plan.scheduled if c.spec]
        k_of = {c.request: len(c.spec) for c in verified}
        chunks = []
        for c in plan.scheduled:  # forward 1: what the draft has not computed yet
            r = requests[c.request]
            if not c.spec:  # nothing to propose (a prompt chunk, or k = 0 this step): the draft catches up when it
                r.draft_computed = min(r.draft_computed or 0, c.q_start)  # next proposes, from what it holds now
                continue
            start = min(r.draft_computed or 0, r.num_computed_tokens, c.q_start)
            end = len(r.tokens) if c.decode else c.q_end
            chunks.append(ScheduledRequest(c.request, start, end, decode=end - start == 1 and c.decode,
                                           sample=c.request in k_of, blocks=c.blocks))
            r.draft_computed = end
        forwards = [self._forward(chunks, requests, 0)]  # each: (its requests in order, proposals [S], q [S, n])
        for j in range(1, max(k_of.values(), default=0)):  # forwards 2..K: one row per request still proposing
            chunks = []
            for c in verified:
                if k_of[c.request] > j:
                    r = requests[c.request]
                    pos = len(r.tokens) + j - 1
                    chunks.append(ScheduledRequest(c.request, pos, pos + 1, decode=True, sample=True, blocks=c.blocks))
                    r.draft_computed = pos + 1
            forwards.append(self._forward(chunks, requests, j, forwards[-1]))
        drafted: dict[int, list[int]] = {c.request: [] for c in verified}
        q_rows: dict[int, list[torch.Tensor]] = {c.request: [] for c in verified}
        order = [rid for f in forwards for rid in f[0]]
        if order:
            picked = torch.cat([f[1] for f in forwards if f[0]]).tolist()  # the draft's one host wait per step
            q_all = None if self.shared_noise else torch.cat([f[2] for f in forwards if f[0]])
            for i, (rid, t) in enumerate(zip(order, picked)):
                drafted[rid].append(int(t))
                if q_all is not None:
                    q_rows[rid].append(q_all[i])
        scheduled = tuple(dataclasses.replace(c, spec=tuple(drafted[c.request])) if c.spec else c
                          for c in plan.scheduled)
        if self.shared_noise:
            return dataclasses.replace(plan, scheduled=scheduled), None, None
        proposal, q = [], []
        for c in verified:
            proposal += drafted[c.request] + [-1]
            q += q_rows[c.request] + [torch.zeros(self.n, dtype=torch.float64, device=self.device)]
        empty = torch.zeros(0, self.n, dtype=torch.float64, device=self.device)
        return (dataclasses.replace(plan, scheduled=scheduled),
                torch.tensor(proposal, dtype=torch.long, device=self.device), torch.stack(q) if q else empty)

    def _forward(self, chunks: list[ScheduledRequest], requests: dict[int, Request], j: int,
                 fed: tuple | None = None) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """One draft forward over `chunks` (decodes first): the sampling chunks' request ids in order, their proposal
        j + 1 on the device, and (rejection sampler) its q. fed: the previous forward's (ids, proposals), the inputs
        of this one's rows (forwards 2..K: one row each, proposal j)."""
        if not chunks:
            return [], None, None
        chunks.sort(key=lambda c: not c.decode)
        plan = SchedulerOutput(-1, tuple(chunks))
        tokens = {c.request: requests[c.request].tokens + [0] * j for c in chunks}  # 0: proposal j, fed below
        step = prepare_step(plan, tokens, self.block_size, self.device, self.attention, self.cache)
        ids = step.ids
        if fed is not None:
            at = {rid: i for i, rid in enumerate(fed[0])}
            ids = fed[1][torch.tensor([at[c.request] for c in chunks], device=self.device)]
        lm = self.lm
        x = lm.hidden(ids, step.positions, step.layers)
        sampling = [c for c in chunks if c.sample]
        if not sampling:
            return [], None, None
        logits = lm.head_logits(x, step.sample_rows)[0]  # [S, V]: the whole vocabulary (a group of one)
        batch = SamplingBatch.build(sampling_rows(sampling, requests, ahead=j)[0], -1, self.device)
        rids = [c.request for c in sampling]
        if self.shared_noise:  # the noise of the target's row that verifies this proposal: no q to keep
            return rids, sample(logits, 0, None, batch, lm.cfg.vocab_size).tokens, None
        picked = sample(logits, 0, None, dataclasses.replace(batch, seed=batch.seed ^ DRAFT_STREAM),
                        lm.cfg.vocab_size).tokens
        logq = filtered_logprobs(logits, 0, None, batch)[0]
        width = logq.shape[1]
        local = torch.full((len(sampling), self.n), float("-inf"), dtype=torch.float64, device=self.device)
        take = max(0, min(self.n, width - self.start))  # this rank's ids of the target's split (padding: -inf)
        local[:, :take] = logq[:, self.start:self.start + take]
        return rids, picked, local


def lm_vocab_slice(lm) -> tuple[int, int]:
    """(first id, ids) of the target's head on this rank: its vocabulary slice (padding included), or all of it."""
    head = getattr(lm, "head", lm.embed)
    return getattr(head, "start", 0), getattr(head, "per_rank", lm.cfg.vocab_size)

