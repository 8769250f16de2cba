"""costmodel: prices an OpGraph (and later each sharding strategy) in seconds and bytes.

Sits between planner/graph+rules and planner/solve; reads hardware numbers from hwprofiles.
Nothing here imports torch.
"""
