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
