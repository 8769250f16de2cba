"""The published runs (bench/published_runs.toml) as data: each row's step time follows from its
published throughput by the source's own formula, and every model shape and profile it names exists.
Pricing them is `python -m bench.run --only published`; one row is priced here."""

from __future__ import annotations

import pytest

from bench.published import Run, price, runs
from bench.zoo import GPT_SHAPES
from core.layout import parse_layout
from hwprofiles.files import load_profile

ROWS = runs()


# The Llama 3 paper's 405B (Table 3): layers, model dim, FFN dim, query heads, KV heads, vocabulary.
LLAMA3_405B = (126, 16384, 53248, 128, 8, 128256)


def test_every_row_is_there_with_its_model_and_profile() -> None:
    assert [r.id for r in ROWS] == [*map(str, range(1, 17)), "17a", "17b", "17c", "18"]
    for r in ROWS:
        if r.source == "llama3":  # the long-context row: its own model, cp, and apart from the median
            assert (r.model, r.seq, r.cp_method, r.summary) == ("llama3-405b", 131072, "allgather", False)
            assert parse_layout(r.layout, r.gpus).context_parallel == 16
        else:
            assert r.model in GPT_SHAPES and GPT_SHAPES[r.model][4] == r.seq and r.summary, r.id
            assert r.source in ("llm-foundry", "sc21") and r.zero in (0, 3)
        assert load_profile(r.profile).device.peak_for(r.dtype) > 0
        assert r.global_batch % r.micro_batch == 0 and r.attention in ("flash", "fused-softmax")


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_published_step_follows_from_the_published_throughput(row: Run) -> None:
    value = float(row.published.split()[0].replace(",", ""))
    if row.source == "llm-foundry":  # tokens/s per GPU: step = global batch × seq ÷ (tok/s × GPUs)
        step = row.global_batch * row.seq / (value * row.gpus)
    elif row.source == "llama3":  # model FLOPs (6·N_matmul + 12·L·d·s per token) ÷ (TFLOP/s × GPUs)
        layers, d, ffn, heads, kv, vocab = LLAMA3_405B
        per_layer = 2 * d * d + 2 * d * (d // heads * kv) + 3 * d * ffn  # q, o; k, v; gate, up, down
        per_token = 6 * (layers * per_layer + d * vocab) + 12 * layers * d * row.seq
        step = row.global_batch * row.seq * per_token / (value * 1e12 * row.gpus)
    else:  # SC'21: F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) per iteration ÷ (TFLOP/s × GPUs)
        layers, h, _, vocab, _ = GPT_SHAPES[row.model]
        f = 96 * row.global_batch * row.seq * layers * h * h * (1 + row.seq / (6 * h) + vocab / (16 * layers * h))
        step = f / (value * 1e12 * row.gpus)
    assert step == pytest.approx(row.step_s, rel=0.02)


@pytest.mark.slow
def test_a_published_row_priced() -> None:
    # Row 12 (GPT 1.7B, 32 A100, DDP, full recomputation, Megatron's fused softmax): the run's own
    # layout priced on the a100-sxm preset; within the 35% bound of the published 3.53 s.
    row = next(r for r in ROWS if r.id == "12")
    strategy, _ = price(row)
    assert strategy.training.layout == "dp_replicate=32" and strategy.training.attention == "fused-softmax"
    assert abs(strategy.step_time_s - row.step_s) / row.step_s < 0.35
