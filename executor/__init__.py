"""executor: the last stage — applies a strategy JSON with DTensor on torch.distributed.

The only package (with hwprofiles.calibrate and bench.zoo) that imports torch.
"""
