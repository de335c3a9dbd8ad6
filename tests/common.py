"""Shared pieces of the tests: small configurations and dense models built identically on every rank."""

import torch

from layers.models.config import ARTICLE03, DEFAULT_TOLERANCE, ModelConfig

__all__ = ["ARTICLE03", "REL_TOL", "SMALL", "collective_counts", "dense_and_input", "exact_norms_and_rope",
           "exact_rms_forward", "patch_forwards", "rel_err", "step_engine", "train_tokenizer"]
from layers.models.dense import DenseStack, init_weights
from tp.ledger import collective_kind

SMALL = ModelConfig(d_model=64, n_heads=8, d_head=8, d_ffn=256, n_layers=3)

# max |tp - dense| / max |dense| allowed, per dtype (measured: ~3e-7 and ~1e-15 at article03, p <= 8)
REL_TOL = DEFAULT_TOLERANCE


def dense_and_input(cfg: ModelConfig, dtype: torch.dtype, n: int, seed: int = 0):
    dense = init_weights(DenseStack(cfg, dtype), seed)
    x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return dense, x.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def collective_counts(counts: dict) -> dict[str, int]:
    """CommDebugMode's {op: count} as {"all_reduce": n, "all_gather": m}."""
    out: dict[str, int] = {}
    for op, n in counts.items():
        if n:
            kind = collective_kind(op)
            out[kind] = out.get(kind, 0) + n
    return out


CORPUS = ["the quick brown fox jumps over the lazy dog", "tensor parallel serving is exact",
          "café naïve résumé über", "中文 字符 测试", "emoji 🙂 🚀 ok", "numbers 12345 67890"] * 20


def train_tokenizer(path):
    """A byte-level BPE trained here on CORPUS (no downloads), saved as transformers saves a tokenizer: the recipe of
    python -m serve.toy_model, on the tests' own text."""
    from serve.toy_model import train_tokenizer as train

    return train(path, CORPUS, vocab_size=400)


def exact_rms_forward(self, x):
    """transformers' RMSNorm forward without its float32 cast."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def patch_forwards(model, forwards: dict):
    """Every module of `model` that is an instance of a key of `forwards` gets that function as its forward."""
    for module in model.modules():
        for cls, forward in forwards.items():
            if isinstance(module, cls):
                module.forward = forward.__get__(module)
    return model


def exact_norms_and_rope(model, norm_class, rotary_class, d_head: int, theta: float):
    """A float64 transformers model whose RMSNorms (norm_class) and rotary tables (rotary_class, default RoPE) are
    computed in float64 too: transformers computes both in float32 by design, which caps agreement near 1e-7."""
    def rotary_forward(self, x, position_ids):
        inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    return patch_forwards(model, {norm_class: exact_rms_forward, rotary_class: rotary_forward})


def step_engine(engine, before=None, last: int = 0, sink=None) -> int:
    """A test's engine through the one step loop (serve/offline.py drive), on every rank: rank 0 calls
    before(engine, i) ahead of step i (to add or abort requests) and sink(outputs, i) after it, and steps while
    i <= last or a request is unfinished; the other ranks step until rank 0 stops them. Returns the steps rank 0
    took (0 elsewhere)."""
    from serve.offline import drive

    steps = 0

    def feed(engine) -> bool:
        nonlocal steps
        if steps > last and not engine.has_unfinished_requests():
            return False
        if before is not None:
            before(engine, steps)
        steps += 1
        return True

    drive(engine, feed, None if sink is None else lambda outputs: sink(outputs, steps - 1))
    return steps


@torch.no_grad()
def greedy_logprobs(dense, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens and each one's logprob, the dense model recomputing the whole sequence every step (no cache);
    the caller's context (a patched mask, pseudo-quantized K,V) applies."""
    tokens, ids, lps = list(prompt), [], []
    for _ in range(n):
        logp = torch.log_softmax(dense.logits(torch.tensor(tokens))[-1], dim=-1)
        t = int(logp.argmax())
        ids.append(t)
        lps.append(float(logp[t]))
        tokens.append(t)
    return ids, lps


def serve_greedy(engine, workload, temperature: float = 0.0) -> dict:
    """workload: [(request id, prompt, max_tokens, step it arrives)], each greedy (or sampled at `temperature`, each
    request's seed drawn from the engine's) with its chosen logprobs, through step_engine on every rank; rank 0
    returns {id: (tokens, chosen logprobs, finish reason)} (the others {})."""
    from serve.sampling_params import SamplingParams

    done = {}

    def before(engine, step):
        for name, prompt, new, at in workload:
            if at == step:
                engine.add_request(name, prompt, SamplingParams(temperature=temperature, max_tokens=new, logprobs=0))

    def sink(outputs, step):
        for o in outputs:
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)],
                                      c.finish_reason)

    step_engine(engine, before, max(at for *_, at in workload), sink)
    return done


def named(reqs) -> list:
    """[(prompt, max_tokens, step)] as serve_greedy's workload, the i-th named r{i}."""
    return [(f"r{i}", prompt, new, at) for i, (prompt, new, at) in enumerate(reqs)]
