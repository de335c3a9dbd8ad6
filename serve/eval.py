"""Perplexity of a model over a text, through LLM (prompt logprobs under the vocab-parallel head):

    python -m serve.eval --model models/stdlib --file held_out.py [--window 256] [--stride 128]
                         [--tensor-parallel-size 2] [engine flags as python -m serve]

The text is encoded whole and scored in windows of `window` tokens that start every `stride` tokens (Hugging Face's
sliding-window perplexity): the first window scores all its tokens but its first, each later window only the tokens
the windows before it did not reach, each with up to window - stride tokens of context before it. Every token but
the text's first is scored once. Prints the tokens scored, the mean negative log-likelihood in nats per token and the
perplexity (exp of it); `perplexity(llm, ids, window, stride)` is the function the benchmarks call.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from serve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # tokens scored (the text's, less its first)
    nll: float  # mean negative log-likelihood, nats per token
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over n tokens: [start, end) goes to the model, positions
    first..end - 1 are scored (each position once, every one but 0)."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"window={window}, stride={stride}: need window >= 2 and 1 <= stride < window (each window "
                         f"overlaps the one before, so its first scored token has context)")
    out, scored = [], 1
    for start in range(0, max(n - 1, 1), stride):
        end = min(start + window, n)
        if end > scored:
            out.append((start, end, scored))
            scored = end
        if end == n:
            break
    return out


def perplexity(llm, ids: list[int], window: int | None = None, stride: int | None = None) -> Perplexity:
    """ids' perplexity under llm (LLM): windows of `window` tokens (default: the model's context) every `stride`
    (default: half a window), all windows in one generate call, each scored by its prompt logprobs."""
    window = window or llm.max_model_len
    stride = stride or max(window // 2, 1)
    if window > llm.max_model_len:
        raise ValueError(f"window={window} is longer than the model's context ({llm.max_model_len} positions)")
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s): perplexity needs at least 2")
    spans = windows(len(ids), window, stride)
    # one generated token each (the engine's least); the prompt's scores are what counts
    outs = llm.generate([ids[s:e] for s, e, _ in spans], SamplingParams(max_tokens=1, temperature=0,
                                                                        prompt_logprobs=0, ignore_eos=True))
    total, count = 0.0, 0
    for (start, end, first), out in zip(spans, outs):
        for pos in range(first, end):
            total -= out.prompt_logprobs[pos - start][ids[pos]]
            count += 1
    return Perplexity(count, total / count, len(spans))


def main(argv: list[str] | None = None) -> int:
    from serve.config import FlagParser, add_engine_flags, add_llm_flags, engine_from_flags, flag_names, llm_settings

    ap = FlagParser(prog="python -m serve.eval", description="A model's perplexity over a text file.")
    add_llm_flags(ap, "a save_pretrained directory with a tokenizer")
    ap.add_argument("--file", required=True, help="the text to score (UTF-8)")
    ap.add_argument("--window", type=int, default=None, help="tokens per window (default: the model's context)")
    ap.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window / 2)")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    from serve import LLM
    from serve.llm import check_model_exists, has_tokenizer

    try:
        config = engine_from_flags(args)
        check_model_exists(args.model, "--model ")
        if not has_tokenizer(args.model, args.tokenizer):
            raise ValueError(f"--model {args.model}: no tokenizer to encode the text with (pass --tokenizer DIR)")
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--file {args.file!r}: {exc.strerror}") from None
        with LLM(args.model, **llm_settings(args, config)) as llm:
            ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
            result = perplexity(llm, ids, args.window, args.stride)
    except ValueError as exc:
        print(f"error: {flag_names(str(exc))}", file=sys.stderr)
        return 2
    print(f"{result.tokens} tokens in {result.windows} windows: {result.nll:.4f} nats/token, "
          f"perplexity {result.perplexity:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
