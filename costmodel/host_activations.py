"""Saved activations in host memory (`core.levers.ActivationOffload`): in the layers the plan names, each
tensor autograd saves is copied to the host as it is saved and back to the device when backward reads
it (`executor/host_activations.py`), so the layer's activations hold no device memory between its
forward and its backward. The copies run on the compute stream, as torch's saved-tensor hooks
(`torch.autograd.graph.save_on_cpu` too) issue them: the step waits for both, each micro-batch, at the
host link's rate with every device of the node copying (`ModelStates.host_rate`). Which layers: in each
group, the `n` after the layers it recomputes (a recomputed layer saves only its input)."""

from __future__ import annotations

from collections.abc import Mapping

from core.collectives import Cadence
from core.graph import OpGraph
from costmodel.items import HostCopy, PricedStep


def host_layers(graph: OpGraph, counts: Mapping[str, int],
                recomputed: Mapping[str, int]) -> tuple[dict[str, str], dict[str, int]]:
    """Each node of a layer whose activations live on the host → the layer's name ("prefix.i"): in each
    group named in `counts`, that many layers after its first `recomputed[prefix]` (as many as there are);
    and per group the count so placed."""
    out: dict[str, str] = {}
    placed: dict[str, int] = {}
    for group in graph.layers:
        first = min(recomputed.get(group.prefix, 0), group.num_layers)
        last = min(group.num_layers, first + counts.get(group.prefix, 0))
        if last > first:
            placed[group.prefix] = placed.get(group.prefix, 0) + last - first
        for i in range(first, last):
            out.update(dict.fromkeys(group.nodes[i], f"{group.prefix}.{group.indices[i]}"))
    return out, placed


def price_host_activations(priced: PricedStep, activations: dict[str, float], layers: Mapping[str, str],
                           placed: Mapping[str, int], rate: float) -> None:
    """The activations the nodes of `layers` save (`activations`: the step's device bytes by node) moved
    to host memory, and per layer its two copies a micro-batch, waited for (`rate`: bytes a second)."""
    moved: dict[str, float] = {}
    for node, layer in layers.items():
        b = activations.pop(node, 0.0)
        if b:
            moved[layer] = moved.get(layer, 0.0) + b
    for layer, b in moved.items():
        priced.host_memory[f"(activations of {layer})"] = b
        priced.host_copies += [HostCopy(layer, "saved activations to host", b, b / rate, Cadence.MICRO_BATCH, False),
                               HostCopy(layer, "saved activations to device", b, b / rate, Cadence.MICRO_BATCH, False)]
    priced.host_activations = dict(placed)
