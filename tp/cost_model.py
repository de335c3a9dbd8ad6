"""The compute and memory side of the analytic model (seeds/05 §3, seeds/06 §2-§6).

tp/traffic_model.py predicts the bytes a tensor-parallel block sends; this module
adds what an iteration computes and loads, so one set of formulas answers
"compute- or bandwidth-bound?", "how long?" and "how long to move the KV cache?".

    I = 2Π·T / (w·Π + K_tok·L·B)      FLOPs per byte loaded in one iteration
        Π parameters, w bytes per weight, T tokens in the iteration, B requests,
        L context per request, K_tok KV-cache bytes per context token (all layers)
    R = peak FLOP/s / HBM bytes/s     the ridge: I < R is bandwidth-bound

The seeds write the weight bytes as "2Π" (fp16, w = 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from tp.ledger import ring_bytes_per_rank
from tp.partition import kv_bytes_per_token, kv_heads_per_rank, llama_block, mla_kv_bytes_per_token, padded  # noqa: F401


@dataclass(frozen=True)
class Shape:
    """What the cost formulas need of a model."""

    name: str
    n_params: float  # Π
    n_layers: int
    n_kv_heads: int  # K,V heads: n_heads for multi-head attention, fewer for grouped-query attention
    d_head: int
    bytes_per_elem: int = 2  # fp16 weights and KV
    n_heads: int | None = None  # query heads, when fewer K,V heads serve them (GQA); None: n_kv_heads

    @property
    def query_heads(self) -> int:
        return self.n_heads or self.n_kv_heads

    @property
    def weight_bytes(self) -> float:
        return self.bytes_per_elem * self.n_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K_tok: K and V of one context token, summed over all layers."""
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.d_head, self.bytes_per_elem)

    def kv_bytes_per_token_per_rank(self, p: int) -> int:
        """K_tok on one of p head-aligned TP ranks (kv_bytes_per_token_per_rank below)."""
        return kv_bytes_per_token_per_rank(self.n_layers, self.n_kv_heads, self.d_head, p, self.bytes_per_elem)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # sustained FLOP/s
    hbm: float  # bytes/s
    source: str

    @property
    def ridge(self) -> float:
        return self.flops / self.hbm


# Llama-2-7B as seeds/06 §3 uses it: Π ≈ 7·10⁹, 32 layers, 32 heads of 128, fp16.
LLAMA2_7B = Shape("llama2_7b", 7e9, 32, 32, 128, n_heads=32)

# H100 SXM as the seeds use it: a sustained fp16 GEMM rate, not the datasheet peak.
H100 = Hardware("H100", 500e12, 3.35e12, "seeds/06 §1: ~500 TFLOP/s fp16 sustained, 3.35 TB/s HBM3")
# Datasheet peaks (dense, no sparsity), for comparison; a sustained rate is lower, as the H100 line shows.
H100_PEAK = Hardware("H100 SXM peak", 989e12, 3.35e12, "NVIDIA H100 datasheet: 989 TFLOPS dense BF16/FP16, 3.35 TB/s")
H200 = Hardware("H200 SXM peak", 989e12, 4.8e12, "NVIDIA H200 datasheet: 989 TFLOPS dense BF16/FP16, 4.8 TB/s HBM3e")
A100 = Hardware("A100 SXM 80GB peak", 312e12, 2.039e12, "NVIDIA A100 datasheet: 312 TFLOPS dense FP16, 2,039 GB/s")
HARDWARE = {hw.name: hw for hw in (H100, H100_PEAK, H200, A100)}


def block_params(cfg) -> int:
    """Parameters of one block. GPT-2 (layers.models.config.ModelConfig): QKV, out, up, down with biases, two
    LayerNorms. Llama (layers.models.llama.LlamaConfig): q [d, k], k and v [d, k_kv] each, o, gate|up [d, 2f], down, two
    RMSNorms."""
    d, k, f = cfg.d_model, cfg.k, cfg.d_ffn
    if llama_block(cfg):  # Qwen3 (qk_norm): and its two per-head norms of d_head
        return d * (k + 2 * cfg.k_kv) + k * d + 3 * d * f + 2 * d + (2 * cfg.d_head if getattr(cfg, "qk_norm", 0) else 0)
    return d * 3 * k + 3 * k + k * d + d + d * f + f + f * d + d + 4 * d


def shape_of(cfg, bytes_per_elem: int = 2) -> Shape:
    """A Shape from a model config (article03, gpt2_small, llama_tiny, llama2_7b): parameters of the blocks only."""
    return Shape(f"blocks d={cfg.d_model} L={cfg.n_layers}", float(block_params(cfg) * cfg.n_layers), cfg.n_layers,
                 cfg.n_kv_heads, cfg.d_head, bytes_per_elem, cfg.n_heads)
# Fabric bandwidths as seeds/06 §6 gives them, bytes/s.
FABRICS = {"NVLink (in node)": 900e9, "NVSwitch fabric": 400e9, "InfiniBand HDR": 50e9, "PCIe Gen5": 64e9}

# Where a KV block can come from, one direction, bytes/s, with where each figure comes from (docs/kv_tiers.md).
KV_LINKS = {
    "NVLink 4 (GPU to GPU)": (450e9, "NVIDIA H100/H200: NVLink 4 at 900 GB/s per GPU, both directions together"),
    "PCIe 5.0 x16 (host to GPU)": (64e9, "PCI-SIG: 32 GT/s x 16 lanes, about 64 GB/s each way (128b/130b)"),
    "InfiniBand NDR (node to node)": (50e9, "NVIDIA ConnectX-7: 400 Gb/s per port = 50 GB/s"),
    "NVMe SSD, PCIe 5.0 x4": (14e9, "fast PCIe 5.0 drives' sequential reads: up to ~14 GB/s"),
    "NVMe SSD, PCIe 4.0 x4": (7e9, "PCIe 4.0 drives' sequential reads: ~7 GB/s"),
}

# Llama-3-70B: Π ≈ 70·10⁹, 80 layers, 64 query heads and 8 K,V heads of 128 (grouped-query attention), bf16.
LLAMA3_70B = Shape("llama3_70b", 70e9, 80, 8, 128, n_heads=64)


def prefill_time(s: Shape, tokens: int, hw: Hardware) -> float:
    """Seconds to prefill `tokens` tokens from nothing (the roofline of one forward: `iteration` with no decoders)."""
    return iteration(s, [], tokens).time(hw)


def handover(s: Shape, tokens: int, bandwidth: float, hw: Hardware) -> dict:
    """P/D's hand-over of a prompt of `tokens` tokens over a link of `bandwidth` bytes/s (docs/kv_tiers.md): per
    layer, compute c = prefill / L and transfer t = K_tok · tokens / L / bandwidth.

        whole request     the transfer after the prefill:        L·c + L·t
        layer by layer    layer i sent while i + 1 computes:     L·max(c, t) + min(c, t)   (a two-stage pipeline)

    The overlap hides the transfer (all but one layer's) when t <= c. Seconds, and whether it hides."""
    c = prefill_time(s, tokens, hw) / s.n_layers
    t = kv_transfer_time(s, tokens, bandwidth) / s.n_layers
    L = s.n_layers
    return {"prefill_s": L * c, "transfer_s": L * t, "whole_s": L * (c + t), "layerwise_s": L * max(c, t) + min(c, t),
            "hidden": t <= c}


def reload_or_recompute(s: Shape, tokens: int, bandwidth: float, hw: Hardware) -> dict:
    """A prefix of `tokens` tokens held in a lower tier: loading its K,V (K_tok · tokens / bandwidth) against
    computing it again (prefill_time). Seconds each, and whether the load wins."""
    load, compute = kv_transfer_time(s, tokens, bandwidth), prefill_time(s, tokens, hw)
    return {"load_s": load, "recompute_s": compute, "load_wins": load < compute}


def intensity(s: Shape, tokens: float, context: float, requests: float) -> float:
    """FLOPs per byte of one iteration: T tokens through the weights, B requests reading L cached tokens each."""
    return 2 * s.n_params * tokens / (s.weight_bytes + s.kv_bytes_per_token * context * requests)


def decode_intensity(s: Shape, batch: int, context: float) -> float:
    """B requests decode one token each (T = B) against contexts of L tokens."""
    return intensity(s, batch, context, batch)


def prefill_intensity(s: Shape, chunk: int, prefix: float) -> float:
    """One request prefills a chunk of C tokens after a cached prefix of S tokens (T = C, B = 1, L = S)."""
    return intensity(s, chunk, prefix, 1)


def regime(intensity_value: float, hw: Hardware) -> str:
    return "compute-bound" if intensity_value >= hw.ridge else "bandwidth-bound"


def crossover_context_x_batch(s: Shape) -> float:
    """L·B at which KV reads weigh as much as the weights: w·Π / K_tok."""
    return s.weight_bytes / s.kv_bytes_per_token


def roofline_time(flops: float, bytes_loaded: float, hw: Hardware) -> float:
    return max(flops / hw.flops, bytes_loaded / hw.hbm)


def kv_transfer_time(s: Shape, tokens: int, bandwidth: float) -> float:
    """Seconds to move `tokens` tokens' KV cache over a link of `bandwidth` bytes/s."""
    return tokens * s.kv_bytes_per_token / bandwidth


# ---- FLOPs of one iteration (seeds/05 §3) --------------------------------------------------------


def attention_flops_per_pair(s: Shape) -> float:
    """One (query, key) pair through the whole network: QKᵀ and PV, 2 FLOPs each per dim, every query head and
    layer (grouped-query attention shares K,V between query heads, not the work)."""
    return 4 * s.d_head * s.query_heads * s.n_layers


def block_flops(d: int, k: int, d_ffn: int, tokens: int, pairs: float) -> tuple[float, float]:
    """(linear, attention) FLOPs of one GPT-2 block: 2 per weight per token; 4·k per (query, key) pair."""
    return 2 * tokens * (d * 3 * k + k * d + d * d_ffn + d_ffn * d), 4 * k * pairs


@dataclass(frozen=True)
class Iteration:
    linear_flops: float
    attention_flops: float
    bytes_loaded: float

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    def time(self, hw: Hardware) -> float:
        return roofline_time(self.flops, self.bytes_loaded, hw)


def iteration(s: Shape, decode_contexts: list[int], prefill_tokens: int = 0) -> Iteration:
    """Decoders (one new token each, against its cached context) plus one causal prefill, in one forward.

    Linears: 2Π per token. Attention: a decoder's token meets its M cached keys (M pairs); a prefill of
    P tokens has P²/2 causal pairs. Bytes: the weights once, every decoder's KV cache, the prefill's KV written.
    """
    tokens = len(decode_contexts) + prefill_tokens
    pairs = sum(decode_contexts) + prefill_tokens * prefill_tokens / 2
    kv = s.kv_bytes_per_token * (sum(decode_contexts) + prefill_tokens)
    return Iteration(2 * s.n_params * tokens, attention_flops_per_pair(s) * pairs, s.weight_bytes + kv)


# ---- communication per GPU per layer, by parallelism (serving-compute-comm-model.md) -------------


def tp_allreduce_elems_per_gpu(tokens: float, d: int, tp: int) -> float:
    """Ring all-reduce of [tokens, d] over TP ranks: 2·(TP-1)/TP·N·d elements sent per GPU."""
    return ring_bytes_per_rank("all_reduce", tokens * d, tp, elem_bytes=1)  # in elements: one "byte" each


def tp_sp_elems_per_gpu(tokens: float, d: int, tp: int) -> float:
    """TP with sequence parallelism (v2sp): the all-reduce's two halves, a reduce-scatter of [tokens, d] and an
    all-gather back to it, (TP-1)/TP·N·d elements each: the all-reduce's volume in two collectives."""
    return (ring_bytes_per_rank("reduce_scatter", tokens * d, tp, elem_bytes=1)
            + ring_bytes_per_rank("all_gather", tokens * d, tp, elem_bytes=1))


def ep_alltoall_elems_per_gpu(tokens: float, d: int, top_k: int, ep: int) -> float:
    """MoE dispatch + combine: two all-to-alls of N·k·d elements, 1/EP of it per GPU, none to itself."""
    return 4 * tokens * top_k * d / ep * (ep - 1) / ep


def pp_send_elems(tokens: float, d: int) -> float:
    """A pipeline stage boundary: the activations [tokens, d], sent one way."""
    return tokens * d


# ---- KV cache per GPU: MHA vs MLA under TP (serving-compute-comm-model.md) -----------------------


def mha_kv_elems_per_token_per_gpu(d: int, tp: int) -> float:
    """MHA caches K and V for its own heads only: 2·d/TP elements per token per layer."""
    return 2 * d / tp


def mla_kv_elems_per_token_per_gpu(d_latent: int, d_rope: int = 0) -> float:
    """MLA caches one latent vector (plus the shared RoPE key) that every TP rank must hold whole."""
    return d_latent + d_rope


def kv_bytes_per_token_per_rank(n_layers: int, n_kv_heads: int, d_head: int, p: int, elem_bytes: int) -> int:
    """K and V of one token, every layer, on one of p head-aligned TP ranks: 2·L·max(h_kv/p, 1)·d_head·e.

    p ≤ h_kv: h_kv/p K,V heads per rank (MHA, h_kv = h: 1/p of the whole cache); p > h_kv: one K,V head, the
    same one on p/h_kv ranks, so the per-rank cache stops shrinking at p = h_kv."""
    if n_kv_heads % p and p % n_kv_heads:
        raise ValueError(f"p={p} splits neither n_kv_heads={n_kv_heads} nor a multiple of it")
    return kv_bytes_per_token(n_layers, kv_heads_per_rank(n_kv_heads, p), d_head, elem_bytes)


def pass_kv_bytes(seq: int, cp: int, kv_heads: int, d_head: int, elem_bytes: int) -> float:
    """Ring attention's pass-KV, per rank per layer: its S/cp rows' K and V sent cp − 1 times,
    (cp − 1)·2·(S/cp)·h_kv·d·e (layers/attention/context_parallel.RingPrefill; tp/traffic_model.predict_cp counts it
    exactly)."""
    return (cp - 1) * 2 * (seq / cp) * kv_heads * d_head * elem_bytes


def causal_attention_flops(seq: int, heads: int, d_head: int) -> float:
    """QKᵀ and PV of one causal layer over S positions: 2 matmuls × 2 FLOPs × S²/2 pairs × h × d."""
    return 2 * seq * seq * heads * d_head


# Llama-3-405B's attention (Meta's "Context Parallelism for Scalable Million-Token Inference": 1M-token prefill in
# 77 s on 128 H100s, 16 nodes of TP 8): 126 layers, 128 query heads, 8 K,V heads of 128.
LLAMA3_405B_ATTN = dict(n_layers=126, n_heads=128, n_kv_heads=8, d_head=128)


# DeepSeek-V3's attention dims as the comm-model document gives them.
DEEPSEEK_V3 = dict(d=7168, n_layers=61, n_heads=128, d_head=128, d_latent_kv=512, d_latent_q=1536, d_rope=64,
                   top_k=8, n_routed_experts=256, n_shared_experts=1)


# ---- one iteration of this project's serving engine, on one rank (benchmarks/bench_serve.py) -----


def decode_weight_bytes(cfg, p: int, elem_bytes: int, quantization: str | None,
                        vocab_parallel: bool = True) -> int:
    """The bytes of matmul weights one decode step reads on one of p ranks: every linear of every block and the LM
    head, each once (what bounds batch-1 decode; layers/parallel/weight_format.stored_bytes measures them on a built
    rank). Per layer, (weights, output channels) of each matmul on a rank:
        Llama   qkv (d·(k/p + 2·h_kv'·dh), k/p + 2·h_kv'·dh)  o (k/p·d, d)  gate|up (d·2f/p, 2f/p)  down (f/p·d, d)
        GPT-2   qkv (d·3k/p, 3k/p)  out (k/p·d, d)  up (d·f/p, f/p)  down (f/p·d, d)
    (h_kv' = max(h_kv/p, 1), K,V heads replicated once p > h_kv), and the head (V'/p·d, V'/p), or (V·d, V) replicated.
    Float weights: elem_bytes each. int8 (weight-only): one byte each, plus one scale of elem_bytes per output
    channel of the rank's shard: a row-parallel slice (o, down) has a whole vector of its own. Biases and norms are
    not counted (they are vectors)."""
    d, k, f, L = cfg.d_model, cfg.k, cfg.d_ffn, cfg.n_layers
    if llama_block(cfg):
        qkv_out = k // p + 2 * kv_heads_per_rank(cfg.n_kv_heads, p) * cfg.d_head
        mats = [(d * qkv_out, qkv_out), (k // p * d, d), (d * 2 * f // p, 2 * f // p), (f // p * d, d)]
    else:
        mats = [(d * 3 * k // p, 3 * k // p), (k // p * d, d), (d * f // p, f // p), (f // p * d, d)]
    vocab = padded(cfg.vocab_size, p) // p if vocab_parallel else cfg.vocab_size
    mats = mats * L + [(vocab * d, vocab)]
    if quantization is None:
        return sum(weights for weights, _ in mats) * elem_bytes
    if quantization != "int8":
        raise ValueError(f"quantization={quantization!r}: None or 'int8'")
    return sum(weights + channels * elem_bytes for weights, channels in mats)


def serving_iteration(cfg, p: int, chunks: list[tuple[int, int]], sampled: int, elem_bytes: int,
                      vocab_parallel: bool = True) -> Iteration:
    """What one of p ranks computes and loads in one serve/engine.py iteration of the LM (GPT-2 or Llama).

    cfg: a layers.models.config.ModelConfig or layers.models.llama.LlamaConfig; chunks: (q_start, q_end) of every
    request in the iteration; sampled: rows that go through the LM head.
      linear     2 FLOPs per weight per row; a rank holds 1/p of every block matmul (GPT-2: d·3k + k·d + 2·d·f;
                 Llama: d·k + k·d + 3·d·f, plus the K and V projections of its max(h_kv/p, 1) K,V heads,
                 replicated once p > h_kv), and V'/p rows of the head (all V rows when replicated), used by the
                 sampled rows only
      attention  4·(k/p) FLOPs per (query, key) pair SDPA computes (every query head; grouped K,V change what is
                 stored, not the work): a fresh prompt (q_start = 0) its causal triangle (the fused kernel skips
                 blocks above the diagonal); a chunk after a cached prefix the whole q_rows × kv_length rectangle
                 (an explicit mask); a decode its kv_length keys
      bytes      every weight the rank uses, read once, and each request's K,V of its own K,V heads over its
                 kv_length (the prefix read, the chunk written)
    """
    d, k, f, L, dh = cfg.d_model, cfg.k, cfg.d_ffn, cfg.n_layers, cfg.d_head
    rows = sum(q_end - q_start for q_start, q_end in chunks)
    if llama_block(cfg):
        kv_heads = kv_heads_per_rank(cfg.n_kv_heads, p)
        block_weights = L * ((d * k + k * d + 3 * d * f) / p + 2 * d * kv_heads * dh)
    else:
        kv_heads = cfg.n_heads / p
        block_weights = L * (d * 3 * k + k * d + 2 * d * f) / p
    vocab = padded(cfg.vocab_size, p) if vocab_parallel else cfg.vocab_size  # V', padded to a multiple of p
    head_weights = (vocab / p if vocab_parallel else vocab) * d if sampled else 0
    pairs = sum(q * (q + 1) / 2 if q_start == 0 else q * q_end
                for q_start, q_end in chunks for q in [q_end - q_start])
    linear = 2 * rows * block_weights + 2 * sampled * head_weights
    attention = 4 * (k / p) * L * pairs
    kv = sum(q_end for _, q_end in chunks) * 2 * L * kv_heads * dh * elem_bytes
    return Iteration(linear, attention, (block_weights + head_weights) * elem_bytes + kv)
