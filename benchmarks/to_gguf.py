"""A GGUF file (llama.cpp's format) written from a Llama checkpoint in save_pretrained's layout, so that llama.cpp
runs the very weights LLM serves (benchmarks/bench_decode.py's peer).

    python benchmarks/to_gguf.py MODEL_DIR OUT.gguf [--type f32|q8_0]

What it writes, as llama.cpp's own convert_hf_to_gguf.py does for a Llama:
  - the hyperparameters under `llama.*` (context, widths, heads, K,V heads, RMSNorm's epsilon, RoPE's base);
  - no tokenizer (`tokenizer.ggml.model = "no_vocab"`, `llama.vocab_size`): the benchmark hands llama.cpp token ids;
  - every tensor renamed (token_embd, blk.<i>.attn_q, ..., output), q and k rows permuted from the rotate-half
    layout of Llama checkpoints (dimension i pairs with i + dh/2) to GGML's adjacent pairs (2i with 2i + 1);
  - q8_0: each 2-D weight in blocks of 32 values, an fp16 scale and 32 int8 codes each (gguf's own quantizer); the
    norms stay float32.
Needs the optional extra `pip install -e .[llamacpp]` (the `gguf` package).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TYPES = ("f32", "q8_0")
LAYER_NAMES = {  # checkpoint key (after model.layers.<i>.) -> GGUF name (after blk.<i>.)
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight"}


def rotate_half_to_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows [heads·dh, d]: per head, rows (i, i + dh/2) become rows (2i, 2i + 1) (GGML's rotary pairs)."""
    dh = w.shape[0] // heads
    return w.reshape(heads, 2, dh // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(model_dir: Path, cfg: dict):
    """(GGUF name, float32 array) for every tensor of the checkpoint, renamed and q, k permuted."""
    from safetensors.torch import load_file

    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):  # torch's reader: bfloat16 files too (numpy has no bfloat16)
        state.update({k: v.float().numpy() for k, v in load_file(path).items()})
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for key, name in LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{key}"]
            if name == "attn_q.weight":
                w = rotate_half_to_pairs(w, heads)
            elif name == "attn_k.weight":
                w = rotate_half_to_pairs(w, kv_heads)
            yield f"blk.{i}.{name}", w
    yield "output_norm.weight", state["model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]


def write(model_dir, out, type_: str = "f32") -> Path:
    """model_dir's Llama checkpoint as a GGUF file at out, its 2-D weights in `type_` (f32 or q8_0)."""
    import gguf

    if type_ not in TYPES:
        raise ValueError(f"type={type_!r}: choose {' or '.join(TYPES)}")
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{model_dir}: model_type {cfg.get('model_type')!r}; this writer takes Llama checkpoints")
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:  # llama.cpp assumes hidden / heads otherwise
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("no_vocab")
    q8 = type_ == "q8_0"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    for name, w in tensors(model_dir, cfg):
        w = np.ascontiguousarray(w, dtype=np.float32)
        if q8 and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--type", default="f32", choices=TYPES)
    args = ap.parse_args(argv)
    print(f"wrote {write(args.model_dir, args.out, args.type)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
