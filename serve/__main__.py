"""Generate text from the command line, on p ranks started here (no torchrun):

    python -m serve --model DIR --tensor-parallel-size 2 --prompt "Once upon a time" --max-tokens 32
    python -m serve --model llama_tiny --prompt-ids 1,2,3 --max-tokens 8     # a preset: token ids (no tokenizer)

Prints the completion (its text; its token ids where the model has no tokenizer) and a line on stderr with the
finish reason and the time. Engine settings as --block-size, --max-num-batched-tokens, --max-num-seqs, ...
(serve/config.py FLAGS: vLLM's flag names).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from serve.config import add_engine_flags, engine_from_flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve", description="Generate a completion on the TP engine.")
    ap.add_argument("--model", required=True, help="a save_pretrained directory, or a preset (conf/model/*.yaml)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (pp x tp ranks)")
    ap.add_argument("--context-parallel-size", type=int, default=1,
                    help="cp ranks per TP rank (cp x tp ranks), each keeping 1/cp of every request's K,V")
    ap.add_argument("--prompt", help="the prompt text (the model's tokenizer encodes it)")
    ap.add_argument("--prompt-ids", help="the prompt as comma-separated token ids, for models without a tokenizer")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's torch_dtype, else float32) or a dtype")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset are drawn from it")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    if (args.prompt is None) == (args.prompt_ids is None):
        ap.error("give one of --prompt TEXT or --prompt-ids 1,2,3")
    from serve import LLM, SamplingParams
    from serve.llm import has_tokenizer

    try:
        config = engine_from_flags(args)
        if args.prompt is not None and not has_tokenizer(args.model):
            raise ValueError(f"--prompt needs a tokenizer: {args.model} has none (a preset, or a directory without "
                             f"tokenizer files); pass --prompt-ids 1,2,3")
        try:
            prompt = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids {args.prompt_ids!r}: give comma-separated token ids, e.g. 464,3290") from None
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        start = time.perf_counter()
        with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
                 pipeline_parallel_size=args.pipeline_parallel_size, dtype=args.dtype, seed=args.seed,
                 context_parallel_size=args.context_parallel_size, **dataclasses.asdict(config)) as llm:
            ready = time.perf_counter()
            out = llm.generate([prompt] if isinstance(prompt, str) else [prompt], params)[0]
            done = time.perf_counter()
            stats = llm.stats()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids)))
    print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, start-up {ready - start:.1f} s, "
          f"generate {done - ready:.2f} s, tensor_parallel_size={args.tensor_parallel_size}, "
          f"pipeline_parallel_size={args.pipeline_parallel_size}, dtype {llm.dtype}, {llm.backend}"
          + (f", speculative: {stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} "
             f"proposed tokens accepted" if config.speculative_config is not None else "") + "]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
