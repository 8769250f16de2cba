"""The stages that decide: hand layouts' pins, the ILP (`solve`), propagation, the pipeline cut's
search, recomputation counts, and `plan`, which walks them over meshes, micro-steps and layouts.

Reads the graph, the rules and the cost model; writes a `Strategy` (planner/strategy.py) through one
builder (`build`). Nothing before it imports it; the executor never does.
"""
