"""The pick from the vocab-parallel logit slices, and speculative decoding's verifier on the same slices."""
