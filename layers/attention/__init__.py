"""Causal attention on a rank's heads, its backends over the paged KV cache, the quantized cache, context
parallelism and varlen batches."""
