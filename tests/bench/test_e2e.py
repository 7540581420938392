"""The end-to-end benchmark's code path on a tiny model on the CPU (timings there mean nothing)."""

from __future__ import annotations

import json

import pytest

from wide.bench.e2e import run_e2e_bench

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=101,
    max_position_embeddings=128,
)


def test_e2e_bench_records(tmp_path):
    rows = run_e2e_bench(
        str(tmp_path),
        shape=TINY,
        device="cpu",
        dtype=__import__("torch").float32,
        sparsities=(0.0, 0.5),
        batches=(1, 2),
        prompt=12,
        context=20,
        reps=1,
    )
    assert len(rows) == 6 and {r["variant"] for r in rows} == {"dense", "wide"}
    for r in rows:
        assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0
    half = [r for r in rows if r["variant"] == "wide" and r["sparsity"] == 0.5]
    for r in half:  # the fitted routers hit the target on the probe tokens
        assert 0.5 * (r["real_attn_sparsity"] + r["real_ffn_sparsity"]) == pytest.approx(0.5, abs=0.1)
    assert json.loads((tmp_path / "e2e-cpu.json").read_text())[0]["kind"] == "e2e"


def test_e2e_bench_fused_decode_is_recorded(tmp_path):
    """--fused-decode and --ffn-group-size reach the runtime (head_dim 32 here: the fused layer serves it) and
    the records say so."""
    rows = run_e2e_bench(
        str(tmp_path),
        shape=dict(TINY, hidden_size=128),
        device="cpu",
        dtype=__import__("torch").float32,
        sparsities=(0.5,),
        batches=(1,),
        prompt=8,
        context=12,
        reps=1,
        fused_decode=True,
        ffn_group_size=32,
    )
    assert len(rows) == 2 and all(r["tpot_ms"] > 0 for r in rows)
    meta = json.loads((tmp_path / "e2e-cpu.meta.json").read_text())
    assert meta["fused_decode"] is True and meta["ffn_group_size"] == 32
    assert [r["ffn_group_size"] for r in rows if r["variant"] == "wide"] == [32]


def test_e2e_bench_records_and_warns_a_limited_autotune(tmp_path, monkeypatch):
    """With WIDE_AUTOTUNE_MAX set the bench says its timings are not a deployment's, and the meta records the
    limit (0 when unset: every config tried)."""
    import torch

    kw = dict(shape=TINY, device="cpu", dtype=torch.float32, sparsities=(0.5,), batches=(1,), prompt=8, context=12)
    monkeypatch.setenv("WIDE_AUTOTUNE_MAX", "1")
    with pytest.warns(UserWarning, match="WIDE_AUTOTUNE_MAX=1"):
        run_e2e_bench(str(tmp_path), reps=1, **kw)
    assert json.loads((tmp_path / "e2e-cpu.meta.json").read_text())["autotune_max"] == 1
    monkeypatch.delenv("WIDE_AUTOTUNE_MAX")
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*WIDE_AUTOTUNE_MAX")
        run_e2e_bench(str(tmp_path), reps=1, **kw)
    assert json.loads((tmp_path / "e2e-cpu.meta.json").read_text())["autotune_max"] == 0


def test_decode_accounting_counts_the_step_reads(tmp_path):
    """Bytes per decode step: dense = every projection's weights + lm_head + the K/V rows of the context
    (counted here from the model's own parameters); WIDE at 50% through the fused layer reads less, from
    the step's masks; the unfused routed step keeps no masks (None). Kernel counts need a GPU."""
    import torch

    rows = run_e2e_bench(
        str(tmp_path), shape=dict(TINY, hidden_size=128), device="cpu", dtype=torch.float32, sparsities=(0.5,),
        batches=(2,), prompt=8, context=12, reps=1, fused_decode=True,
    )  # fmt: skip
    dense, wide = rows
    cfg = dict(TINY, hidden_size=128)
    d, hq, hk, df, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"], cfg["num_hidden_layers"]  # fmt: skip
    hd = d // hq
    weights = n * (2 * hq * hd * d + 2 * hk * hd * d + 3 * df * d) + cfg["vocab_size"] * d
    kv = n * 2 * (12 + 1) * hk * hd * 2  # batch 2, context 12 + the new token, K and V
    assert dense["bytes_read"] == (weights + kv) * 4  # fp32
    assert dense["tb_per_s"] == pytest.approx(dense["bytes_read"] / (dense["tpot_ms"] * 1e-3) / 1e12)
    assert wide["bytes_read"] < dense["bytes_read"]
    assert 0.0 <= wide["measured_attn_token_run"] <= wide["measured_attn_union_run"] <= 1.0
    assert dense["kernels_per_step"] is None and dense["kernels_per_layer"] is None  # CPU: no CUDA kernels
    unfused = run_e2e_bench(
        str(tmp_path), shape=TINY, device="cpu", dtype=torch.float32, sparsities=(0.5,), batches=(1,), prompt=8,
        context=12, reps=1,
    )  # fmt: skip
    assert unfused[0]["bytes_read"] is not None and unfused[1]["bytes_read"] is None


def test_decode_bytes_count_every_q_head_when_the_routers_overlap_qkv():
    """With router_overlap the fused QKV launch reads every Q row; O still reads only the union's."""
    import torch

    from tests.conftest import tiny_model
    from wide.bench.e2e import decode_bytes
    from wide.config import WideConfig
    from wide.kernels.fused_decode import launch_overrides
    from wide.model import WideModel
    from wide.runtime import WideRuntime

    model = tiny_model("llama", layers=2, hidden=128, heads=4, kv=2, inter=96, seed=0)
    rt = WideRuntime(WideModel(model, WideConfig(ffn_group_size=16, router_rank=8)), max_batch=2, max_seq=8,
                     fused_decode=True)  # fmt: skip
    masks = [(torch.tensor([[True, False], [False, False]]), torch.ones(2, 6, dtype=torch.bool))] * 2
    before, _ = decode_bytes(rt, 2, 4, masks)
    with launch_overrides(router_overlap=1):
        after, _ = decode_bytes(rt, 2, 4, masks)
    skipped_q = 2 * (4 // 2) * 32 * 128 * 4  # layers x the skipped group's Q heads x head_dim x D x fp32
    assert after - before == skipped_q
    dense, _ = decode_bytes(rt, 2, 4, None)
    with launch_overrides(router_overlap=1):
        assert decode_bytes(rt, 2, 4, None)[0] == dense  # a dense step has no routers to overlap
