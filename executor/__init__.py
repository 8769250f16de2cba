"""executor: the last stage — applies a strategy JSON with DTensor on torch.distributed.

The only package (with hwprofiles' measurement modules, lazily, and bench.zoo) that imports torch.
"""
