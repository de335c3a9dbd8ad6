"""The model families (registry in families.py), their dense and tensor-parallel blocks, the LMs around them (whole
or one pipeline stage) and their checkpoints."""
