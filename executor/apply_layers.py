"""`meshplan.apply`'s per-layer work on the module: the graph's repeated layers found among the module's
submodules (by the exporter's names), wrapped with the plan's recomputation (full, or op-level
selective: `executor/recompute.py`) or their saved activations on the host (`executor/host_activations.py`),
and torch.compile (the whole module, or per layer where layers are recomputed)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from core.graph import OpGraph
from core.levers import Offload, Recompute
from executor.binding import best_match, name_key
from executor.recompute import selective_contexts
from planner.strategy import Strategy

# `report`: apply's `ApplyReport` (what runs and what fell back), which these functions fill in.

def layer_module(graph_path: str, module: nn.Module, keys: dict[str, str]) -> tuple[str, nn.Module] | None:
    """The module FQN and module a graph layer (`prefix.i`) stands for, by the exporter's names; None where
    the module has none."""
    fqn = best_match(name_key(graph_path), keys)
    return None if fqn is None else (fqn, module.get_submodule(fqn))


def module_keys(module: nn.Module) -> dict[str, str]:
    return {fqn: name_key(fqn) for fqn, _ in module.named_modules() if fqn}


def recompute_layers(s: Strategy, graph: OpGraph, module: nn.Module, report: Any) -> None:
    """The plan's recomputed layers, each wrapped with the composable checkpoint: full (the layer's
    forward again from its input), or selective (op-level, `executor/recompute.py`)."""
    if not s.training.recompute:
        return
    from torch.distributed._composable import checkpoint

    keys = module_keys(module)
    for group in graph.layers:
        policy = s.training.recompute.get(group.prefix)
        if policy is None:
            continue
        selective = policy == Recompute.SELECTIVE
        count = group.num_layers if selective else s.training.recomputed_layers(group.prefix, group.num_layers)
        for i in group.indices[:count]:
            path = f"{group.prefix}.{i}"
            found = layer_module(path, module, keys)
            if found is None:
                report.fallbacks.append(f"recomputed layer {path} has no module here: not recomputed")
                continue
            checkpoint(found[1], **({"context_fn": selective_contexts} if selective else {}))
            report.recomputed.append(found[0])
        report.recompute = str(policy)




def host_activation_layers(s: Strategy, graph: OpGraph, module: nn.Module, report: Any) -> None:
    """The plan's layers whose saved activations live on the host (`executor/host_activations.py`): each
    layer's forward runs under the copying hooks, entered by a forward pre-hook and left by a forward
    hook; a pre-hook on the module starts each forward's copies anew."""
    tr = s.training
    if not tr.offload_activations:
        return
    from executor.host_activations import HostActivations, planned_host_layers

    _, counts, before = planned_host_layers(tr, graph)
    host = HostActivations()
    keys = module_keys(module)
    module.register_forward_pre_hook(lambda *_: host.begin())
    for group in graph.layers:
        first = before.get(group.prefix, 0)
        for i in group.indices[first:first + counts.get(group.prefix, 0)]:
            found = layer_module(f"{group.prefix}.{i}", module, keys)
            if found is None:
                report.fallbacks.append(f"activations of layer {group.prefix}.{i} on the host: it has no module here; "
                                        "kept on the device")
                continue
            _under(found[1], host.hooks)
            report.host_activations.append(found[0])
    report.host = host


def _under(layer: nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """`layer`'s forward run inside a new `context()` each call (entered before it, left after)."""
    entered: list[contextlib.AbstractContextManager[Any]] = []

    def enter(*_: Any) -> None:
        entered.append(context())
        entered[-1].__enter__()

    def leave(*_: Any) -> None:
        entered.pop().__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)


def weights_offloaded(s: Strategy) -> bool:
    """Whether the plan keeps any weights on the host (offload params,optimizer)."""
    return any(m == Offload.PARAMS for m in s.training.offload.values())


def offloaded_units(s: Strategy, module: nn.Module, report: Any) -> tuple[list[tuple[str, nn.Module]], bool]:
    """The layers whose weights the plan keeps on the host, each a module whose parameters are all
    offloaded (its FQN and module), and whether the parameters outside them are too (the root's)."""
    if not weights_offloaded(s):
        return [], False
    offloaded = {fqn for b in report.bindings for fqn in b.fqns if s.training.offload.get(b.onnx) == Offload.PARAMS}
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    units: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()
    for fqn, sub in module.named_modules():
        mine = [n for n in names if n.startswith(f"{fqn}.")]
        if not fqn or not mine or any(fqn.startswith(f"{u}.") for u, _ in units):
            continue
        # a layer: its parameters all offloaded, and it is one of the repeated blocks (a module list's entry)
        if all(n in offloaded for n in mine) and fqn.rsplit(".", 1)[-1].isdigit():
            units.append((fqn, sub))
            taken.update(mine)
    rest = [n for n in names if n not in taken]
    return units, bool(rest) and all(n in offloaded for n in rest)


def compile_module(graph: OpGraph, module: nn.Module, report: Any) -> None:
    """torch.compile in place (`nn.Module.compile`: names and hooks kept): the whole module, as a user's
    `torch.compile(model)` and as the plan's compiled runtime prices it (every chain between matmuls fused,
    the head's GEMM padded to alignment, the loss fused). A plan that recomputes layers compiles each
    layer instead (torchtitan's way): the recomputed layers' checkpoint hooks need the layer's boundary,
    which a whole-module graph removes; the embedding, head and loss then run eager, which the report says.
    So does a plan with activations on the host, whose layers with them run eager."""
    if report.recompute == "selective":  # Inductor's kernels write into the outputs selective checkpointing saved
        report.fallbacks.append("compile: not applied under selective recomputation (Inductor's kernels write into "
                                "the tensors it saves); the module runs eager where the plan prices it compiled")
        return
    if not report.recomputed and not report.host_activations:
        module.compile()
        report.compiled.append("(the whole module)")
        return
    keys = module_keys(module)
    for group in graph.layers:
        for i in group.indices:
            found = layer_module(f"{group.prefix}.{i}", module, keys)
            if found is None:
                report.fallbacks.append(f"compile: layer {group.prefix}.{i} has no module here: it runs eager")
                continue
            if found[0] in report.host_activations:
                report.fallbacks.append(f"compile: layer {found[0]} runs eager (its saved activations go to the host "
                                        "through saved-tensor hooks)")
                continue
            found[1].compile()
            report.compiled.append(found[0])
    report.fallbacks.append("compile: per layer, the plan recomputing layers; what is outside them (embedding, head, "
                            "loss) runs eager where the plan prices it compiled")


def inductor_missing(device_type: str) -> str:
    """Why torch.compile's Inductor cannot build kernels for `device_type` here; "" where it can."""
    try:
        import torch._inductor.config  # noqa: F401
    except Exception as e:  # a torch built without it
        return f"this torch has no Inductor ({type(e).__name__}: {e})"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return "" if has_triton() else "Inductor needs triton for CUDA kernels and it is not installed (pip install triton)"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:
        return f"Inductor needs a C++ compiler for CPU kernels and finds none ({type(e).__name__}); install g++ or set CXX"
    return ""

