"""meshplan's Python API: the functions a user calls from their own code (the CLI is `cli.py`).

    import meshplan
    meshplan.export(module, (ids,), "model.onnx", dynamic=[("batch", "seq")])   # then `meshplan plan`
    meshplan.apply(module, "strategy.json")   # under torchrun: the plan on the module itself

Importing this package imports no torch; the functions import it when called.
"""

from typing import Any

from planner.export import export, export_config, export_hf_config


def apply(module: Any, strategy: Any, mesh: Any = None, *, model: Any = None, compile: bool | None = None,
          loss_fn: Any = None) -> Any:
    """Distribute the user's `nn.Module` as `strategy` (a path or a `Strategy`) plans it, on the
    initialised process group; see `executor/apply.py`. `compile`: torch.compile (default: where the
    plan's runtime is `compiled`); `loss_fn(output, target)`: a pipelined plan's loss on its last stage.
    Returns the module."""
    from executor.apply import apply as _apply

    return _apply(module, strategy, mesh, model=model, compile=compile, loss_fn=loss_fn)


def save_checkpoint(path: Any, module: Any, optim: Any, steps: int) -> None:
    """Every rank: a module trained under `apply` saved in `meshplan run`'s sharded format (the graph's
    names); it loads under another plan, on the module or in `run`. See `executor/apply_checkpoint.py`."""
    from executor.apply_checkpoint import save_checkpoint as _save

    _save(path, module, optim, steps)


def load_checkpoint(path: Any, module: Any, optim: Any = None) -> int:
    """Every rank, after `apply`: the module's parameters (and AdamW's states) from a checkpoint of this
    model saved under any plan, by `save_checkpoint` or `run`; returns its optimizer steps."""
    from executor.apply_checkpoint import load_checkpoint as _load

    return _load(path, module, optim)


__all__ = ["apply", "export", "export_config", "export_hf_config", "load_checkpoint", "save_checkpoint"]
