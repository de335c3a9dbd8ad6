"""A text model without internet: random weights in a family's save_pretrained layout, and a byte-level BPE trained
here on a bundled text (serve/toy_corpus.txt), saved as transformers saves a tokenizer.

    python -m serve.toy_model /tmp/toy                            # GPT-2, tiny
    python -m serve.toy_model /tmp/toy-llama --family llama --size small      # or mixtral, deepseek_v3, qwen3
    python -m serve --model /tmp/toy --prompt "Once upon a time"   # then every text example runs offline

The weights are random (drawn from --seed), so the text is gibberish; everything else is a real checkpoint: LLM,
python -m serve, the server and transformers read it as they read a downloaded one. Any byte string encodes (the
BPE's alphabet is the 256 bytes), and the tokenizer's <|endoftext|> is the model's EOS. The sizes are SIZES below
(8 heads over 4 K,V heads: tensor_parallel_size 1, 2 or 4). Each family's module says how its toy is shaped at a
size (layers/models/families.py, its `toy`): DeepSeek-V3's has MLA and one dense layer before DeepSeekMoE, Qwen3's a
head_dim of 32.
"""

from __future__ import annotations

from serve.config import FlagParser
import sys
from pathlib import Path

from layers.models.families import FAMILIES  # every family's module says how its toy is shaped (its `toy`)

CORPUS = Path(__file__).resolve().parent / "toy_corpus.txt"
SIZES = {  # hidden, heads, K,V heads, layers, context, vocab
    "tiny": dict(hidden=128, heads=8, kv_heads=4, layers=2, context=512, vocab=1024),
    "small": dict(hidden=512, heads=8, kv_heads=4, layers=4, context=1024, vocab=1024),
}
EOS = "<|endoftext|>"


def train_tokenizer(path, texts: list[str] | None = None, vocab_size: int = 1024, pieces: str | None = None):
    """A byte-level BPE trained on texts (the bundled text's lines by default), saved in path as transformers saves a
    tokenizer; returns it (a PreTrainedTokenizerFast whose EOS and BOS are <|endoftext|>). pieces: a regular
    expression that cuts the text before BPE merges inside each piece (default: GPT-2's, a space starting the next
    word's piece)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        texts = CORPUS.read_text(encoding="utf-8").splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if pieces is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pieces), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(path)
    return fast


def hf_config(family: str, size: str, tok):
    """transformers' config of the family at this size, for this tokenizer."""
    from layers.models.families import family as family_of

    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return family_of(family).toy(SIZES[size], ids)


def write(path, family: str = "gpt2", size: str = "tiny", seed: int = 0) -> dict:
    """Write the toy model to path (created; files there are overwritten). Returns what was written: family, size,
    parameters, vocab, context."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r}: one of {', '.join(SIZES)}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(path, vocab_size=SIZES[size]["vocab"])
    cfg = hf_config(family, size, tok)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))  # away from init's symmetric values: varied tokens
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(path)
    return {"family": family, "size": size, "parameters": sum(p.numel() for p in model.parameters()),
            "vocab": len(tok), "context": SIZES[size]["context"]}


def main(argv: list[str] | None = None) -> int:
    ap = FlagParser(prog="python -m serve.toy_model", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="where to write it (created)")
    ap.add_argument("--family", default="gpt2", choices=FAMILIES)
    ap.add_argument("--size", default="tiny", choices=tuple(SIZES))
    ap.add_argument("--seed", type=int, default=0, help="the random weights are drawn from it")
    args = ap.parse_args(argv)
    from serve.llm import python_command

    try:
        made = write(args.dir, args.family, args.size, args.seed)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a {made['size']} {made['family']} with random weights ({made['parameters']:,} parameters, "
          f"a {made['vocab']}-token BPE, {made['context']} positions) to {args.dir}\n"
          f"try: {python_command()} -m serve --model {args.dir} --prompt \"Once upon a time\" --max-tokens 16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
