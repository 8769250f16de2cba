"""The model zoo: real architectures exported to ONNX, built in code, cached outside git.

transformers configs with random weights (nothing is downloaded) and hand-written torch modules.
Small models keep their weights (the executor trains them); large ones are *shape-only*: built on the
meta device and saved with every parameter declared (name, dtype, dims) as external data that is
absent, which is how 8B–70B graphs are planned on a laptop.

Each export writes `<name>.onnx` and `<name>.json` (the facts the tests check the importer against:
the torch parameter count with tied weights counted once, the default dims, the config).

    python -m bench.zoo [NAME ...] [--dir DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from planner.export import export as export_module
from planner.export import export_config, logits_module, quiet

# Bump when an export recipe changes: cached files of another version are rebuilt.
ZOO_VERSION = 3
DEFAULT_DIR = Path(os.environ.get("MESHPLAN_ZOO_DIR", Path.home() / ".cache" / "meshplan" / "zoo"))


# ---------------------------------------------------------------------------------------------
# Hand-written modules


class MLP(nn.Module):
    """Two-layer perceptron with GELU: the smallest model with a Megatron column/row answer."""

    def __init__(self, d_in: int = 64, d_hidden: int = 256, d_out: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


class ConvNet(nn.Module):
    """ResNet-style: stem, stages of basic blocks, global average pool, classifier.
    Written by hand because torchvision does not import beside the CPU torch build here."""

    def __init__(self, widths: tuple[int, ...] = (16, 32), blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, c = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(*[BasicBlock(c if b == 0 else w, w, 2 if (b == 0 and i > 0) else 1)
                                          for b in range(blocks)]))
            c = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


# ---------------------------------------------------------------------------------------------
# transformers builders (imported lazily: transformers is a zoo-only dependency)


def _gpt2(n_layer: int, n_embd: int, n_head: int, vocab: int, n_pos: int) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_pos,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa", use_cache=False)
    return logits_module(GPT2LMHeadModel(cfg), "input_ids"), cfg


def _llama(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int,
           max_pos: int) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=max_pos, rope_theta=500000.0, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa", use_cache=False)
    return logits_module(LlamaForCausalLM(cfg), "input_ids"), cfg


def _mixtral(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int, experts: int, top_k: int,
             max_pos: int) -> tuple[nn.Module, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, vocab_size=vocab, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=max_pos, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa", use_cache=False)
    cfg._experts_implementation = "batched_mm"  # a graph of static shapes (planner/export.py's `hf_model`)
    return logits_module(MixtralForCausalLM(cfg), "input_ids"), cfg


def _deepseek_v3_tiny() -> tuple[nn.Module, Any]:
    """DeepSeek-V3's structure at toy size: a dense first layer, then MoE layers of 8 routed experts
    (top-2, group-limited routing over 2 groups) beside one shared expert, multi-head latent attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=1, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                           q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, attn_implementation="sdpa", use_cache=False)
    cfg._experts_implementation = "batched_mm"
    return logits_module(DeepseekV3ForCausalLM(cfg), "input_ids"), cfg


def _deepseek_v3() -> tuple[nn.Module, Any]:
    """DeepSeek-V3 (671 B) from its published config: 61 layers (3 dense), 256 routed experts top-8 in 8
    groups (4 a token) beside one shared expert, multi-head latent attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=61, first_k_dense_replace=3, hidden_size=7168, intermediate_size=18432,
                           moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
                           vocab_size=129280, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                           n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                           qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096,
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                           attn_implementation="sdpa", use_cache=False)
    cfg._experts_implementation = "batched_mm"
    return logits_module(DeepseekV3ForCausalLM(cfg), "input_ids"), cfg


def _bert() -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     vocab_size=256, max_position_embeddings=64, attn_implementation="sdpa", pad_token_id=0)
    return logits_module(BertForMaskedLM(cfg), "input_ids"), cfg


def _vit() -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=128, num_labels=10, attn_implementation="sdpa")
    return logits_module(ViTForImageClassification(cfg), "pixel_values"), cfg


# ---------------------------------------------------------------------------------------------
# The catalogue


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooEntry:
    name: str
    build: Callable[[], tuple[nn.Module, Any]]  # the module and its config (a dict or a transformers config)
    input_kind: Literal["tokens", "image", "features"]
    input_dims: tuple[str | int, ...]  # symbolic names become dynamic dims
    example_dims: dict[str, int]  # values used for the export trace
    default_dims: dict[str, int]  # values a user would plan with
    vocab: int = 0
    with_weights: bool = True
    exporter: Literal["dynamo", "legacy"] = "dynamo"
    dim_max: dict[str, int] = field(default_factory=dict)
    description: str = ""


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(name="mlp", build=lambda: (MLP(), {"d_in": 64, "d_hidden": 256, "d_out": 64}),
                 input_kind="features", input_dims=("batch", 64), example_dims={"batch": 4},
                 default_dims={"batch": 32}, description="Linear-GELU-Linear, 33k params"),
        ZooEntry(name="mlp-legacy", build=lambda: (MLP(), {"d_in": 64, "d_hidden": 256, "d_out": 64}),
                 input_kind="features", input_dims=("batch", 64), example_dims={"batch": 4},
                 default_dims={"batch": 32}, exporter="legacy", description="the MLP, TorchScript exporter"),
        ZooEntry(name="convnet", build=lambda: (ConvNet(), {"widths": [16, 32], "blocks": 2}),
                 input_kind="image", input_dims=("batch", 3, 32, 32), example_dims={"batch": 2},
                 default_dims={"batch": 8}, description="ResNet-style, 2 stages × 2 basic blocks"),
        # The TorchScript exporter fails on transformers ≥5 models (aten::diff in the mask code), so
        # its samples are the hand-written modules.
        ZooEntry(name="convnet-legacy", build=lambda: (ConvNet(), {"widths": [16, 32], "blocks": 2}),
                 input_kind="image", input_dims=("batch", 3, 32, 32), example_dims={"batch": 2},
                 default_dims={"batch": 8}, exporter="legacy", description="the ConvNet, TorchScript exporter"),
        ZooEntry(name="gpt2-tiny", build=lambda: _gpt2(2, 64, 4, 256, 64), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 4, "seq": 32}, vocab=256, dim_max={"seq": 64},
                 description="GPT-2, 2 layers, h=64"),
        ZooEntry(name="gpt2-medium", build=lambda: _gpt2(24, 1024, 16, 50257, 1024), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 8, "seq": 1024}, vocab=50257, with_weights=False,
                 dim_max={"seq": 1024}, description="GPT-2 medium (355M), shape-only"),
        ZooEntry(name="bert-tiny", build=_bert, input_kind="tokens", input_dims=("batch", "seq"),
                 example_dims={"batch": 2, "seq": 16}, default_dims={"batch": 4, "seq": 32}, vocab=256,
                 dim_max={"seq": 64}, description="BERT masked LM, 2 layers, h=64"),
        ZooEntry(name="vit-tiny", build=_vit, input_kind="image", input_dims=("batch", 3, 32, 32),
                 example_dims={"batch": 2}, default_dims={"batch": 8}, description="ViT, 4×4 patches of 8px, h=64"),
        ZooEntry(name="llama-tiny", build=lambda: _llama(2, 64, 172, 4, 2, 256, 128), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 4, "seq": 32}, vocab=256, description="Llama, 2 layers, GQA 4/2 heads"),
        # Four layers: enough for 4 pipeline stages, or 2 stages × 2 interleaved chunks (pipeline tests).
        ZooEntry(name="gpt2-tiny-4l", build=lambda: _gpt2(4, 64, 4, 256, 64), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 4, "seq": 32}, vocab=256, dim_max={"seq": 64},
                 description="GPT-2, 4 layers, h=64"),
        ZooEntry(name="llama-tiny-4l", build=lambda: _llama(4, 64, 172, 4, 2, 256, 128), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 4, "seq": 32}, vocab=256, description="Llama, 4 layers, GQA 4/2 heads"),
        # Grouped-query attention as Llama-3 has it (4 query heads per KV head), 4 KV heads: one per rank
        # of 4 (`bench.run --only gqa`: k and v column-parallel by KV head against row-parallel).
        ZooEntry(name="llama-gqa", build=lambda: _llama(2, 256, 688, 16, 4, 512, 256), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 8, "seq": 128}, vocab=512, description="Llama, 2 layers, h=256, GQA 16/4 heads"),
        ZooEntry(name="llama3-8b", build=lambda: _llama(32, 4096, 14336, 32, 8, 128256, 8192),
                 input_kind="tokens", input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 16, "seq": 8192}, vocab=128256, with_weights=False,
                 description="Llama-3-8B, shape-only"),
        ZooEntry(name="llama3-70b", build=lambda: _llama(80, 8192, 28672, 64, 8, 128256, 8192),
                 input_kind="tokens", input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 16, "seq": 8192}, vocab=128256, with_weights=False,
                 description="Llama-3-70B, shape-only"),
        # The Llama-3 paper's 405B (Dubey et al. 2024, Table 3), for its published 128k-token stage
        # (bench/published_runs.toml).
        ZooEntry(name="llama3-405b", build=lambda: _llama(126, 16384, 53248, 128, 8, 128256, 131072),
                 input_kind="tokens", input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 16, "seq": 8192}, vocab=128256, with_weights=False,
                 description="Llama-3-405B, shape-only"),
        # Mixtures of experts (core/experts.py): Mixtral's 8 experts top-2, DeepSeek-V3's shared + routed.
        ZooEntry(name="mixtral-tiny", build=lambda: _mixtral(2, 64, 128, 4, 2, 256, 4, 2, 128), input_kind="tokens",
                 input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 4, "seq": 32}, vocab=256, description="Mixtral, 2 layers, 4 experts top-2"),
        ZooEntry(name="deepseek-v3-tiny", build=_deepseek_v3_tiny, input_kind="tokens", input_dims=("batch", "seq"),
                 example_dims={"batch": 2, "seq": 16}, default_dims={"batch": 4, "seq": 32}, vocab=256,
                 description="DeepSeek-V3 structure, 3 layers (1 dense), 8 routed + 1 shared expert top-2"),
        ZooEntry(name="mixtral-8x7b", build=lambda: _mixtral(32, 4096, 14336, 32, 8, 32000, 8, 2, 32768),
                 input_kind="tokens", input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
                 default_dims={"batch": 16, "seq": 4096}, vocab=32000, with_weights=False,
                 description="Mixtral-8x7B, shape-only"),
        ZooEntry(name="deepseek-v3", build=_deepseek_v3, input_kind="tokens", input_dims=("batch", "seq"),
                 example_dims={"batch": 2, "seq": 16}, default_dims={"batch": 16, "seq": 4096}, vocab=129280,
                 with_weights=False, description="DeepSeek-V3 671B, shape-only"),
    ]
}
# Llama-3-8B's width at other depths: the planner's time against layer count (bench only).
for _layers in (4, 8, 16, 80):
    ZOO[f"llama3-8b-{_layers}l"] = ZooEntry(
        name=f"llama3-8b-{_layers}l", build=lambda n=_layers: _llama(n, 4096, 14336, 32, 8, 128256, 8192),
        input_kind="tokens", input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16},
        default_dims={"batch": 16, "seq": 8192}, vocab=128256, with_weights=False,
        description=f"Llama-3-8B width, {_layers} layers, shape-only (benchmark)")
# GPT shapes of published runs (Megatron-LM SC'21, GPT-3, llm-foundry's MPT; ../shared/published-runs.md and
# bench/published_runs.toml), shape-only, for the pipeline search and the published-runs benchmarks:
# name → (layers, hidden, heads, vocab, sequence). A transformers GPT-2 of the size stands in for MPT
# (same matmuls; MPT has ALiBi and no biases) and for Megatron's GPT.
GPT_SHAPES = {"gpt-1.3b": (24, 2048, 16, 50257, 2048), "gpt3-175b": (96, 12288, 96, 50257, 2048),
              "gpt-145b": (80, 12288, 96, 51200, 2048), "gpt-1t": (128, 25600, 160, 51200, 2048),
              "gpt-1.7b": (24, 2304, 24, 51200, 2048), "gpt-7.5b": (36, 4096, 32, 51200, 2048),
              "gpt-18.4b": (40, 6144, 48, 51200, 2048), "gpt-175b": (96, 12288, 96, 51200, 2048),
              "mpt-1b": (24, 2048, 16, 50368, 2048), "mpt-7b": (32, 4096, 32, 50368, 2048),
              "mpt-7b-8k": (32, 4096, 32, 50368, 8192), "mpt-13b": (40, 5120, 40, 50368, 2048),
              "mpt-30b": (48, 7168, 56, 50368, 2048), "mpt-70b": (80, 8192, 64, 50368, 2048)}
for _name, (_n, _h, _heads, _vocab, _seq) in GPT_SHAPES.items():
    ZOO[_name] = ZooEntry(
        name=_name, build=lambda n=_n, h=_h, a=_heads, v=_vocab, q=_seq: _gpt2(n, h, a, v, q), input_kind="tokens",
        input_dims=("batch", "seq"), example_dims={"batch": 2, "seq": 16}, default_dims={"batch": 8, "seq": _seq},
        vocab=_vocab, with_weights=False, dim_max={"seq": _seq},
        description=f"GPT, {_n} layers, h={_h}, shape-only (benchmark)")
SMALL = [n for n, e in ZOO.items() if e.with_weights]
BENCH_ONLY = [n for n in ZOO if n.startswith("llama3-8b-") or n in GPT_SHAPES or n in ("deepseek-v3", "llama3-405b")]


# ---------------------------------------------------------------------------------------------
# Export


def _example(entry: ZooEntry, device: str) -> torch.Tensor:
    shape = [entry.example_dims[d] if isinstance(d, str) else d for d in entry.input_dims]
    g = torch.Generator().manual_seed(0)
    if entry.input_kind == "tokens":
        return torch.randint(0, entry.vocab, shape, generator=g).to(device)
    return torch.randn(shape, generator=g).to(device)


def _randomize_norm_state(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)


def _param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def export(name: str, out_dir: Path = DEFAULT_DIR, *, force: bool = False) -> Path:
    """Export zoo model `name` to `out_dir/<name>.onnx` (cached by ZOO_VERSION) and return the path.
    Dynamo exports go through `meshplan export`'s functions (planner/export.py): a module with its
    weights, or a transformers config shape-only (deep stacks exported at two layers and repeated)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # One exporter per model at a time: parallel test workers (pytest-xdist) ask for the same models.
    with open(out_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _export_locked(name, out_dir, force=force)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)


def _export_locked(name: str, out_dir: Path, *, force: bool) -> Path:
    entry = ZOO[name]
    path, meta_path = out_dir / f"{name}.onnx", out_dir / f"{name}.json"
    if not force and path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("zoo_version") == ZOO_VERSION and meta.get("torch") == torch.__version__:
            return path

    torch.manual_seed(0)
    device = "cpu" if entry.with_weights else "meta"
    t0 = time.perf_counter()
    with torch.device(device):
        model, config = entry.build()
    model.eval()
    x = _example(entry, device)
    tmp = path.with_suffix(".onnx.tmp")
    if entry.exporter == "legacy":
        axes = {i: d for i, d in enumerate(entry.input_dims) if isinstance(d, str)}
        _randomize_norm_state(model)  # else the exporter merges equal initializers (all-ones γ) into one
        with quiet():
            torch.onnx.export(model, (x,), str(tmp), dynamo=False, input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": axes}, opset_version=17, do_constant_folding=False)
        tmp.replace(path)
    elif entry.with_weights or isinstance(config, dict):
        names = [tuple(d if isinstance(d, str) else None for d in entry.input_dims)]
        export_module(model, (x,), path, dynamic=names, weights=entry.with_weights, dim_max=entry.dim_max)
    else:
        export_config(config, path)
    meta = {
        "zoo_version": ZOO_VERSION,
        "torch": torch.__version__,
        "name": name,
        "description": entry.description,
        "exporter": entry.exporter,
        "with_weights": entry.with_weights,
        "num_params": _param_count(model),
        "input_dims": list(entry.input_dims),
        "default_dims": entry.default_dims,
        "example_dims": entry.example_dims,
        "config": config if isinstance(config, dict) else config.to_diff_dict(),
        "export_s": round(time.perf_counter() - t0, 2),
    }
    meta_path.write_text(json.dumps(meta, indent=1, default=str))
    return path


def metadata(name: str, out_dir: Path = DEFAULT_DIR) -> dict[str, Any]:
    return json.loads((out_dir / f"{name}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"zoo models (default: all): {', '.join(ZOO)}")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--force", action="store_true", help="re-export even when cached")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in ZOO]
    if unknown:
        ap.error(f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(ZOO)}")
    for n in args.names or [n for n in ZOO if n not in BENCH_ONLY]:
        t0 = time.perf_counter()
        p = export(n, args.dir, force=args.force)
        print(f"{n:18s} {p}  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
