"""Parallel linears, attention, the dense reference block and the tensor-parallel blocks."""
