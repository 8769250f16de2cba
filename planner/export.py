"""Model → ONNX for meshplan: a user's nn.Module, or a transformers config, without materialising it.

The front of the flow, before `planner/graph.py`. Nobody can hold a 70B model's weights on a laptop,
and the planner needs none: a *shape-only* file declares every parameter and buffer as an
initializer (name, dtype, dims, `InputSpec.kind`) whose external data is absent. The module is
traced on the meta device with torch's dynamo exporter (`optimize=False`: the graph as the module
wrote it), with named dynamic dims (`batch`, `seq`) that `--dim` binds at plan time.

torch (and transformers, for `--hf-config`) are imported lazily: planning never needs them.

    export(module, (ids,), "m.onnx", dynamic=[("batch", "seq")])        # a user's own module
    export_hf_config("config.json", "m.onnx")                          # a transformers config
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import MeshplanError, ModelError, read_json
from planner.params import KIND_KEY
from planner.replicate import replicate_layers

# Dims a user names get these example sizes for the trace unless given (2: torch.export specialises 0 and 1).
_EXAMPLE_SIZES = {"batch": 2, "seq": 16}
# Deeper stacks are exported at 2 layers (after any first layers built otherwise) and the last repeated
# (planner/replicate.py): the same graph, seconds not minutes.
_REPEAT_ABOVE_LAYERS = 4


class ExportError(MeshplanError):
    """The module or config cannot be exported as asked."""


@dataclass(frozen=True, slots=True)
class ExportReport:
    path: Path
    num_params: int  # torch's sum(p.numel()), a tied weight once
    weights: bool  # False: shape-only
    seconds: float
    repeated_layers: str = ""  # "model.model.layers: 2 → 80" where the layers were repeated


def export(module: Any, example_inputs: Sequence[Any], path: str | Path, *,
           dynamic: Sequence[Sequence[str | None]] | None = None, weights: bool | None = None,
           dim_max: Mapping[str, int] | None = None) -> ExportReport:
    """Export `module` for meshplan. `dynamic`: per example input, a dim name or None per dim (the
    named dims stay symbolic; the same name is the same dim). `weights`: keep the values (default:
    True unless the module lives on the meta device); shape-only files declare them with no data."""

    t0 = time.perf_counter()
    path = Path(path)
    on_meta = any(p.is_meta for p in module.parameters())
    if weights is None:
        weights = not on_meta
    if weights and on_meta:
        raise ExportError("the module is on the meta device: it has no weights to save; pass weights=False")
    _export_file(module, example_inputs, path, dynamic=dynamic, weights=weights, dim_max=dim_max or {})
    return ExportReport(path, sum(p.numel() for p in module.parameters()), weights, time.perf_counter() - t0)


def _dynamic_shapes(example_inputs: Sequence[Any], dynamic: Sequence[Sequence[str | None]] | None,
                    dim_max: Mapping[str, int]) -> tuple[dict[int, Any], ...] | None:
    import torch

    if dynamic is None:
        return None
    if len(dynamic) != len(example_inputs):
        raise ExportError(f"dynamic names {len(dynamic)} input(s), the module takes {len(example_inputs)}")
    dims: dict[str, Any] = {}
    out = []
    for x, names in zip(example_inputs, dynamic, strict=True):
        if len(names) != x.dim():
            raise ExportError(f"dynamic {tuple(names)} names {len(names)} dims of an input with {x.dim()}")
        out.append({d: dims.setdefault(n, torch.export.Dim(n, max=dim_max.get(n, 1 << 20)))
                    for d, n in enumerate(names) if n})
    return tuple(out)


def _export_file(module: Any, example_inputs: Sequence[Any], path: Path, *, dynamic: Any, weights: bool,
                 dim_max: Mapping[str, int], repeat: tuple[str, int, int] | None = None) -> None:
    import onnx
    import torch

    module.eval()
    shapes = _dynamic_shapes(example_inputs, dynamic, dim_max)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with quiet():
        try:
            prog = torch.onnx.export(module, tuple(example_inputs), dynamo=True, dynamic_shapes=shapes,
                                     optimize=False)
        except Exception as e:  # torch.export's errors are long; the first line names the problem
            raise ExportError(f"torch.onnx.export failed: {str(e).strip().splitlines()[0][:300]}") from e
        assert prog is not None
        prog.save(str(tmp), include_initializers=weights)
    proto = onnx.load(str(tmp), load_external_data=False)
    if not weights:
        _declare_shape_only(proto, module, path)
    if repeat is not None:
        proto = replicate_layers(proto, *repeat)
    onnx.save(proto, str(tmp))
    tmp.replace(path)


def _declare_shape_only(proto: Any, module: Any, path: Path) -> None:
    """Every parameter and buffer the graph reads, declared as an initializer with absent data."""
    import onnx
    import torch

    g = proto.graph
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    produced = {o for n in g.node for o in n.output} | {i.name for i in g.initializer}
    read = {i for n in g.node for i in n.input if i and i not in produced}
    keep_inputs = [i for i in g.input if i.name not in params and i.name not in buffers]
    del g.input[:]
    g.input.extend(keep_inputs)
    data_file = path.with_suffix(".weights").name  # never written: the declarations point at absent data
    for name in sorted(read & (set(params) | set(buffers))):
        t = params.get(name, buffers.get(name))
        assert t is not None
        elem = onnx.helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=t.dtype).numpy().dtype)
        init = onnx.TensorProto(name=name, dims=list(t.shape), data_type=elem)
        init.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", data_file), ("offset", "0"), ("length", str(t.numel() * t.element_size()))):
            init.external_data.add(key=k, value=v)
        g.initializer.append(init)
        vi = onnx.helper.make_tensor_value_info(name, elem, list(t.shape))
        vi.metadata_props.add(key=KIND_KEY, value="PARAMETER" if name in params else "BUFFER")
        g.value_info.append(vi)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The exporter prints progress and warnings on every call; meshplan reports its own."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------------------------
# transformers configs


def load_hf_config(path: str | Path) -> Any:
    """A transformers config from a `config.json` (or the folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    raw = read_json(p, ModelError, "pass a transformers config.json")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelError(f"{p}: not a transformers config (no \"model_type\"); pass a model's config.json")
    try:
        import transformers
    except ImportError as e:
        raise ModelError("`hf_config` needs transformers: pip install 'meshplan[hf]'") from e
    raw = dict(raw)
    model_type = raw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as e:
        raise ModelError(f"{p}: transformers does not know model_type {model_type!r}; "
                         "upgrade transformers or pass another config") from e


def logits_module(model: Any, key: str) -> Any:
    """`forward(x) -> logits` around a transformers model: one tensor in (`key`), one out. The ONNX
    input is named `ids` for token models, `x` for images."""
    from torch import nn

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

    class TokenLogits(Logits):
        def forward(self, ids: Any) -> Any:
            return self.model(input_ids=ids, return_dict=False)[0]

    class ImageLogits(Logits):
        def forward(self, x: Any) -> Any:
            return self.model(**{key: x}, return_dict=False)[0]

    return TokenLogits() if key == "input_ids" else ImageLogits()


def hf_model(config: Any, *, num_layers: int | None = None) -> tuple[Any, str]:
    """The config's model on the meta device (weights never allocated), wrapped to take one tensor
    and return the logits; and the input it takes ("input_ids" or "pixel_values")."""
    import torch
    import transformers

    config.use_cache = False
    config._attn_implementation = "sdpa"
    # Mixture-of-experts layers as one batched matmul on each token's gathered expert weights: a graph of
    # static shapes (the default grouped-GEMM and per-expert loops depend on the routing), whose
    # experts `core/experts.py` recognises.
    config._experts_implementation = "batched_mm"
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    archs = [a for a in (getattr(config, "architectures", None) or []) if hasattr(transformers, a)]
    with torch.device("meta"):
        if archs:
            model = getattr(transformers, archs[0])(config)
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = transformers.AutoModel.from_config(config)
    key = "pixel_values" if getattr(model, "main_input_name", "input_ids") == "pixel_values" else "input_ids"
    return logits_module(model, key), key


def _layer_signature(layer: Any) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What makes two layers the same graph: their modules' types and their parameters' shapes."""
    mods = tuple((n, type(m).__name__, ()) for n, m in layer.named_modules())
    return mods + tuple((n, "param", tuple(p.shape)) for n, p in layer.named_parameters())


def _first_of_the_rest(layers: Any) -> int | None:
    """The index from which every layer is built alike (0: all of them; DeepSeek-V3: 3, after its dense
    layers), or None where the last two differ (layers alternating kinds)."""
    sigs = [_layer_signature(x) for x in layers]
    first = len(sigs) - 1
    while first > 0 and sigs[first - 1] == sigs[-1]:
        first -= 1
    return first if first <= len(sigs) - 2 else None


def _layer_list(module: Any) -> tuple[str, int] | None:
    """The module's stack of repeated layers: the longest ModuleList (its path and length)."""
    from torch import nn

    lists = [(name, len(m)) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=lambda x: x[1]) if lists else None


def export_hf_config(config_path: str | Path, path: str | Path, *, dims: Mapping[str, int | None] | None = None
                     ) -> ExportReport:
    """A shape-only export of a transformers `config.json` (see `export_config`)."""
    return export_config(load_hf_config(config_path), path, dims=dims)


def export_config(config: Any, path: str | Path, *, dims: Mapping[str, int | None] | None = None) -> ExportReport:
    """A shape-only export of a transformers config. `dims`: name → None (symbolic) or a static size;
    token models take (batch, seq), image models (batch, channels, height, width) with static images."""
    import copy

    import torch

    t0 = time.perf_counter()
    depth = int(getattr(config, "num_hidden_layers", 0) or 0)
    full, key = hf_model(copy.deepcopy(config))
    num_params = sum(p.numel() for p in full.parameters())
    layers = _layer_list(full)
    repeat = None
    traced = full
    first = _first_of_the_rest(full.get_submodule(layers[0])) if layers is not None and layers[1] == depth else None
    if layers is not None and first is not None and depth - first > _REPEAT_ABOVE_LAYERS:
        # The first layers as they are, two of the rest, the last repeated: if the shallower config
        # builds its layers as the full one does (a config listing each layer's kind might not).
        shallow, _ = hf_model(copy.deepcopy(config), num_layers=first + 2)
        full_layers, few = full.get_submodule(layers[0]), shallow.get_submodule(layers[0])
        if [_layer_signature(x) for x in few] == [_layer_signature(full_layers[i]) for i in range(first + 2)]:
            traced, repeat = shallow, (layers[0], depth, first)
    names, sizes = _input_dims(config, key, dims or {})
    if key == "input_ids":
        x = torch.zeros(sizes, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(sizes, device="meta")
    dim_max = {"seq": int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 20}
    _export_file(traced, (x,), Path(path), dynamic=[names], weights=False, dim_max=dim_max, repeat=repeat)
    note = f"{repeat[0]}: {repeat[2] + 2} → {repeat[1]}" if repeat else ""
    return ExportReport(Path(path), num_params, False, time.perf_counter() - t0, note)


def _input_dims(config: Any, key: str, dims: Mapping[str, int | None]) -> tuple[list[str | None], list[int]]:
    if key == "pixel_values":
        image = int(config.image_size)
        base: list[tuple[str, int | None]] = [("batch", None), ("channels", int(config.num_channels)),
                                              ("height", image), ("width", image)]
    else:
        base = [("batch", None), ("seq", None)]
    known = {n for n, _ in base}
    unknown = sorted(set(dims) - known)
    if unknown:
        raise ExportError(f"`dims` {', '.join(unknown)}: this model's input dims are {', '.join(n for n, _ in base)}")
    names: list[str | None] = []
    sizes: list[int] = []
    for n, static in base:
        given = dims.get(n, static)
        if given is None:  # dynamic
            names.append(n)
            sizes.append(_EXAMPLE_SIZES.get(n, 2))
        else:
            names.append(None)
            sizes.append(int(given))
    return names, sizes
