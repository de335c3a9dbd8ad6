"""The tensor-parallel pieces every family is cut with: column and row parallel linears, the vocab-parallel
embedding and head, and the plan of which slice each rank holds."""
