"""Process groups, devices, the autograd-aware collectives of tensor parallelism, and traffic accounting.

    dist.py           process groups and devices: the one place that picks NCCL + GPU or gloo + CPU
    comm.py           the collectives (Megatron's region functions, sequence parallelism's, all-to-all, broadcast)
    ledger.py         the traffic ledger: every collective as it happens
    traffic_model.py  the analytic model: the same records from the shapes alone
    partition.py      what each rank holds (padding to a multiple of p, K,V heads per rank): plain Python
    cost_model.py, memory_model.py, trace.py

Nothing is imported here, so `tp.partition` can be read without torch.
"""
