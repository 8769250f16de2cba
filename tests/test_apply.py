"""`meshplan.apply` on the user's own module: a transformers GPT-2 / Llama `nn.Module` (not the ONNX
interpreter), distributed as a plan of its exported graph says, on 2 gloo ranks (HSDP and dp_shard x tp
on 4).

The check is independent of meshplan's executor: one process trains the same transformers module
(same seed, same full batch, plain eager torch) and the distributed loss, every gradient and every
parameter after one AdamW step must equal it (< 1e-5). The collectives the step runs are counted and
must equal the ones the apply report derives from the plan; the parameters' names in `state_dict()`
must be the module's own.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from core.errors import MeshplanError

B, S = 8, 32
# Megatron's MLP forced by pins: the up projections split by output features, the down projection by
# input features, and the hidden activation between them split on its last dim.
TP_PINS = {
    "gpt2-tiny": {**{f"model.transformer.h.{i}.mlp.c_fc.weight": "S(1)" for i in (0, 1)},
                  **{f"model.transformer.h.{i}.mlp.c_proj.weight": "S(0)" for i in (0, 1)},
                  "mul_204": "S(2)", "ids": "R"},
    "llama-tiny": {**{f"model.model.layers.{i}.mlp.{p}.weight": "S(0)" for i in (0, 1) for p in ("gate_proj", "up_proj")},
                   **{f"model.model.layers.{i}.mlp.down_proj.weight": "S(1)" for i in (0, 1)},
                   "mul_362": "S(2)", "ids": "R"},
}
# The weights pinned split and the MLPs' hidden activations (c_fc's outputs) whole: the weights are
# stored split and gathered for use, which module-boundary hooks cannot run: `apply` falls back.
GATHERED_PINS = {**{f"model.transformer.h.{i}.mlp.{m}.weight": d for i in (0, 1) for m, d in (("c_fc", "S(1)"),
                                                                                           ("c_proj", "S(0)"))},
                 "addmm_2": "R", "addmm_6": "R"}
PLANS: dict[str, dict[str, Any]] = {"dp": {"mode": "data-parallel", "zero_stage": 0}, "tp": {"mode": "semi"},
                                    "gathered": {"mode": "semi", "pins": GATHERED_PINS},
                                    "zero3": {"layout": "dp_shard=2", "zero_stage": 3},
                                    "zero1": {"mode": "data-parallel", "zero_stage": 1},
                                    "zero2": {"mode": "data-parallel", "zero_stage": 2},
                                    "recompute": {"mode": "data-parallel", "zero_stage": 0, "recompute": "full"},
                                    "selective": {"mode": "data-parallel", "zero_stage": 0, "recompute": "selective"},
                                    "selective-compiled": {"mode": "data-parallel", "zero_stage": 0,
                                                           "recompute": "selective", "runtime": "compiled"},
                                    # amp: the loop runs forward and loss under report.autocast() (bf16)
                                    "dp-amp": {"mode": "data-parallel", "zero_stage": 0, "dtype": "amp"},
                                    "tp-amp": {"mode": "semi", "dtype": "amp"},
                                    # mixed under fully_shard: its MixedPrecisionPolicy(bf16, fp32) casts
                                    "zero3-mixed": {"layout": "dp_shard=2", "zero_stage": 3, "dtype": "mixed"},
                                    # compiled runtime: each block through torch.compile (Inductor's CPU kernels)
                                    "zero3-compiled": {"layout": "dp_shard=2", "zero_stage": 3, "runtime": "compiled"},
                                    "recompute-compiled": {"mode": "data-parallel", "zero_stage": 0, "recompute": "full",
                                                           "runtime": "compiled"},
                                    # HSDP on 4 ranks: whole over dp_replicate, split over dp_shard
                                    "hsdp": {"layout": "dp_replicate=2,dp_shard=2", "zero_stage": 3},
                                    # every layer and the root under CPUOffloadPolicy (a no-op move on CPU ranks)
                                    "zero3-offload": {"layout": "dp_shard=2", "zero_stage": 3,
                                                      "offload": "params,optimizer"},
                                    # every layer's saved activations copied to the host and back (CPU to CPU)
                                    "zero3-activations": {"layout": "dp_shard=2", "zero_stage": 3,
                                                          "offload": "activations", "recompute": "none"},
                                    # mixtures of experts: the experts split over ep=2 (borrowed from dp_shard), the
                                    # rest FSDP over it
                                    "ep": {"layout": "dp_shard=2,ep=2", "zero_stage": 3, "recompute": "none"},
                                    # HSDP's replicas beside ep on 4 ranks: the experts' gradients all-reduced
                                    # over the replicas holding the same experts
                                    "ep-hsdp": {"layout": "dp_replicate=2,dp_shard=2,ep=2", "zero_stage": 3,
                                                "recompute": "none"}}
RANKS = {"hsdp": 4, "ep-hsdp": 4}  # (the others: 2)


def hf_module(zoo_json: Path) -> Any:
    """The zoo's transformers model, with real (seeded) weights and no dropout."""
    import torch
    import transformers

    raw = dict(json.loads(zoo_json.read_text())["config"])
    model_type = raw.pop("model_type")
    raw.pop("transformers_version", None)
    config = transformers.AutoConfig.for_model(model_type, **raw)
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, k):
            setattr(config, k, 0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _data(vocab: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)


def _loss(module: Any, ids: Any, labels: Any) -> Any:
    import torch

    logits = module(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def applied(rank: int, port: int, world: int, strategy: str, zoo_json: str) -> Any:
    """In a rank's process: the gloo group joined, the zoo's transformers module built and the plan
    applied to it."""
    import torch
    import torch.distributed as dist

    import meshplan

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    module = hf_module(Path(zoo_json))
    meshplan.apply(module, strategy)
    return module


def worker(rank: int, port: int, strategy: str, zoo_json: str, out: Any, world: int = 2) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshplan
    from executor.measure import CollectiveCounter

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        module = hf_module(Path(zoo_json))
        names = sorted(module.state_dict())
        meshplan.apply(module, strategy)
        report = module.meshplan_report
        ids, labels = _data(module.config.vocab_size)
        ids, labels = report.batch_share(ids), report.batch_share(labels)  # this rank's rows
        optim = torch.optim.SGD(module.parameters(), lr=0.1)
        counter = CollectiveCounter()
        with counter:
            with report.autocast():
                loss = _loss(module, ids, labels)
            loss.backward()
        optim.step()
        total = loss.detach().clone()
        if report.dp_axis:  # (each share's loss held by its tensor-parallel ranks alike)
            dist.all_reduce(total)
            total /= world

        def full(t: Any) -> Any:
            return t.full_tensor() if isinstance(t, DTensor) else t

        grads = {n: full(p.grad).detach().numpy().copy() for n, p in module.named_parameters()}
        params = {n: full(p).detach().numpy().copy() for n, p in module.named_parameters()}
        if report.compiled:  # Dynamo's own count: the blocks ran as compiled graphs
            from torch._dynamo.utils import counters

            assert counters["stats"]["unique_graphs"] > 0, f"no graph compiled: {dict((k, dict(v)) for k, v in counters.items())} {report.compiled}"
        if report.host is not None:  # the copies ran (what the module saves is its own, not the graph's)
            assert report.host.peak_bytes > 0, report.host_activations
        if rank == 0:
            out.put(("report", float(total), grads, params, dict(counter.counts), dict(report.expected),
                     report.lines(), names, sorted(module.state_dict()), sorted(report.styles.items())))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def _run(strategy: Path, zoo_json: Path, world: int = 2) -> tuple[Any, ...]:
    from executor.ranks import run_ranks

    got: list[tuple[Any, ...]] = []

    def handle(msg: tuple[Any, ...]) -> bool:
        got.append(msg)
        return True

    run_ranks(worker, world, lambda r, port, q: (r, port, str(strategy), str(zoo_json), q, world), handle, timeout_s=240,
              error=MeshplanError, what="apply")
    return got[0]


def _plan(zoo: Callable[[str], Path], tmp: Path, name: str, kind: str) -> Path:
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    kw = dict(PLANS[kind])
    if kind.startswith("tp"):
        kw["pins"] = TP_PINS[name]
    s, _ = make_plan(PlanRequest(model=str(zoo(name)), dims={"batch": B, "seq": S}, profile="cpu",
                                 devices=RANKS.get(kind, 2), **kw))
    path = tmp / f"{name}-{kind}.json"
    s.save(path)
    return path


CASES = [(m, k) for m in ("gpt2-tiny", "llama-tiny") for k in ("dp", "tp", "zero3")] + \
    [("gpt2-tiny", "gathered"), ("llama-tiny", "zero1"), ("gpt2-tiny", "zero2"), ("gpt2-tiny", "recompute")] + \
    [("gpt2-tiny", k) for k in ("dp-amp", "tp-amp", "zero3-mixed")] + [(m, "hsdp") for m in ("gpt2-tiny", "llama-tiny")] + \
    [("llama-tiny", "zero3-compiled"), ("gpt2-tiny", "recompute-compiled")] + [(m, "selective") for m in ("gpt2-tiny", "llama-tiny")] + \
    [("gpt2-tiny", "selective-compiled"), ("gpt2-tiny", "zero3-offload")] + [(m, "zero3-activations") for m in
                                                                              ("gpt2-tiny", "llama-tiny")] + \
    [(m, k) for m in ("mixtral-tiny", "deepseek-v3-tiny") for k in ("ep", "ep-hsdp")]


# Heavier variants a lighter case covers (the same path on the other model, or compiled): `make check`.
EXTENDED = {("gpt2-tiny", "recompute-compiled"), ("gpt2-tiny", "selective"), ("gpt2-tiny", "selective-compiled"),
            ("llama-tiny", "zero3-compiled"), ("llama-tiny", "selective"), ("llama-tiny", "zero3-activations"),
            ("mixtral-tiny", "ep-hsdp"), ("deepseek-v3-tiny", "ep"), ("deepseek-v3-tiny", "ep-hsdp")}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kind"), [pytest.param(m, k, marks=pytest.mark.extended) if (m, k) in EXTENDED
                                            else (m, k) for m, k in CASES], ids=[f"{m}-{k}" for m, k in CASES])
def test_apply_equals_one_process(name: str, kind: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    strategy = _plan(zoo, tmp_path, name, kind)
    zoo_json = zoo(name).with_suffix(".json")
    _, loss, grads, params, executed, expected, lines, names_before, names_after, styles = _run(strategy, zoo_json,
                                                                                                 RANKS.get(kind, 2))
    assert names_after == names_before  # nothing of the distribution leaks into the module's names
    ref = hf_module(zoo_json)
    ids, labels = _data(ref.config.vocab_size)
    optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    amp, mixed = kind.endswith("-amp"), kind.endswith("-mixed")
    if mixed:  # the policy's arithmetic in one process: a bf16 copy computes, its gradients cast to fp32
        import copy

        high = copy.deepcopy(ref)  # fp32's gradients, to tell the two apart
        _loss(high, ids, labels).backward()
        fp32_grads = {n: q.grad.numpy() for n, q in high.named_parameters()}
        low = copy.deepcopy(ref).to(torch.bfloat16)
        ref_loss = _loss(low, ids, labels)
        ref_loss.backward()
        for p, q in zip(ref.parameters(), low.parameters(), strict=True):
            p.grad = q.grad.float()
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):  # the one process in the same precision
            ref_loss = _loss(ref, ids, labels)
        ref_loss.backward()
    optim.step()
    # fp32: equal to rounding; amp: the bf16 tolerance `run --verify` states (loss 1e-3 of itself,
    # gradients 1e-2, SGD's parameters lr times that).
    tol_loss, tol_grad, tol_param = (1e-3 * abs(float(ref_loss)), 1e-2, 0.1 * 1e-2) if amp or mixed else (1e-5, 1e-5, 1e-5)
    if mixed:  # the loss itself is bf16 (logits in bf16): two runs agree to one bf16 step of it
        tol_loss = max(tol_loss, 2 ** -7 * abs(float(ref_loss)) * 1.01)
    assert abs(loss - float(ref_loss)) < tol_loss
    for n, p in ref.named_parameters():
        assert float(abs(grads[n] - p.grad.numpy()).max()) < tol_grad, n
        assert float(abs(params[n] - p.detach().numpy()).max()) < tol_param, n
    assert executed == expected, lines
    if amp:
        assert "precision: amp" in " ".join(lines)
        kind = kind.removesuffix("-amp")
    if mixed:
        assert "precision: mixed (fully_shard's MixedPrecisionPolicy" in " ".join(lines), lines
        ref_grads = {n: q.grad.numpy() for n, q in ref.named_parameters()}
        off_bf16 = max(float(abs(grads[n] - ref_grads[n]).max()) for n in grads)
        off_fp32 = max(float(abs(grads[n] - fp32_grads[n]).max()) for n in grads)
        assert off_bf16 < off_fp32, (off_bf16, off_fp32)  # bf16 arithmetic ran, not fp32's
        kind = kind.removesuffix("-mixed")
    if kind == "zero3-offload":  # each block a unit under the policy, and the root
        assert "offload: weights, gradients and optimizer states on the host (fully_shard's CPUOffloadPolicy) for 2 " \
               "layers and the root" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
    if kind == "zero3-activations":  # both blocks' forwards under the copying hooks, nothing falling back
        assert "activations on the host: 2 layers (what autograd saves copied there, back for backward)" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
    if kind == "tp":  # the MLPs run Megatron's column / row split, as pinned, with no fallback
        layers = "transformer.h" if name == "gpt2-tiny" else "model.layers"
        up = ("c_fc",) if name == "gpt2-tiny" else ("gate_proj", "up_proj")
        down = "c_proj" if name == "gpt2-tiny" else "down_proj"
        assert dict(styles) == {**{f"{layers}.{i}.mlp.{u}": "colwise" for i in (0, 1) for u in up},
                                **{f"{layers}.{i}.mlp.{down}": "rowwise" for i in (0, 1)}}
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
        assert executed == {"all_reduce": 4}  # per layer: the row split's output, the column split's input grad
    if kind == "gathered":  # replicated over the axis, as the report says; no collective left to run
        assert [ln for ln in lines if ln.startswith("fallback: 'dp': the plan re-places model.transformer.h.0.mlp")]
        assert executed == {} and styles == []
    if kind == "selective-compiled":  # Inductor's kernels would write into what SAC saved: eager, said
        assert [ln for ln in lines if ln.startswith("fallback: compile: not applied under selective")], lines
        assert not [ln for ln in lines if ln.startswith("compiled")], lines
        lines = [ln for ln in lines if not ln.startswith("fallback: compile")]
        kind = "selective"
    if kind == "selective":  # op-level selective checkpointing on both layers, nothing falling back
        assert "recomputed: 2 modules (selective: attention's and every other matmul's outputs saved)" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
    if kind in ("dp", "recompute", "selective"):
        assert executed == {"all_reduce": 1}  # one gradient bucket
    if kind == "recompute":  # both layers recomputed, as planned: checkpoint on each block
        assert "recomputed: 2 modules" in lines, lines
    if kind in ("zero1", "zero2"):  # fully_shard keeping its gathered parameters for backward: the plan's
        # reduce-scatter of the gradients and gather of the parameters, states sharded (the parameters the
        # plan holds at stage 0 sharded with them: fully_shard shards a module's together)
        assert executed == {"all_gather": 1, "reduce_scatter": 1}
        assert f"ZeRO-{kind[-1]} as fully_shard(reshard_after_forward=False): parameters gathered once a step, " \
            "gradients reduce-scattered, optimizer states sharded; parameters sharded between steps" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback: ZeRO")], lines
    if kind == "zero3-compiled":  # the whole module compiled, in place (the names unchanged, checked above)
        assert "compiled: the whole module (torch.compile, Inductor)" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
        kind = "zero3"
    if kind == "recompute-compiled":  # the checkpointed layers compiled one by one; the rest eager, said
        assert "compiled: 2 layers (torch.compile, Inductor)" in lines, lines
        assert [ln for ln in lines if ln.startswith("fallback: compile: per layer")], lines
        kind = "recompute"
    if kind.startswith("ep"):  # each block's experts where they are: per block, the counts, dispatch and
        # combine forward, the two again backward (blocks counted in the graph, not by apply)
        from core.experts import find_expert_blocks
        from planner.graph import load_graph

        blocks = len(find_expert_blocks(load_graph(zoo(name), {"batch": B, "seq": S})))
        assert executed["all_to_all"] == 5 * blocks, executed
        assert f"expert parallel over ep=2: {blocks} experts modules split, tokens sent to their experts and back " \
            "(all_to_all_single; none dropped, as the module drops none)" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
        rest = {k: v for k, v in executed.items() if k != "all_to_all"}
        want = {"ep": {"all_gather": 2, "reduce_scatter": 1},
                # HSDP's, and each expert weight's gradient all-reduced over the replicas holding it
                "ep-hsdp": {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1 + len(
                    [n for n in names_after if n.rsplit(".", 1)[0].endswith(".experts")])}}
        assert rest == want[kind], (rest, lines)
    if kind == "zero3":
        assert executed == {"all_gather": 2, "reduce_scatter": 1}  # gathered for forward, again for backward
    if kind == "hsdp":  # and the shard's gradient all-reduced over the replicas; nothing else falls back
        assert executed == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
        assert "data parallel: fully_shard (HSDP) over dp_replicate+dp_shard" in lines, lines
        assert not [ln for ln in lines if ln.startswith("fallback")], lines


def test_bind_refuses_another_model(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """A strategy for another model: one line naming the first parameter that does not match."""
    from executor.binding import ApplyError, bind_parameters
    from planner.graph import load_graph
    from planner.strategy import load_strategy

    strategy = load_strategy(_plan(zoo, tmp_path, "gpt2-tiny", "dp"))
    graph = load_graph(zoo("gpt2-tiny"), dict(strategy.model.dims))
    llama = hf_module(zoo("llama-tiny").with_suffix(".json"))
    with pytest.raises(ApplyError, match=r"^strategy parameter model\.transformer\.wpe\.weight \[64, 64\] has no "
                                         r"parameter in the module; plan the ONNX exported from this module") as e:
        bind_parameters(strategy, graph, llama)
    assert "\n" not in str(e.value)
    gpt2 = hf_module(zoo("gpt2-tiny").with_suffix(".json"))
    bindings = {b.onnx: b.fqns for b in bind_parameters(strategy, graph, gpt2)}
    # The exporter's wrapper prefix is gone; the tied embedding is one parameter under both names.
    assert bindings["model.lm_head.weight"] == ("transformer.wte.weight", "lm_head.weight")
    assert bindings["model.transformer.h.1.mlp.c_proj.bias"] == ("transformer.h.1.mlp.c_proj.bias",)
    import torch

    wider = hf_module(zoo("gpt2-tiny").with_suffix(".json"))
    wider.transformer.h[1].mlp.c_fc.weight = torch.nn.Parameter(torch.zeros(64, 128))
    with pytest.raises(ApplyError, match=r"^parameter transformer\.h\.1\.mlp\.c_fc\.weight: the module's shape is "
                                         r"\[64, 128\], the strategy's model\.transformer\.h\.1\.mlp\.c_fc\.weight "
                                         r"is \[64, 256\]"):
        bind_parameters(strategy, graph, wider)
    extra = hf_module(zoo("gpt2-tiny").with_suffix(".json"))
    extra.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(ApplyError, match=r"^module parameter scale \[3\] is not in the strategy"):
        bind_parameters(strategy, graph, extra)


def test_apply_needs_process_group(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    import meshplan
    from executor.binding import ApplyError

    path = _plan(zoo, tmp_path, "gpt2-tiny", "dp")
    with pytest.raises(ApplyError, match=r"needs torch\.distributed initialised"):
        meshplan.apply(hf_module(zoo("gpt2-tiny").with_suffix(".json")), str(path))


@pytest.mark.slow
def test_example_trains_under_torchrun(tmp_path: Path) -> None:
    """examples/train_hf.py as a user runs it: torchrun, 2 ranks; it exports, plans, applies, trains."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "train_hf.py"
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(script), "--model", "llama", "--steps", "2",
                        "--layout", "dp_shard=2", "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "apply: data parallel: fully_shard over dp_shard" in r.stdout and "step 1: loss" in r.stdout, r.stdout


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_micro_batches_keep_parameters_gathered_to_the_last(zero: int) -> None:
    # ZeRO-1/2 as fully_shard over k = 3 micro-batches: the parameters stay gathered until the last
    # micro-batch's backward reshards them for the optimizer step (never resharded, the next step's
    # forward would reuse the pre-step weights); ZeRO-1 reduce-scatters on the last only, ZeRO-2 every one.
    from executor.apply import ApplyReport

    calls: list[tuple[str, bool]] = []

    class Module:
        def set_reshard_after_backward(self, flag: bool) -> None:
            calls.append(("reshard", flag))

        def set_requires_gradient_sync(self, flag: bool) -> None:
            calls.append(("sync", flag))

    report = ApplyReport(data_parallel="fully_shard", dp_axis="dp", tp_axis=None, micro_batches=3, zero_stage=zero)
    for i in range(3):
        report.micro_batch(Module(), i)  # type: ignore[arg-type]
    reshard = [f for k, f in calls if k == "reshard"]
    sync = [f for k, f in calls if k == "sync"]
    assert reshard == [False, False, True]
    assert sync == ([False, False, True] if zero == 1 else [])


def test_compile_without_inductor_is_refused_before_any_step(zoo: Callable[[str], Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=True where Inductor cannot build kernels (here: no C++ compiler for CPU kernels): one line,
    from apply, before the module is touched."""
    import torch._inductor.config as inductor

    import meshplan
    from executor.binding import ApplyError

    monkeypatch.setattr(inductor.cpp, "cxx", ("no-such-c++-compiler",))
    module = hf_module(zoo("gpt2-tiny").with_suffix(".json"))
    with _alone():
        from planner.search.plan import make_plan
        from planner.search.request import PlanRequest

        s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": B, "seq": S}, profile="cpu",
                                     devices=1))
        with pytest.raises(ApplyError, match=r"^compile: Inductor needs a C\+\+ compiler for CPU kernels and finds "
                                             r"none \(InvalidCxxCompiler\); install g\+\+ or set CXX; apply without "
                                             r"compile=True") as e:
            meshplan.apply(module, s, compile=True)
        assert "\n" not in str(e.value)
        assert not hasattr(module, "meshplan_report") and module._compiled_call_impl is None


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """A gloo process group of this process alone (apply needs one), destroyed after."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_hsdp_beside_tensor_parallelism_is_refused_before_any_step(zoo: Callable[[str], Path]) -> None:
    """dp_replicate × dp_shard × tp (8 ranks, not run here): one line naming the three axes, from the
    strategy alone — before the world size is checked, the module is touched or any step runs. (The MLP's
    plan: Llama's on 8 devices takes minutes to plan.)"""
    import meshplan
    from executor.binding import ApplyError
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    s, _ = make_plan(PlanRequest(model=str(zoo("mlp")), dims={"batch": 8}, profile="cpu", devices=8,
                                 layout="dp_replicate=2,dp_shard=2,tp=2", zero_stage=3))
    module = hf_module(zoo("llama-tiny").with_suffix(".json"))
    with _alone():
        with pytest.raises(ApplyError, match=r"^apply runs two data-parallel axes \(HSDP\) without a tensor-parallel "
                                             r"one; this plan has 'dp_replicate', 'dp_shard' and 'tp'") as e:
            meshplan.apply(module, s)
        assert "\n" not in str(e.value) and not hasattr(module, "meshplan_report")


def _dp_tp_pins(name: str) -> dict[str, str]:
    """Megatron-LM's split on the tensor-parallel axis, batch on dp_shard: the linears' outputs column-
    and row-wise (weights left to the layout), and for Llama sequence parallelism — the residual stream
    and the norms split on the sequence between the blocks' matmuls."""
    pins = {"ids": "S(0),R"}
    if name == "llama-tiny":
        order = ("q", "k", "v", "o", "gate", "up", "down")  # the exported linears, in order, per layer
        for j in range(14):
            pins["linear" if j == 0 else f"linear_{j}"] = "S(0),P" if order[j % 7] in ("o", "down") else "S(0),S(2)"
        for t in ("mul_116", "mul_349", "mul_385", "mul_618", "add_358", "add_408", "add_627", "add_677", "pow_1",
                  "mul_654"):
            pins[t] = "S(0),S(1)"
    else:  # GPT-2's MLPs (its fused QKV projection is split across heads' boundary: left to the plan)
        pins.update({"view_11": "S(0),S(2)", "view_24": "S(0),S(2)", "view_13": "S(0),P", "view_26": "S(0),P"})
    return pins


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize(("name", "layout", "zero"), [("llama-tiny", "dp_shard=2,tp=2", 3),
                                                    ("gpt2-tiny", "dp_shard=2,tp=2", 3),
                                                    ("llama-tiny", "dp_replicate=2,tp=2", 0)])
def test_data_by_tensor_parallel_equals_one_process(name: str, layout: str, zero: int, zoo: Callable[[str], Path],
                                                    tmp_path: Path) -> None:
    """dp_shard=2 x tp=2 on 4 gloo ranks: fully_shard over dp_shard on the DTensor shards tensor
    parallelism made over tp (Llama: column/row-wise linears, norms on sequence shards, the loss on
    gathered logits); dp_replicate=2 x tp=2 (DDP beside tp): FSDP2's replicate over dp_replicate on those
    DTensors, the gradients all-reduced once. Each equal to one process training the same module,
    nothing falling back."""
    import torch

    from planner.search.plan import make_plan
    from planner.search.request import Mode, PlanRequest

    s, _ = make_plan(PlanRequest(model=str(zoo(name)), dims={"batch": B, "seq": S}, profile="h100-sxm", dtype="fp32",
                                 devices=4, layout=layout, zero_stage=zero, mode=Mode.SEMI, pins=_dp_tp_pins(name)))
    strategy = tmp_path / "s.json"
    s.save(strategy)
    zoo_json = zoo(name).with_suffix(".json")
    _, loss, grads, params, executed, expected, lines, names_before, names_after, styles = _run(strategy, zoo_json, 4)
    assert names_after == names_before
    assert not [ln for ln in lines if ln.startswith("fallback")], lines
    dp = layout.split("=")[0]
    assert f"data parallel: {'fully_shard' if zero == 3 else 'replicate'} over {dp}" in lines, lines
    ref = hf_module(zoo_json)
    ids, labels = _data(ref.config.vocab_size)
    optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = _loss(ref, ids, labels)
    ref_loss.backward()
    optim.step()
    assert abs(loss - float(ref_loss)) < 1e-5
    for n, p in ref.named_parameters():
        assert float(abs(grads[n] - p.grad.numpy()).max()) < 1e-5, n
        assert float(abs(params[n] - p.detach().numpy()).max()) < 1e-5, n
    roles = dict(styles)
    if name == "llama-tiny":
        assert {roles[f"model.layers.{i}.{m}"] for i in (0, 1) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")} == {"colwise"}
        assert {roles[f"model.layers.{i}.{m}"] for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")} == {"rowwise"}
        assert {roles[f"model.layers.{i}.{m}"] for i in (0, 1) for m in
                ("input_layernorm", "post_attention_layernorm")} == {"sequence"}
        # The plan's collectives on tp (read from the strategy; its all-to-all an all-gather on gloo) and
        # fully_shard's over dp_shard (replicate's one all-reduce over dp_replicate), counted as torch runs them
        assert executed == expected, (executed, expected)
    else:
        assert {roles[f"transformer.h.{i}.mlp.{m}"] for i in (0, 1) for m in ("c_fc", "c_proj")} == {"colwise", "rowwise"}
