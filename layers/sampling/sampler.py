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
                else (a flat distribution) 1024 candidates are gathered, and if the cut lies past those too, the
                logits themselves [S, V'/p] (what vLLM moves every step, here only then): exact either way
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

TOP_P_CANDIDATES = 64  # candidates per rank gathered for top-p at first
TOP_P_SECOND = 1024  # then this many, where their 16-byte pairs cost under a quarter of the slice's logits; then all
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
    rounds: tuple[int, ...] = ()  # candidates gathered per rank, per round; 0: the logits themselves (traffic model)
    margin: torch.Tensor | None = None  # [S]: the winner's lead over the runner-up in the race (single device only)
    race: bool = False  # whether the race over the slices ran (its all-gather): some row was greedy or open
    accepted: torch.Tensor | None = None  # [S] float64: a draft's proposal accepted at this row (speculative decoding)
    # prompt logprobs (layers/sampling/prompt_logprobs.py): [R, 1 + 2N] float64 for the scored rows, and where each
    # row's score goes on the host: (request id, prompt position)
    prompt: torch.Tensor | None = None
    prompt_where: list[tuple[int, int]] | None = None
    # kv_eviction h2o (serve/eviction.py): each scheduled block's attention this step, every rank's heads summed
    scores: torch.Tensor | None = None

    # -- the sampled-token table: the one layout in which a pick leaves the device (to the host, between stages) --

    def table(self) -> torch.Tensor:
        """[S, w] float64, a row per sampled row: id, logit[, logprob, top-N ids, top-N logprobs] (w = table_width);
        ids < 2**53 are exact in float64."""
        read = [self.tokens.double()[:, None], self.logits[:, None]]
        if self.logprob is not None:
            read += [self.logprob[:, None], self.top_ids.double(), self.top_logprobs]
        if self.accepted is not None:  # a draft's verified rows: the verdict last (no logprobs then)
            read.append(self.accepted[:, None])
        return torch.cat(read, dim=1)

    def read(self) -> tuple[list[list[float]], list[list[float]], list[float] | None]:
        """The table's rows, the prompt logprobs' rows and the eviction scores (None when not asked), in one
        device-to-host copy (the step's one wait)."""
        table = self.table()
        if self.prompt is None and self.scores is None:
            return table.tolist(), [], None
        parts = [table.flatten()] + [t.flatten().to(table.dtype) for t in (self.prompt, self.scores) if t is not None]
        flat = torch.cat(parts).tolist()
        w, split = table.shape[1], table.numel()
        rows = [flat[i:i + w] for i in range(0, split, w)]
        prompt = []
        if self.prompt is not None:
            pw, end = self.prompt.shape[1], split + self.prompt.numel()
            prompt = [flat[i:i + pw] for i in range(split, end, pw)]
            split = end
        return rows, prompt, flat[split:] if self.scores is not None else None

    @classmethod
    def from_table(cls, table: torch.Tensor) -> "SampleResult":
        """The pick a table() holds (what a pipeline's other stages receive)."""
        if table.shape[1] == 2:
            return cls(table[:, 0].long(), table[:, 1])
        n = (table.shape[1] - 3) // 2
        return cls(table[:, 0].long(), table[:, 1], table[:, 2], table[:, 3:3 + n].long(), table[:, 3 + n:])

    def traffic(self, batch: "SamplingBatch | None") -> tuple[tuple[int, ...], bool, bool] | None:
        """What the traffic model needs to predict this pick's collectives (None: the greedy path)."""
        return None if batch is None or batch.greedy_only else (self.rounds, batch.normalisers, self.race)


def table_width(batch: "SamplingBatch | None") -> int:
    """The columns of SampleResult.table() for a pick under batch (None: greedy, no logprobs)."""
    return 2 if batch is None or batch.logprobs < 0 else 3 + 2 * batch.logprobs


def row_logprobs(row: list[float], n: int) -> tuple[float, dict[int, float]]:
    """A host row of the table: the chosen id's logprob, and {id: logprob} for the top n and the chosen id."""
    width = (len(row) - 3) // 2
    step = {int(t): lp for t, lp in zip(row[3:3 + width][:n], row[3 + width:3 + 2 * width][:n])}
    step[int(row[0])] = row[2]
    return row[2], step


def nothing_sampled() -> SampleResult:
    """An iteration whose rows are all prompt chunks that do not finish their prompt."""
    return SampleResult(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64))


# ---- the noise: a function of (seed, position, id) alone -----------------------------------------------------------


def shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): a bijection that scatters every input bit."""
    x = (x ^ shift_right(x, 30)) * _M1
    x = (x ^ shift_right(x, 27)) * _M2
    return x ^ shift_right(x, 31)


def splitmix64_int(x: int) -> int:
    """splitmix64 on one Python int (the same 64 bits; plain host arithmetic, no tensor)."""
    mask = (1 << 64) - 1
    x &= mask
    x = ((x ^ (x >> 30)) * _M1) & mask
    x = ((x ^ (x >> 27)) * _M2) & mask
    return x ^ (x >> 31)


def request_seed(engine_seed: int, request_id: int) -> int:
    """A request without a seed of its own: one drawn from the engine's seed and its id (a run is reproducible)."""
    return splitmix64_int(splitmix64_int(engine_seed * 1_000_003 + request_id) + _GOLDEN) & ((1 << 53) - 1)


def exponential_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """E ~ Exp(1) for every (row, id): seed, position [S], ids [n] (or [S, n], each row its own ids) -> [S, n]
    float64. Counter-based: each rank draws its own ids and gets the numbers a single device would."""
    row = splitmix64(splitmix64(seed + _GOLDEN) + position * _GOLDEN)  # [S]
    ids = ids if ids.dim() == 2 else ids[None, :]
    bits = splitmix64(row[:, None] + (ids + 1) * _GOLDEN)  # [S, n]
    u = (shift_right(bits, 11).double() + 0.5) / 2.0 ** 53  # (0, 1), 53 random bits
    return -torch.log(u)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log E for the same (row, id) as exponential_noise, bit for bit, computed in place (the race's hot loop: one
    [S, n] int64 buffer and one float64 buffer instead of a fresh tensor per operation)."""
    row = splitmix64(splitmix64(seed + _GOLDEN) + position * _GOLDEN)  # [S]
    ids = ids if ids.dim() == 2 else ids[None, :]
    x = row[:, None] + (ids + 1) * _GOLDEN  # [S, n]
    t = torch.empty_like(x)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):  # splitmix64, in place
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(t)
        if mult is not None:
            x.mul_(mult)
    torch.bitwise_right_shift(x, 11, out=t)
    t.bitwise_and_((1 << 53) - 1)
    u = t.double().add_(0.5).div_(2.0 ** 53)
    return u.log_().neg_().log_().neg_()  # -log(-log u) = -log E


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


def _candidates(local: torch.Tensor, ids: torch.Tensor, c: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-c (z, id) of each row, sorted (z desc, id asc), float64: [S, c] each; when c is every id a rank
    holds (c = V'/p), all p·c of them (the whole vocabulary, exact whatever is asked of it). ★ all-gather of every
    rank's top-c pairs [S, 2c] -> [S, 2cp]."""
    n = local.shape[1]
    cut = local.topk(c, dim=-1).values[:, -1:]  # the c-th largest value of each row
    # topk breaks ties at the cut arbitrarily: take every id above it, then the lowest ids at it
    key = torch.where(local > cut, float("inf"), torch.where(local == cut, -ids.double(), float("-inf")))
    where = key.topk(c, dim=-1).indices
    top = local.gather(1, where)
    pairs = rearrange(torch.stack([top.double(), ids[where].double()], dim=-1), "s c two -> s (c two)")
    if group is not None:
        pairs = gather_from_region(pairs, group, "head/candidates all-gather")  # ★ all-gather: [S, 2cp]
    values, cand = rearrange(pairs, "s (pc two) -> two s pc", two=2)
    order = torch.argsort(cand, dim=-1, stable=True)  # id asc, then z desc (stable): ties to the lower id
    values, cand = values.gather(1, order), cand.gather(1, order)
    order = torch.argsort(values, dim=-1, descending=True, stable=True)
    certain = values.shape[1] if c >= n else c  # the first c of the merged lists are the global top c
    return values.gather(1, order)[:, :certain], cand.gather(1, order)[:, :certain]


def _all_logits(local: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every id of the (padded) vocabulary, sorted (z desc, id asc): ★ all-gather of the logits in their own dtype
    [S, V'/p] -> [S, V'] (the slices are contiguous: an id is its column)."""
    full = local if group is None else gather_from_region(local.contiguous(), group, "head/logits all-gather")
    values = full.double()
    order = torch.argsort(values, dim=-1, descending=True, stable=True)  # ties keep id order: the lower id first
    return values.gather(1, order), order.double()


@dataclass
class Filtered:
    """What the filters decided for each row: apply_filters' result, which both samplers read (sample() and
    filtered_logprobs here, layers/sampling/rejection_sampler.py's verifier)."""
    T: torch.Tensor  # [S, 1] the temperature (1 on greedy rows)
    log_min_p: torch.Tensor  # [S, 1]
    greedy: torch.Tensor  # [S] bool
    m: torch.Tensor | None  # [S, 1] the global max of z (None: no candidates were gathered)
    top_z: torch.Tensor | None  # [S, c] the merged candidates, (z desc, id asc)
    top_id: torch.Tensor | None
    kept: torch.Tensor | None  # [S, c] which candidates survive every filter (a prefix of them)
    closed: torch.Tensor  # [S] bool: every kept id is a candidate
    rounds: list[int]
    z_full: torch.Tensor | None  # [S] logprobs' normaliser sum exp(z - m), all-reduced


def apply_filters(local: torch.Tensor, ids: torch.Tensor, group, batch: SamplingBatch) -> Filtered:
    """The filters (temperature, min-p, top-k, top-p: vLLM's order), exactly, with the fewest collectives: candidates,
    normalisers, more candidates for top-p. The one home of the filters: the plain sampler and the rejection sampler
    both call it."""
    S, n = local.shape
    dev = local.device
    every = n if group is None else n * dist.get_world_size(group)  # the whole padded vocabulary, V'
    greedy = batch.temperature == 0
    sampled = ~greedy
    T = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)[:, None]
    log_min_p = torch.log(batch.min_p)[:, None]  # min_p 0: -inf, keeps all
    rounds: list[int] = []
    c = min(n, max(batch.candidates, TOP_P_CANDIDATES if batch.any_top_p else 0))
    closed = torch.zeros(S, dtype=torch.bool, device=dev)
    top_z = top_id = m = kept_c = z_full = None
    if c:
        top_z, top_id = _candidates(local, ids, c, group)
        rounds.append(c)
        m = top_z[:, :1]  # the global max of z
        kept_c = _kept_candidates(top_z, T, m, batch, greedy)  # survivors of min-p and top-k among the candidates
        closed = sampled & ((batch.top_k > 0) | ~kept_c[:, -1] | (top_z.shape[1] >= every))
    top_p_on = sampled & (batch.top_p < 1)
    if batch.normalisers:
        # ★ all-reduce of each row's normalisers: top-p's Z_K over the survivors of min-p (on its slice; a row closed
        # by top-k or min-p has them all among the candidates) and logprobs' Z over every id, both from max m
        slice_rows = top_p_on & ~closed
        z = local.double()
        zk = torch.zeros(S, dtype=torch.float64, device=dev)
        if bool(slice_rows.any()):
            s_rows = z[slice_rows] / T[slice_rows]
            alive = s_rows >= m[slice_rows] / T[slice_rows] + log_min_p[slice_rows]
            zk[slice_rows] = torch.where(alive, torch.exp(s_rows - m[slice_rows] / T[slice_rows]), 0).sum(-1)
        zf = torch.exp(z - m).sum(-1) if batch.logprobs >= 0 else torch.zeros_like(zk)  # padding: exp(-inf) = 0
        sums = torch.stack([zk, zf], dim=-1)  # [S, 2]
        if group is not None:
            sums = reduce_from_region(sums, group, "head/normaliser all-reduce")
        cand_zk = torch.where(kept_c, torch.exp(top_z / T - m / T), 0).sum(-1)
        z_kept = torch.where(slice_rows, sums[:, 0], cand_zk)
        z_full = sums[:, 1]
    if batch.any_top_p:
        while True:
            mass = torch.where(kept_c, torch.exp(top_z / T - m / T), 0) / z_kept[:, None]
            before = mass.cumsum(-1) - mass  # the survivors' mass ranked before each candidate
            inside = (mass.sum(-1) >= batch.top_p) | (top_z.shape[1] >= every)
            if bool((inside | ~top_p_on).all()):
                break
            # The cut lies past every rank's candidates (a flat distribution): more candidates where their 16-byte
            # pairs cost under a quarter of the slice's logits, else the logits themselves (what gathering them costs)
            if c < TOP_P_SECOND and 4 * 16 * TOP_P_SECOND < n * local.element_size():
                c = TOP_P_SECOND
                top_z, top_id = _candidates(local, ids, c, group)
            else:
                c = n
                top_z, top_id = _all_logits(local, group)
            rounds.append(c if c < n else 0)
            kept_c = _kept_candidates(top_z, T, m, batch, greedy)
        kept_c = kept_c & ~(top_p_on[:, None] & (before >= batch.top_p[:, None]))  # top-p's prefix
        closed |= top_p_on
    return Filtered(T, log_min_p, greedy, m, top_z, top_id, kept_c, closed, rounds, z_full)


def log_normaliser(m: torch.Tensor, z_sum: torch.Tensor) -> torch.Tensor:
    """log Z from each row's max m and sum exp(z - m) over the whole vocabulary, float64: a logprob is z - log Z. The
    one expression of it: the sampler's logprobs and a trainer's (train/loss.py token_logprobs) read it, so the two
    agree to the bit where their logits do (EngineConfig.batch_invariant)."""
    return m + torch.log(z_sum)


def sample(local: torch.Tensor, start: int, group: dist.ProcessGroup | None, batch: SamplingBatch | None,
           vocab_size: int) -> SampleResult:
    """local: this rank's logits [S, V'/p] (padding ids -inf); start: its first id; group: the vocab-parallel group
    (None: the whole vocabulary is here). One batched pass, no loop over rows.

    A row whose kept ids all lie among the merged candidates (top-k; top-p or min-p cutting inside them) is closed:
    every rank races the same candidates with the same noise and gets the same winner, with no more communication
    and no noise drawn over the slice. The other rows (temperature alone, or a cut past the candidates; greedy rows)
    race over each rank's slice, and the race's all-gather picks the winner."""
    if batch is None or batch.greedy_only:
        return SampleResult(*greedy_pick(local, start, group))
    S, n = local.shape
    dev = local.device
    ids = torch.arange(start, start + n, device=dev)
    cut = apply_filters(local, ids, group, batch)
    T, closed, top_z, top_id = cut.T, cut.closed, cut.top_z, cut.top_id
    result = SampleResult(torch.empty(S, dtype=torch.long, device=dev),
                          torch.empty(S, dtype=torch.float64, device=dev), rounds=tuple(cut.rounds))
    if bool(closed.any()):  # race the candidates: the same on every rank, nothing to gather
        kept = cut.kept[closed]
        cz, cid = top_z[closed], top_id[closed].long()
        race = torch.where(kept, gumbel_noise(batch.seed[closed], batch.position[closed], cid) + cz / T[closed],
                           float("-inf"))
        best = race.max(dim=-1, keepdim=True).values
        pick = torch.where(race == best, cid, torch.iinfo(torch.long).max).argmin(-1, keepdim=True)  # ties: lowest id
        result.tokens[closed], result.logits[closed] = cid.gather(1, pick)[:, 0], cz.gather(1, pick)[:, 0]
        if group is None and race.shape[1] > 1:
            two = race.topk(2, dim=-1).values
            result.margin = torch.zeros(S, dtype=torch.float64, device=dev)
            result.margin[closed] = two[:, 0] - two[:, 1]
    if not bool(closed.all()):
        result.race = True
        _race_slices(local, ids, start, group, batch, T, cut.log_min_p, cut.m, ~closed, result)
    if batch.logprobs >= 0:
        log_z = log_normaliser(cut.m[:, 0], cut.z_full)
        result.logprob = result.logits - log_z
        result.top_ids = top_id[:, :batch.logprobs].long()
        result.top_logprobs = top_z[:, :batch.logprobs] - log_z[:, None]
    return result


def _race_slices(local, ids, start, group, batch: SamplingBatch, T, log_min_p, m, rows, result: SampleResult) -> None:
    """The open rows race over every rank's slice: each rank's winner of s_i - log E_i among its kept ids (greedy rows:
    z_i, no noise), ★ all-gather of (value, id, z) [S, 3] -> [S, 3p] (closed rows send -inf), the largest wins, ties
    to the lowest rank and so the lowest id."""
    S = local.shape[0]
    z = local[rows].double()
    greedy = batch.temperature[rows] == 0
    s = z / T[rows]
    keep = torch.isfinite(z)
    if m is not None:  # min-p on the open rows (top-k and top-p rows are closed)
        keep &= greedy[:, None] | (s >= m[rows] / T[rows] + log_min_p[rows])
    race = gumbel_noise(batch.seed[rows], batch.position[rows], ids).add_(s)  # s - log E
    race = torch.where(keep, torch.where(greedy[:, None], z, race), float("-inf"))
    best = race.argmax(dim=-1, keepdim=True)  # first maximum: the lowest id within the slice
    triple = torch.full((S, 3), float("-inf"), dtype=torch.float64, device=local.device)
    triple[rows] = torch.cat([race.gather(1, best), (best + start).double(), z.gather(1, best)], dim=-1)
    if group is not None:
        triple = gather_from_region(triple, group, "head/sample all-gather")  # ★ all-gather: [S, 3p]
    values, won, logit = rearrange(triple, "s (p three) -> three s p", three=3)
    winner = values.argmax(dim=-1, keepdim=True)  # the largest, ties to the lowest rank
    result.tokens[rows] = won.gather(1, winner)[rows, 0].long()
    result.logits[rows] = logit.gather(1, winner)[rows, 0]
    if group is None and race.shape[1] > 1:  # an oracle's near-tie rule: how close the race was
        two = race.topk(2, dim=-1).values
        if result.margin is None:
            result.margin = torch.zeros(S, dtype=torch.float64, device=local.device)
        result.margin[rows] = two[:, 0] - two[:, 1]


def _kept_candidates(top_z, T, m, batch: SamplingBatch, greedy) -> torch.Tensor:
    """Which of the merged candidates survive min-p and top-k (the same rules as on each rank's own ids)."""
    kept = torch.isfinite(top_z) & (top_z / T >= m / T + torch.log(batch.min_p)[:, None])
    width = top_z.shape[1]
    k = torch.where((batch.top_k > 0) & ~greedy, batch.top_k, width + 1)
    return kept & (torch.arange(width, device=top_z.device)[None, :] < k[:, None])
