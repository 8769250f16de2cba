"""planner: the first and the deciding stages of the flow.

model.onnx → `graph` (OpGraph) → `rules` (strategies per op) → [costmodel] → `solve` (CP-SAT) →
`strategy` (JSON). Nothing here imports torch.
"""
