"""The executor's ONNX interpreter reproduces the exported torch modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import zoo as zoo_mod
from executor.interpreter import load_module


@pytest.mark.parametrize("name", zoo_mod.SMALL)
def test_interpreter_equals_torch_module(name: str, zoo: Callable[[str], Path]) -> None:
    entry = zoo_mod.ZOO[name]
    path = zoo(name)
    torch.manual_seed(0)  # the zoo's export recipe: same seed, same build → same weights
    model, _ = entry.build()
    model.eval()
    if entry.exporter == "legacy":
        zoo_mod._randomize_norm_state(model)
    dims = entry.default_dims
    x = zoo_mod._example(replace(entry, example_dims=dims), "cpu")
    with torch.no_grad():
        expected = model(x)
        got = load_module(path, dims)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_shape_only_models_init_identically(zoo: Callable[[str], Path]) -> None:
    a = load_module(zoo("gpt2-medium"), {"batch": 1, "seq": 8})
    b = load_module(zoo("gpt2-medium"), {"batch": 1, "seq": 8})
    name = "model.transformer.h.3.attn.c_attn.weight"
    assert torch.equal(a.parameter(name), b.parameter(name))
    assert sum(p.numel() for p in a.parameters()) == zoo_mod.metadata("gpt2-medium")["num_params"]


@pytest.mark.parametrize("name,layers", [("gpt2-tiny", 2), ("bert-tiny", 2), ("llama-tiny", 2), ("vit-tiny", 2)])
def test_attention_runs_fused_and_keeps_no_scores(name: str, layers: int, zoo: Callable[[str], Path]) -> None:
    # Every layer's exporter-decomposed attention runs as one SDPA kernel (its equality with the torch
    # module is the test above); backward then keeps no s×s score or probability tensor.
    module = load_module(zoo(name), zoo_mod.ZOO[name].default_dims)
    assert len(module.regions) == layers
    g = module.graph
    x = [torch.randint(0, 2, g.tensors[t].shape) if not g.tensors[t].is_float else torch.randn(g.tensors[t].shape)
         for t in g.inputs]
    seq = {g.tensors[r.out].shape[-2] for r in module.regions.values()}
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = module(*x)
    assert y.requires_grad
    assert not [s for s in saved if len(s) == 4 and s[-1] == s[-2] and s[-1] in seq and s[1] > 1]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "convnet", "mlp"])
def test_saved_activations_are_what_torch_saves(name: str, zoo: Callable[[str], Path]) -> None:
    # The cost model's activation memory (`costmodel.memory.saved_tensors`: what each op's backward
    # reads, by storage) against the storages torch's autograd actually saves running the graph op by
    # op, matched to graph tensors by storage: the same set. Parameters (and views of them) and the
    # module's folded constants are model states or held anyway; what torch saves that no graph tensor
    # names (LayerNorm's mean and rstd, SDPA's log-sum-exp, embedding indices) is under 10%.
    import math

    from costmodel.memory import saved_tensors
    from executor.ops import fused_attention, run_op

    module = load_module(zoo(name), zoo_mod.ZOO[name].default_dims)
    g = module.graph
    env: dict[str, object] = dict(module.values)
    env.update(zip(g.inputs, [torch.randn(g.tensors[t].shape) if g.tensors[t].is_float else
                              torch.randint(0, 2, g.tensors[t].shape) for t in g.inputs], strict=True))
    env.update({n: module.params[k] for n, k in module.param_names.items()})
    fixed = {v.untyped_storage().data_ptr() for k, v in env.items() if isinstance(v, torch.Tensor) and k not in g.inputs}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in fixed:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    named: dict[int, str] = {}
    for t in g.inputs:
        named.setdefault(env[t].untyped_storage().data_ptr(), t)  # type: ignore[union-attr]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for node in g.compute_nodes:
            if node.name in module.fused_away:
                continue
            r = module.regions.get(node.name)
            outs = [fused_attention(env[r.q], env[r.kt], env.get(r.mask) if r.mask else None, env[r.v])] \
                if r is not None else run_op(node, [env.get(t) if t else None for t in node.inputs])
            for t, v in zip(node.outputs, outs, strict=False):
                env[t] = v
                if isinstance(v, torch.Tensor):
                    named.setdefault(v.untyped_storage().data_ptr(), t)
    torch_named = {named[k] for k in saved if k in named}
    model = set(saved_tensors(g))
    assert torch_named == model
    assert sum(math.prod(g.tensors[t].shape) * 4 for t in model) == sum(saved[k] for k in saved if k in named)
    assert sum(b for k, b in saved.items() if k not in named) < 0.1 * sum(saved.values())


def test_rank_device_follows_the_backend() -> None:
    """torchrun with nccl: each rank computes on its LOCAL_RANK's GPU; gloo: on the CPU. (No GPU on
    this machine: the selection is tested here, the GPU run is not.)"""
    import torch

    from executor.step import rank_device

    assert rank_device("nccl", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert rank_device("nccl", {}) == torch.device("cuda", 0)
    assert rank_device("gloo", {"LOCAL_RANK": "3"}) == torch.device("cpu")


def test_module_moves_parameters_and_constants(zoo: Callable[[str], Path]) -> None:
    import torch

    from executor.interpreter import load_module

    m = load_module(zoo("gpt2-tiny"), {"batch": 2, "seq": 8}).to_device(torch.device("meta"))
    assert all(p.device.type == "meta" for p in m.parameters())
    assert all(v.device.type == "meta" for v in m.values.values() if isinstance(v, torch.Tensor))
