"""The model's layers, by job: models/ (the families, their blocks, the LMs around them and their checkpoints),
attention/ (attention, its backends over the paged cache, the quantized cache, context parallelism, varlen batches),
parallel/ (the tensor-parallel pieces every family is cut with: parallel linears, the vocab-parallel embedding and
head, each rank's shard plan) and sampling/ (the pick from the vocab slices, and speculative decoding's verifier)."""
