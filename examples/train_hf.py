"""Train a transformers model with a meshplan plan applied to the module itself.

    torchrun --nproc-per-node 2 examples/train_hf.py                     # GPT-2, tiny, gloo on CPU
    torchrun --nproc-per-node 2 examples/train_hf.py --model llama --layout dp_shard=2
    torchrun --nproc-per-node 4 examples/train_hf.py --model llama --layout pp=2,dp_shard=2   # a pipeline
    torchrun --nproc-per-node 4 examples/train_hf.py --layout dp_shard=2,tp=2   # fully_shard over tensor parallelism
    torchrun --nproc-per-node 8 examples/train_hf.py --config my/config.json --profile h100-sxm  # nccl
    torchrun --nproc-per-node 1 examples/train_hf.py --config my/config.json --profile h100-sxm --runtime compiled

Rank 0 exports the config's model shape-only (`meshplan export`: no weights are made) and plans it
(`meshplan plan`); every rank then builds the model (its own weights: random here, a checkpoint in
real use), hands it to `meshplan.apply` with the plan, and trains with plain eager torch: the
module's forward and backward run the plan's data / tensor parallelism and ZeRO through torch's own
DDP, fully_shard and DTensor. On GPUs (CUDA visible) it uses nccl, one GPU per rank; otherwise gloo.
A bad config, plan or mesh stops with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import meshplan
from core.errors import MeshplanError

TINY = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0},
}


def parser(description: str, workdir: str) -> argparse.ArgumentParser:
    """The flags every example here takes: the batch, the plan's levers, where to write."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (all ranks together)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch-size", type=int, help="a pipeline's sequences per micro-batch and data-parallel rank")
    ap.add_argument("--profile", default="cpu", help="meshplan's hardware profile (h100-sxm, a100-80gb, …)")
    ap.add_argument("--layout", help="hold the plan to torchtitan degrees, e.g. dp_shard=2 (default: the ILP's)")
    ap.add_argument("--pin", action="append", default=[], help="TENSOR=PLACEMENTS, as for meshplan plan")
    ap.add_argument("--dtype", help="the plan's precision: amp (autocast bf16), mixed (FSDP2's bf16 policy), fp32, …")
    ap.add_argument("--runtime", choices=("eager", "compiled"), default="eager",
                    help="compiled: plan for torch.compile's fused kernels, and compile the module")
    ap.add_argument("--workdir", default=workdir)
    return ap


def main() -> None:
    ap = parser(__doc__.splitlines()[0], "meshplan-train-hf")
    ap.add_argument("--model", choices=sorted(TINY), default="gpt2", help="a tiny config of this family")
    ap.add_argument("--config", help="a transformers config.json instead")
    args = ap.parse_args()
    rank, world, device = start()
    work = Path(args.workdir).resolve()
    config_path = Path(args.config).resolve() if args.config else work / "config.json"
    onnx_path, strategy_path = work / "model.onnx", work / "strategy.json"
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        if not args.config:
            config_path.write_text(json.dumps(TINY[args.model]))
        _meshplan("export", "--hf-config", str(config_path), "-o", str(onnx_path))
        plan(args, onnx_path, strategy_path, world)
    dist.barrier()
    model = _build(config_path).to(device)
    train(model, strategy_path, args, lambda m, ids: m(input_ids=ids, labels=ids).loss, model.config.vocab_size)


def start() -> tuple[int, int, str]:
    """torchrun's process group: nccl and one GPU per rank where CUDA is visible, gloo otherwise."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size(), "cuda" if cuda else "cpu"


def plan(args: argparse.Namespace, onnx_path: Path, strategy_path: Path, world: int) -> None:
    """`meshplan plan` of the exported model on this run's ranks, with the flags' levers."""
    pipelined = bool(args.layout) and "pp=" in args.layout  # micro-batches of the global batch
    argv = ["plan", str(onnx_path), "--devices", str(world), "--dim", f"seq={args.seq}", "--profile", args.profile,
            "-o", str(strategy_path)]
    argv += ["--global-batch-size", str(args.batch)] if pipelined else ["--dim", f"batch={args.batch}"]
    argv += ["--micro-batch-size", str(args.micro_batch_size)] if pipelined and args.micro_batch_size else []
    argv += ["--layout", args.layout] if args.layout else []
    argv += ["--dtype", args.dtype] if args.dtype else []
    argv += ["--runtime", args.runtime] if args.runtime != "eager" else []
    argv += [a for p in args.pin for a in ("--pin", p)]
    print(_meshplan(*argv), flush=True)


def train(model: Any, strategy_path: Path, args: argparse.Namespace, loss_of: Callable[[Any, torch.Tensor], torch.Tensor],
          vocab: int) -> None:
    """The plan applied to `model` (every rank, the same weights) and `args.steps` AdamW steps on random
    tokens, each rank its data-parallel rows; `loss_of(model, ids)`: the next-token loss, where the plan
    has no pipeline (a pipeline's last stage computes `next_token_loss` on the logits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    # torch.compile where the plan's runtime is compiled; a pipelined plan's loss on its last stage
    meshplan.apply(model, str(strategy_path), loss_fn=next_token_loss)
    report = model.meshplan_report
    run = report.pipeline  # a pipelined plan: this rank's model chunks and the schedule
    if rank == 0:
        print("\n".join(f"apply: {line}" for line in report.lines()), flush=True)
    params = run.parameters() if run else model.parameters()
    optim = torch.optim.AdamW(params, lr=1e-3, fused=cuda)  # fused on GPUs, as the profile prices it
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        ids = report.batch_share(ids)  # a data loader's share: this rank's rows (the same on a tensor-parallel group)
        ids = ids.to("cuda" if cuda else "cpu")
        t0 = time.perf_counter()
        with report.autocast():  # the plan's precision: torch.autocast(bfloat16) for an amp plan
            if run:  # forward and backward of every micro-batch, by the plan's schedule
                loss = run.step(ids, target=ids)
            else:
                loss = loss_of(model, ids)
                loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()  # the step's kernels done, not only launched
        times.append(time.perf_counter() - t0)
        seen = loss.detach().clone()
        if report.dp_axis or run:  # every rank holds its replica's loss
            dist.all_reduce(seen)
            seen /= world
        if rank == 0:
            print(f"step {step}: loss {float(seen):.6f}  {1e3 * times[-1]:.1f} ms", flush=True)
    if rank == 0 and len(times) > 1:
        cost = json.loads(strategy_path.read_text())["cost"]
        line = (f"step time: median {1e3 * statistics.median(times[1:]):.1f} ms after the first step, the plan "
                f"predicted {1e3 * cost['step_time_s']:.1f} ms")
        if cuda:
            line += (f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, the plan predicted "
                     f"{cost['memory_bytes_per_device'] / 2**30:.2f} GiB")
        print(line, flush=True)
    # Every rank done with the collectives, and the module's hooks and communication state gone, before
    # the process groups are (gloo's worker threads must not outlive them at exit).
    dist.barrier()
    del model, optim, report
    gc.collect()
    dist.destroy_process_group()


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What `model(input_ids=ids, labels=ids).loss` computes: each position predicts the next token."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def _build(config_path: Path) -> Any:
    import transformers

    raw = json.loads(config_path.read_text())
    model_type = raw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights on every rank (fully_shard and FSDP2's replicate broadcast none)
    return transformers.AutoModelForCausalLM.from_config(config)


def _meshplan(*argv: str) -> str:
    """The `meshplan` command a user runs (the one installed beside this Python)."""
    exe = shutil.which("meshplan", path=str(Path(sys.executable).parent)) or shutil.which("meshplan")
    if exe is None:
        raise MeshplanError("the meshplan command is not installed; pip install -e . (make test does it)")
    r = subprocess.run([exe, *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise MeshplanError(f"meshplan {argv[0]}: {(r.stderr or r.stdout).strip().splitlines()[-1]}")
    return r.stdout.strip()


if __name__ == "__main__":
    try:
        main()
    except MeshplanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
