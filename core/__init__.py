"""The ground layer: the torch-free vocabulary every stage of the flow speaks.

Errors (`errors`), placements and specs (`placement`), device meshes (`mesh`), the graph's types
(`graph`, `layers`), the collectives' enums and link levels (`collectives`), and the spec → spec
reshard plan (`reshard`). It imports nothing else of meshplan; every other package may import it.
"""
