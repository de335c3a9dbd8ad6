"""Generate text from the command line, on p ranks started here (no torchrun):

    python -m serve.toy_model /tmp/toy                # a text model without internet (random weights, a BPE)
    python -m serve --model /tmp/toy --tensor-parallel-size 2 --prompt "Once upon a time" --max-tokens 32
    python -m serve --model /tmp/toy --prompt "Once" --temperature 0.8 --top-p 0.9 --seed 1 --stop "." --logprobs 2
    python -m serve --model llama_tiny --prompt-ids 1,2,3 --max-tokens 8     # a preset: token ids (no tokenizer)

Prints the completion (its text; its token ids where the model has no tokenizer), with --logprobs N a line per token
(its id, text and logprob, then the top N), and a line on stderr with the finish reason and the time. Sampling as
SamplingParams (--temperature --top-p --top-k --min-p --seed --stop --stop-token-ids --ignore-eos --logprobs);
--seed is the sampling seed, --weights-seed draws a preset's random weights. Engine settings as --block-size,
--max-num-batched-tokens, --max-num-seqs, --max-model-len, ... (serve/config.py FLAGS: vLLM's flag names).
"""

from __future__ import annotations

import os
import sys
import time

from serve.config import FlagParser, add_engine_flags, add_llm_flags, engine_from_flags, flag_names, llm_settings
from serve.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = FlagParser(prog="python -m serve", description="Generate a completion on the TP engine.")
    add_llm_flags(ap, "a save_pretrained directory, or a preset (conf/model/*.yaml)")
    ap.add_argument("--prompt", help="the prompt text (the model's tokenizer encodes it)")
    ap.add_argument("--prompt-ids", help="the prompt as comma-separated token ids, for models without a tokenizer")
    ap.add_argument("--weights-seed", type=int, default=0, help="a preset's random weights are drawn from it")
    sampling = ap.add_argument_group("sampling (SamplingParams; vLLM's names)")
    sampling.add_argument("--max-tokens", type=int, default=16)
    sampling.add_argument("--temperature", type=float, default=SamplingParams.temperature,
                          help=f"{SamplingParams.temperature} by default (vLLM's); 0: greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1: off")
    sampling.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    sampling.add_argument("--min-p", type=float, default=0.0, help="0: off")
    sampling.add_argument("--seed", type=int, default=None,
                          help="the sampling seed: the same tokens at any layout (default: one drawn per request)")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="a stop string (repeat the flag for more): the text is cut before it")
    sampling.add_argument("--stop-token-ids", help="comma-separated token ids that end the completion")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--logprobs", type=int, default=None, metavar="N",
                          help="print each token's logprob and the top N alternatives")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    if (args.prompt is None) == (args.prompt_ids is None):
        ap.error("give one of --prompt TEXT or --prompt-ids 1,2,3")
    from serve import LLM
    from serve.llm import check_model_exists, has_tokenizer

    try:
        config = engine_from_flags(args)
        check_model_exists(args.model, "--model ")
        if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
            raise ValueError(f"--tokenizer {args.tokenizer!r}: no such directory")
        if args.prompt is not None and not has_tokenizer(args.model, args.tokenizer):
            raise ValueError(f"--prompt needs a tokenizer: {args.tokenizer or args.model} has none (a preset, or a "
                             f"directory without tokenizer files); pass --tokenizer DIR or --prompt-ids 1,2,3")
        prompt = args.prompt if args.prompt is not None else _ids("--prompt-ids", args.prompt_ids)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                                stop_token_ids=_ids("--stop-token-ids", args.stop_token_ids or ""),
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        if args.stop and args.prompt is None and not has_tokenizer(args.model, args.tokenizer):
            raise ValueError("--stop needs a tokenizer (stop strings are matched on the text): pass --tokenizer DIR, "
                             "or --stop-token-ids")
        start = time.perf_counter()
        with LLM(args.model, seed=args.weights_seed, **llm_settings(args, config)) as llm:
            ready = time.perf_counter()
            summary = llm.settings_summary()
            out = llm.generate([prompt] if isinstance(prompt, str) else [prompt], params)[0]
            done = time.perf_counter()
            stats = llm.stats()
    except ValueError as exc:
        print(f"error: {flag_names(str(exc))}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids)))
    if c.logprobs is not None:
        print(f"logprobs (each token: id, text, logprob | the top {args.logprobs}):")
        for i, (t, step) in enumerate(zip(c.token_ids, c.logprobs)):
            top = sorted(step.items(), key=lambda kv: -kv[1])[:args.logprobs]  # the chosen token, then the top N
            print(f"{i:4d} {_token(llm, t)} {step[t]:.6f} | "
                  + ", ".join(f"{_token(llm, tid)} {lp:.6f}" for tid, lp in top))
    print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, start-up {ready - start:.1f} s, "
          f"generate {done - ready:.2f} s; {summary}"
          + (f"; speculative: {stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} "
             f"proposed tokens accepted" if config.speculative_config is not None else "") + "]", file=sys.stderr)
    return 0


def _ids(flag: str, text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated token ids, e.g. 464,3290") from None


def _token(llm, t: int) -> str:
    return f"{t} {llm.tokenizer.decode([t])!r}" if llm.tokenizer is not None else str(t)


if __name__ == "__main__":
    sys.exit(main())
