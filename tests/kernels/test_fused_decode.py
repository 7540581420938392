"""The fused decode kernels against their torch references (interpreter on CPU, Triton on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_to_ref, gpu
from wide.kernels import fused_decode as FD
from wide.kernels.router import router_decisions


def _mask(mode: str, b: int, ng: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if mode == "all":
        return torch.ones(b, ng, dtype=torch.bool)
    if mode == "none":
        return torch.zeros(b, ng, dtype=torch.bool)
    return torch.rand(b, ng, generator=gen) < 0.5


def _rope(b: int, d: int, pos: torch.Tensor):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)  # [B, d]
    return ang.cos(), ang.sin()


def _to(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """The same cache [B, S, Hk, d] (same values) as a view of [B, Hk, S, d] storage: the ops take strides."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("b", [1, 3, 16])
def test_norm_matches_torch(kernel_device, b):
    torch.manual_seed(b)
    x, w = _to(kernel_device, torch.randn(b, 96), torch.randn(96))
    h = FD.fused_rms_norm(x, w, 1e-5)
    ref = FD.rms_norm_ref(x, w, 1e-5)
    torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("hq", "hk", "d", "b", "mode", "qk_norm", "bias", "grouped"),
    [
        (6, 2, 64, 1, "all", False, False, False),  # GQA 3
        (8, 2, 64, 3, "random", False, True, True),  # GQA 4, Qwen2-style bias; a strided cache
        (7, 1, 64, 2, "none", False, False, False),  # GQA 7
        (4, 2, 64, 16, "random", True, False, True),  # Qwen3 q/k norm
        (4, 1, 32, 1, "dense", False, False, False),
        pytest.param(4, 2, 128, 2, "random", False, False, False, marks=pytest.mark.slow),
    ],
)
def test_qkv_rope_cache(kernel_device, hq, hk, d, b, mode, qk_norm, bias, grouped):
    torch.manual_seed(hq * 31 + b)
    dm = 80
    n = (hq + 2 * hk) * d
    h, w = torch.randn(b, dm), torch.randn(n, dm) / dm**0.5
    bq = torch.randn(n) if bias else None
    qn, kn = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if qk_norm else (None, None)
    pos = torch.randint(0, 5, (b,))
    cos, sin = _rope(b, d, pos)
    mask = None if mode == "dense" else _mask(mode, b, hk, seed=b)
    kc, vc = torch.randn(b + 1, 6, hk, d), torch.randn(b + 1, 6, hk, d)
    if grouped:
        kc, vc = _grouped(kc), _grouped(vc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = FD.qkv_rope_cache_ref(h, w, bq, cos, sin, pos, kc_ref, vc_ref, hq, qn, kn, 1e-6)
    if mask is not None:  # Q rows of groups no token runs must not be read: poison them
        w = w.clone()
        w[: hq * d][~mask.any(0).repeat_interleave(hq // hk * d)] = float("nan")
    h, w, bq, qn, kn, pos, cos, sin, mask, kc, vc = _to(kernel_device, h, w, bq, qn, kn, pos, cos, sin, mask, kc, vc)
    q = FD.qkv_rope_cache(h, w, bq, mask, cos, sin, pos, kc, vc, hq, qn, kn, 1e-6).cpu()
    torch.testing.assert_close(kc.cpu(), kc_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(vc.cpu(), vc_ref, rtol=1e-4, atol=1e-4)
    run = torch.ones(hq, dtype=torch.bool) if mask is None else mask.cpu().any(0).repeat_interleave(hq // hk)
    torch.testing.assert_close(q[:, run], q_ref[:, run], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("hq", "hk", "b", "mode", "splits"),
    [
        (6, 2, 1, "all", 1),
        (8, 2, 3, "random", 3),
        (7, 1, 2, "all", 2),
        (4, 2, 16, "random", 2),
        (4, 2, 2, "none", 2),
        (6, 2, 3, "random", 7),  # splits past the keys: empty splits merge as nothing
    ],
)
def test_attention_merged(kernel_device, hq, hk, b, mode, splits):
    torch.manual_seed(hq + b)
    d, s = 64, 40
    q = torch.randn(b, hq, d)
    kc, vc = torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    lens = torch.randint(1, s, (b,), dtype=torch.int32)
    mask = _mask(mode, b, hk, seed=b)
    from wide.kernels.attention.reference import attention_decode_ref

    ref = attention_decode_ref(q, kc, vc, lens + 1, mask)
    q, kc, vc, lens, mask = _to(kernel_device, q, kc, vc, lens, mask)
    out = FD.attention_decode_merged(q, kc, vc, lens, mask, len_add=1, num_splits=splits)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    # deterministic: a repeat is bit-identical (fixed merge order whatever the arrival order), and so is the
    # same cache in [B, Hk, S, d] storage (the kernel reads through the strides)
    assert torch.equal(out, FD.attention_decode_merged(q, kc, vc, lens, mask, len_add=1, num_splits=splits))
    grouped = FD.attention_decode_merged(q, _grouped(kc), _grouped(vc), lens, mask, len_add=1, num_splits=splits)
    assert torch.equal(out, grouped)


@pytest.mark.parametrize(
    ("hq", "hk", "d", "b", "mode", "bias"),
    [
        (6, 2, 32, 1, "all", False),
        (8, 2, 32, 3, "random", True),
        (7, 1, 32, 16, "none", False),
        (4, 2, 32, 2, None, False),
    ],
)
def test_o_proj_residual_norm(kernel_device, hq, hk, d, b, mode, bias):
    torch.manual_seed(hq + b)
    dm = 72
    o = torch.randn(b, hq * d)
    mask = None if mode is None else _mask(mode, b, hk, seed=b)
    if mask is not None:  # attention writes zeros for skipped (token, group)
        o = o * mask.repeat_interleave(hq // hk * d, dim=1)
    wo, x, nw = torch.randn(dm, hq * d) / (hq * d) ** 0.5, torch.randn(b, dm), torch.rand(dm) + 0.5
    bo = torch.randn(dm) if bias else None
    xr, hr = FD.o_proj_residual_norm_ref(o, wo, bo, x, nw, 1e-5)
    if mask is not None:  # columns of groups no token runs must not be read: poison them
        wo = wo.clone()
        wo[:, ~mask.any(0).repeat_interleave(hq // hk * d)] = float("nan")
    xo, h = FD.o_proj_residual_norm(*_to(kernel_device, o, wo, bo, mask, x, nw), 1e-5)
    torch.testing.assert_close(xo.cpu(), xr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.cpu(), hr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("df", "g", "b", "mode", "bias"),
    [
        (48, 16, 1, "all", False),
        (80, 16, 3, "random", True),  # static width's compensation bias after down
        (96, 48, 16, "random", False),
        (64, 32, 2, "none", True),
        (48, 16, 5, None, False),
    ],
)
def test_ffn_residual_norm(kernel_device, df, g, b, mode, bias):
    torch.manual_seed(df + b)
    dm = 40
    h, x = torch.randn(b, dm), torch.randn(b, dm)
    wg, wu, wd = torch.randn(df, dm) / dm**0.5, torch.randn(df, dm) / dm**0.5, torch.randn(dm, df) / df**0.5
    nw = torch.rand(dm) + 0.5
    bd = torch.randn(dm) if bias else None
    mask = None if mode is None else _mask(mode, b, df // g, seed=b)
    xr, hr = FD.ffn_residual_norm_ref(h, wg, wu, wd, mask, x, nw, 1e-5, bd)
    if mask is not None:  # channels of groups no token runs must not be read: poison them
        off = ~mask.any(0).repeat_interleave(g)
        wg, wu, wd = wg.clone(), wu.clone(), wd.clone()
        wg[off], wu[off], wd[:, off] = float("nan"), float("nan"), float("nan")
    args = _to(kernel_device, h, wg, wu, wd, mask, x, nw)
    (dbd,) = _to(kernel_device, bd)
    xo, hn = FD.ffn_residual_norm(*args, 1e-5, g, dbd)
    torch.testing.assert_close(xo.cpu(), xr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hn.cpu(), hr, rtol=1e-5, atol=1e-5)
    xo2, hn2 = FD.ffn_residual_norm(*args, 1e-5, g, dbd)  # deterministic, and the counters were left at 0
    assert torch.equal(xo, xo2) and torch.equal(hn, hn2)


def test_router_on_the_kernels_h_is_router_decisions(kernel_device):
    """The fused layer decides with router_decisions on the h its kernels write: the mask is that op's."""
    torch.manual_seed(0)
    b, dm, r, ng = 3, 64, 8, 5
    o, wo, x = torch.randn(b, 32), torch.randn(dm, 32), torch.randn(b, dm)
    nw = torch.rand(dm) + 0.5
    _, h = FD.o_proj_residual_norm(*_to(kernel_device, o, wo, None, None, x, nw), 1e-5)
    wdn, wm, bm = torch.randn(r, dm), torch.randn(ng, r), torch.randn(ng)
    h_ref = FD.rms_norm_ref(x + o @ wo.t(), nw, 1e-5)
    torch.testing.assert_close(h.cpu(), h_ref, rtol=1e-6, atol=1e-6)
    m = router_decisions(h, *_to(kernel_device, wdn, wm, bm))
    assert torch.equal(m.cpu(), router_decisions(h.cpu(), wdn, wm, bm))


def test_dense_ffn_does_not_depend_on_the_group_size(kernel_device):
    """Without a mask every channel runs: the launch tiles the same whatever group size the routers use."""
    torch.manual_seed(3)
    dm, df, b = 40, 96, 2
    h, x, nw = torch.randn(b, dm), torch.randn(b, dm), torch.rand(dm) + 0.5
    ws = [torch.randn(df, dm) / dm**0.5, torch.randn(df, dm) / dm**0.5, torch.randn(dm, df) / df**0.5]
    args = _to(kernel_device, h, *ws, None, x, nw)
    outs = [FD.ffn_residual_norm(*args, 1e-5, g) for g in (16, 32, 48, 96)]
    torch.testing.assert_close(outs[0][0].cpu(), FD.ffn_residual_norm_ref(h, *ws, None, x, nw, 1e-5)[0])
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs[1:])


def test_down_step_rule():
    """Groups narrower than the step share it only where every K split starts on a step."""
    assert FD.down_step(128, 112, 4, 256, 0) == (128, 1)  # the rule: one group a step
    assert FD.down_step(32, 448, 4, 256, 0) == (32, 1)
    assert FD.down_step(128, 112, 4, 256, 128) == (128, 1)  # 8B, G 128: already a 128-column step
    assert FD.down_step(32, 448, 4, 256, 128) == (32, 4)  # 8B, G 32: splits start at groups 0 / 112 / 224 / 336
    assert FD.down_step(32, 448, 4, 256, 256) == (32, 8)
    assert FD.down_step(32, 448, 4, 256, FD.NARROW_DOWN_SPAN) == (32, 4)  # 8B, G 32 at the rule
    assert FD.down_step(32, 448, 4, 256, 512) == (32, 8)  # 16 run bits would not fit below a 512-column step
    assert FD.down_step(16, 448, 1, 256, 512) == (16, 4)  # 8 bits would not fit below 128 columns
    for g, span in ((16, 1024), (32, 1024), (64, 1024), (8, 64)):  # the run bits fit below the step's first column
        bkd, sub = FD.down_step(g, 448, 1, 256, span)
        assert sub == 1 or 2**sub <= bkd * sub, (g, span)
    assert FD.down_step(32, 5, 4, 128, 128) == (32, 1)  # splits start at groups 1, 2, 3
    assert FD.down_step(32, 5, 2, 64, 64) == (32, 2)  # splits start at groups 0, 2
    assert FD.down_step(48, 300, 4, 256, 128) == (16, 1)  # a step inside a group
    assert FD.down_step(256, 56, 4, 128, 128) == (128, 1)


def test_attn_split_rule():
    """About one program per SM for the batch's running (token, group) pairs, at most 16 splits of at least 256
    keys: the best count of the H100 sweep with every pair running and with half of them skipped
    (docs/kernels.md#fused-decode-layer)."""
    assert FD.attn_num_splits(8, 4104, 132) == 16  # B 1, every group
    assert FD.attn_num_splits(4, 4104, 132) == 16  # B 1, half
    assert FD.attn_num_splits(16, 4104, 132) == 8
    assert FD.attn_num_splits(24, 4104, 132) == 5
    assert FD.attn_num_splits(64, 4104, 132) == 2  # B 16, half
    assert FD.attn_num_splits(128, 4104, 132) == 1  # B 16, every group
    assert FD.attn_num_splits(0, 4104, 132) == 16  # nothing runs: no item, the count unused
    assert FD.attn_num_splits(8, 1024, 132) == 4  # 256 keys a split at least
    assert FD.attn_num_splits(256, 200, 132) == 1
    assert FD.attn_split_cap(FD.LONG_CONTEXT - 1) == 16 and FD.attn_split_cap(10) == 1
    with FD.launch_overrides(long_context=0):  # the short rule at any length
        assert FD.attn_split_cap(1 << 20) == 16 and FD.attn_programs(1 << 20, 132) == 132
        assert FD.attn_num_splits(67, 1 << 20, 132) == 1


def test_attn_long_context_split_rule():
    """From LONG_CONTEXT keys: at most 32 splits of at least 512 keys, LONG_WAVES programs per SM, so that every
    running count fills the programs but for less than one pair's splits (the short rule leaves up to half of the
    SMs idle: 67 running pairs, one split each) (docs/kernels.md#split-count-at-long-context)."""
    s = 16400
    assert not FD.long_context(s) and FD.attn_split_cap(s) == 16  # opt-in until a GPU run keeps it
    with FD.launch_overrides(long_context=1):
        p = FD.attn_programs(s, 132)
        assert p == 132 * FD.LONG_WAVES and FD.attn_programs(FD.LONG_CONTEXT - 1, 132) == 132
        assert FD.attn_split_cap(s) == 32 and FD.attn_split_cap(FD.LONG_CONTEXT) == 16
        assert FD.attn_split_cap(1 << 20) == 32
        assert FD.attn_num_splits(4, s, p) == 32  # B 1, half of 8 groups: the cap
        assert FD.attn_num_splits(67, s, p) == p // 67
        for running in range(1, 129):  # B <= 16, 8 KV groups
            ns = FD.attn_num_splits(running, s, p)
            assert running * ns <= p and (ns == 32 or running * (ns + 1) > p), running


@pytest.mark.parametrize("mode", ["all", "random", "none", "one"])
def test_attention_split_count_follows_the_running_pairs(kernel_device, mode):
    """num_splits=None: the kernel splits each running pair by ``attn_num_splits`` of the pairs the mask runs,
    giving the bits of that count passed as a fixed one, and the reference's values."""
    torch.manual_seed(1)
    b, hq, hk, d, s, programs = 3, 4, 2, 32, 600, 8  # the cap: 2 splits (600 keys)
    q, kc, vc = torch.randn(b, hq, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    lens = torch.tensor([599, 300, 17], dtype=torch.int32)
    mask = _mask("none" if mode == "one" else mode, b, hk, seed=3)
    if mode == "one":
        mask[0, 1] = True
    from wide.kernels.attention.reference import attention_decode_ref

    ref = attention_decode_ref(q, kc, vc, lens + 1, mask)
    q, kc, vc, lens, mask = _to(kernel_device, q, kc, vc, lens, mask)
    # one key step for every call: the step (a launch constant) is part of a result's bits
    with FD.launch_overrides(attn_programs=programs, attn_block_n=16):
        out = FD.attention_decode_merged(q, kc, vc, lens, mask, len_add=1)
        ns = FD.attn_num_splits(int(mask.sum()), s, programs)
        same = FD.attention_decode_merged(q, kc, vc, lens, mask, len_add=1, num_splits=ns)
        dense = FD.attention_decode_merged(q, kc, vc, lens, None, len_add=1)
        ones = torch.ones_like(mask)
        ns_all = FD.attn_num_splits(b * hk, s, programs)
        fixed = FD.attention_decode_merged(q, kc, vc, lens, ones, len_add=1, num_splits=ns_all)
    assert ns == {"all": 1, "none": 2, "one": 2}.get(mode, ns)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out, same)
    assert torch.equal(dense, fixed)


def test_dense_attention_is_the_all_true_mask(kernel_device):
    """mask=None runs every group: the same bits as an all-true mask at the same split count."""
    torch.manual_seed(0)
    b, hq, hk, d, s = 3, 8, 2, 32, 40
    q, kc, vc = torch.randn(b, hq, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    lens = torch.randint(1, s, (b,), dtype=torch.int32)
    q, kc, vc, lens = _to(kernel_device, q, kc, vc, lens)
    ones = torch.ones(b, hk, dtype=torch.bool, device=q.device)
    for ns in (1, 3):
        dense = FD.attention_decode_merged(q, kc, vc, lens, None, len_add=1, num_splits=ns)
        assert torch.equal(dense, FD.attention_decode_merged(q, kc, vc, lens, ones, len_add=1, num_splits=ns))


def test_rejects_bad_input():
    x = torch.randn(17, 8)
    with pytest.raises(ValueError, match="1 <= B <= 16"):
        FD.fused_rms_norm(x, torch.ones(8), 1e-5)
    h = torch.randn(2, 8)
    kc = torch.randn(2, 32, 1, 5).transpose(1, 3)  # [B, S, Hk, d] whose d is not the unit-stride dimension
    with pytest.raises(ValueError, match="contiguous d"):
        FD.attention_decode_merged(torch.randn(2, 2, 32), kc, kc, torch.ones(2, dtype=torch.int32),
                                   torch.ones(2, 1, dtype=torch.bool))  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 16"):
        FD.ffn_residual_norm(h, torch.randn(24, 8), torch.randn(24, 8), torch.randn(8, 24), None, h, h[0], 1e-5, 12)


# ------------------------------------------------------------------ GPU (bf16, Llama-like shapes)
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 3, 16])
@pytest.mark.parametrize("mode", ["all", "random", "none"])
# span None: the rule (G 32: four groups a down step); 32: one group a step; 256: eight, the most that fit
@pytest.mark.parametrize(("g", "span"), [(128, None), (32, None), (32, 32), (32, 256)])
def test_ffn_bf16_rule_on_gpu(b, mode, g, span):
    torch.manual_seed(b)
    dm, df = 4096, 14336
    dev = "cuda"
    h, x = torch.randn(b, dm, device=dev), torch.randn(b, dm, device=dev)
    ws = [torch.randn(df, dm, device=dev) / dm**0.5 for _ in range(2)] + [torch.randn(dm, df, device=dev) / df**0.5]
    nw = torch.rand(dm, device=dev) + 0.5
    mask = _mask(mode, b, df // g, seed=b).to(dev)
    ref32 = FD.ffn_residual_norm_ref(h, *ws, mask, x, nw, 1e-5)[0]
    lp = [t.bfloat16() for t in (h, *ws)]
    ref_lp = FD.ffn_residual_norm_ref(*lp, mask, x.bfloat16(), nw.bfloat16(), 1e-5)[0]
    with FD.launch_overrides(down_span=span):
        out = FD.ffn_residual_norm(*lp, mask, x.bfloat16(), nw.bfloat16(), 1e-5, g)[0]
    assert_close_to_ref(out, ref32, ref_lp)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 3, 16])  # dense: 16, 5 and 1 KV splits at the rule
def test_dense_attention_bf16_rule_on_gpu(b):
    torch.manual_seed(b)
    dev, hq, hk, d, s = "cuda", 32, 8, 128, 4104
    q = torch.randn(b, hq, d, device=dev)
    kc, vc = torch.randn(b, s, hk, d, device=dev), torch.randn(b, s, hk, d, device=dev)
    lens = torch.full((b,), 4095, device=dev, dtype=torch.int32)
    ones = torch.ones(b, hk, dtype=torch.bool, device=dev)
    from wide.kernels.attention.reference import attention_decode_ref

    o32 = attention_decode_ref(q, kc, vc, lens + 1, ones)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    o_lp = attention_decode_ref(q, kc, vc, lens + 1, ones, upcast=False)
    assert_close_to_ref(FD.attention_decode_merged(q, kc, vc, lens, None, len_add=1), o32, o_lp)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("grouped", [False, True])
def test_qkv_attention_o_bf16_rule_on_gpu(b, grouped):
    torch.manual_seed(b)
    dev, dm, hq, hk, d, s = "cuda", 4096, 32, 8, 128, 4096
    h = torch.randn(b, dm, device=dev)
    w = torch.randn((hq + 2 * hk) * d, dm, device=dev) / dm**0.5
    pos = torch.full((b,), s - 1, device=dev)
    cos, sin = _rope(b, d, pos.cpu())
    cos, sin = cos.to(dev), sin.to(dev)
    mask = _mask("random", b, hk, seed=b).to(dev)
    mask[0, 0] = True  # some group runs
    kc = torch.randn(b, s, hk, d, device=dev)
    vc = torch.randn(b, s, hk, d, device=dev)
    if grouped:  # [B, Hk, S, d] storage
        kc, vc = _grouped(kc), _grouped(vc)
    kc32, vc32 = kc.clone(), vc.clone()
    q32 = FD.qkv_rope_cache_ref(h, w, None, cos, sin, pos, kc32, vc32, hq)
    k_lp, v_lp = kc.bfloat16(), vc.bfloat16()
    q_lp = FD.qkv_rope_cache_ref(h.bfloat16(), w.bfloat16(), None, cos, sin, pos, k_lp, v_lp, hq)
    kq, vq = kc.bfloat16(), vc.bfloat16()
    q = FD.qkv_rope_cache(h.bfloat16(), w.bfloat16(), None, mask, cos, sin, pos, kq, vq, hq)
    run = mask.any(0).repeat_interleave(hq // hk)
    assert_close_to_ref(q[:, run], q32[:, run], q_lp[:, run])
    assert_close_to_ref(kq, kc32, k_lp)
    from wide.kernels.attention.reference import attention_decode_ref

    lens = pos.int()
    o32 = attention_decode_ref(q32, kc32, vc32, lens + 1, mask)
    o_lp = attention_decode_ref(q_lp, k_lp, v_lp, lens + 1, mask, upcast=False)
    o = FD.attention_decode_merged(q, kq, vq, lens, mask, len_add=1)
    assert_close_to_ref(o, o32, o_lp)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 16])
def test_o_proj_bf16_rule_on_gpu(b):
    torch.manual_seed(b)
    dev, dm, hq, hk, d = "cuda", 4096, 32, 8, 128
    mask = _mask("random", b, hk, seed=b).to(dev)
    o = torch.randn(b, hq * d, device=dev) * mask.repeat_interleave(hq // hk * d, dim=1)
    wo, x = torch.randn(dm, hq * d, device=dev) / (hq * d) ** 0.5, torch.randn(b, dm, device=dev)
    nw = torch.rand(dm, device=dev) + 0.5
    ref32 = FD.o_proj_residual_norm_ref(o, wo, None, x, nw, 1e-5)
    lp = [t.bfloat16() for t in (o, wo, x, nw)]
    ref_lp = FD.o_proj_residual_norm_ref(lp[0], lp[1], None, lp[2], lp[3], 1e-5)
    out = FD.o_proj_residual_norm(lp[0], lp[1], None, mask, lp[2], lp[3], 1e-5)
    assert_close_to_ref(out[0], ref32[0], ref_lp[0])
    assert_close_to_ref(out[1], ref32[1], ref_lp[1])


@gpu
@pytest.mark.gpu
def test_norm_bits_equal_torch_on_gpu():
    """The kernels' RMSNorm in bf16 against torch's: report (and bound) the fraction of differing bits."""
    torch.manual_seed(0)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    h = FD.fused_rms_norm(x, w, 1e-5)
    ref = FD.rms_norm_ref(x, w, 1e-5)
    assert (h != ref).float().mean().item() <= 1e-3


@gpu
@pytest.mark.gpu
def test_fused_ops_capture_in_a_cuda_graph():
    torch.manual_seed(0)
    b, dm, df, g = 2, 512, 1024, 128
    dev = "cuda"
    h, x = torch.randn(b, dm, device=dev).bfloat16(), torch.randn(b, dm, device=dev).bfloat16()
    wg, wu = torch.randn(df, dm, device=dev).bfloat16(), torch.randn(df, dm, device=dev).bfloat16()
    wd, nw = torch.randn(dm, df, device=dev).bfloat16(), torch.ones(dm, device=dev).bfloat16()
    mask = _mask("random", b, df // g).to(dev)
    eager = FD.ffn_residual_norm(h, wg, wu, wd, mask, x, nw, 1e-5, g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FD.ffn_residual_norm(h, wg, wu, wd, mask, x, nw, 1e-5, g)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


@pytest.mark.parametrize("ks", [1, 2, 4])
def test_split_k_paths(kernel_device, ks):
    """Each GEMV's K split (QKV, O, down) against the reference, routed (GQA 3, B 3, a group no token runs),
    and repeat bit-identical (the partials are summed in split order whatever the arrival order)."""
    with FD.launch_overrides(qkv_splits=ks, o_splits=ks, ffn_splits=ks):
        _check_split_k_paths(kernel_device, ks)


@pytest.mark.parametrize("mode", ["all", "random", "none", "one"])
@pytest.mark.parametrize("b", [1, 3, 16])
def test_compacted_k_loops_read_the_same_bits(kernel_device, mode, b):
    """The rule: O's and down's routed K loops visit only the steps of groups some token runs (a list per
    program); the skipped steps add exact zeros in the predicated loops (``compact_k=0``), so the outputs are
    bit-identical to theirs, also with the down loop's own K step and pipeline depth, and no column of a skipped
    group is read (poisoned with NaN). Odd sizes: D 40 / 72 (not a multiple of the output tiles), GQA 7:1 and 3:1."""
    torch.manual_seed(b)
    dm, df, g = 40, 160, 32
    h, x, nw = torch.randn(b, dm), torch.randn(b, dm), torch.rand(dm) + 0.5
    wg, wu, wd = torch.randn(df, dm) / dm**0.5, torch.randn(df, dm) / dm**0.5, torch.randn(dm, df) / df**0.5
    if mode == "one":  # one group run by one token: every other step of every split skipped
        mask = torch.zeros(b, df // g, dtype=torch.bool)
        mask[b - 1, 2] = True
    else:
        mask = _mask(mode, b, df // g, seed=b + 7)
    off = ~mask.any(0).repeat_interleave(g)
    wg, wu, wd = wg.clone(), wu.clone(), wd.clone()
    wg[off], wu[off], wd[:, off] = float("nan"), float("nan"), float("nan")
    args = _to(kernel_device, h, wg, wu, wd, mask, x, nw)
    xr, hr = FD.ffn_residual_norm_ref(h, wg.nan_to_num(), wu.nan_to_num(), wd.nan_to_num(), mask, x, nw, 1e-5)
    # down_span: two groups a down step (2 splits), four (1 split: the last step past the last group), eight (the
    # most whose run bits fit below a step's first column: 512 asks for sixteen)
    for shapes in ({}, {"ffn_splits": 2}, {"down_block_k": 16, "down_stages": 2}, {"ffn_splits": 2, "down_span": 64},
                   {"ffn_splits": 1, "down_span": 128}, {"ffn_splits": 1, "down_span": 512}):  # fmt: skip
        with FD.launch_overrides(compact_k=0, **shapes):
            base = FD.ffn_residual_norm(*args, 1e-5, g)
        with FD.launch_overrides(**shapes):  # the rule: compacted
            out = FD.ffn_residual_norm(*args, 1e-5, g)
        torch.testing.assert_close(base[0].cpu(), xr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(base[1].cpu(), hr, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), shapes
    for hq, hk in ((7, 1), (6, 2)):
        d = 32
        o = torch.randn(b, hq * d)
        mo = mask[:, :hk] if mode != "one" else mask[:, 2:3].expand(b, hk).clone()
        o = o * mo.repeat_interleave(hq // hk * d, dim=1)
        wo = torch.randn(72, hq * d) / (hq * d) ** 0.5
        xo_ = torch.randn(b, 72)
        wo[:, ~mo.any(0).repeat_interleave(hq // hk * d)] = float("nan")
        oargs = _to(kernel_device, o, wo, None, mo, xo_, torch.rand(72) + 0.5)
        for shapes in ({}, {"o_splits": 4}):
            with FD.launch_overrides(compact_k=0, **shapes):
                base = FD.o_proj_residual_norm(*oargs, 1e-5)
            with FD.launch_overrides(**shapes):
                out = FD.o_proj_residual_norm(*oargs, 1e-5)
            assert not torch.isnan(base[0]).any()
            assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), (hq, hk, shapes)


def test_down_steps_of_many_groups_keep_their_run_bits(kernel_device):
    """Seventeen 32-column groups, sixteen of them run by every token: a compacted down step of SUB groups carries
    SUB run bits below its first column, so ``down_step`` gathers no more groups than fit (a 512-column span asks
    for 16 and gets 8). The result equals the reference and the predicated loop's bits; the groups no token runs are
    poisoned with NaN."""
    torch.manual_seed(11)
    b, dm, df, g = 3, 40, 544, 32  # 17 groups: the last step holds one group
    h, x, nw = torch.randn(b, dm), torch.randn(b, dm), torch.rand(dm) + 0.5
    wg, wu, wd = torch.randn(df, dm) / dm**0.5, torch.randn(df, dm) / dm**0.5, torch.randn(dm, df) / df**0.5
    mask = torch.ones(b, df // g, dtype=torch.bool)
    mask[:, 16] = False  # the last group: skipped, so its columns must stay unread
    off = ~mask.any(0).repeat_interleave(g)
    wg[off], wu[off], wd[:, off] = float("nan"), float("nan"), float("nan")
    args = _to(kernel_device, h, wg, wu, wd, mask, x, nw)
    xr, hr = FD.ffn_residual_norm_ref(h, wg.nan_to_num(), wu.nan_to_num(), wd.nan_to_num(), mask, x, nw, 1e-5)
    for span in (256, 512):
        with FD.launch_overrides(ffn_splits=1, down_span=span, compact_k=0):
            base = FD.ffn_residual_norm(*args, 1e-5, g)
        with FD.launch_overrides(ffn_splits=1, down_span=span):
            out = FD.ffn_residual_norm(*args, 1e-5, g)
        torch.testing.assert_close(out[0].cpu(), xr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1].cpu(), hr, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), span


def test_attention_launch_overrides(kernel_device):
    """The attention overrides (split count, keys per step, warps) change the launch, not the result."""
    torch.manual_seed(5)
    b, hq, hk, d, s = 2, 6, 2, 64, 70
    q, kc, vc = torch.randn(b, hq, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    lens = torch.tensor([66, 13], dtype=torch.int32)
    mask = _mask("random", b, hk, seed=3)
    from wide.kernels.attention.reference import attention_decode_ref

    ref = attention_decode_ref(q, kc, vc, lens + 1, mask)
    q, kc, vc, lens, mask = _to(kernel_device, q, kc, vc, lens, mask)
    with FD.launch_overrides(attn_splits=5, attn_block_n=32, attn_warps=2):
        out = FD.attention_decode_merged(q, kc, vc, lens, mask, len_add=1)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_launch_overrides_are_checked_and_scoped():
    with pytest.raises(TypeError):
        FD.launch_overrides(ffn_split=2).__enter__()
    with pytest.raises(ValueError, match="power of two"):
        FD.launch_overrides(o_splits=3).__enter__()
    for k in ("attn_block_n", "down_span"):
        with pytest.raises(ValueError, match="power of two"):
            FD.launch_overrides(**{k: 48}).__enter__()
    for k in ("block_k", "down_block_k"):  # a GPU tensor-core dot needs K >= 16; the interpreter does not
        with pytest.raises(ValueError, match="at least 16"):
            FD.launch_overrides(**{k: 8}).__enter__()
    for k in ("compact_k", "router_overlap"):
        with pytest.raises(ValueError, match=f"{k} must be 0 or 1"):
            FD.launch_overrides(**{k: 2}).__enter__()
    assert FD.router_overlap(True) and not FD.router_overlap(False)  # the rule: beside QKV where a stream exists
    with FD.launch_overrides(router_overlap=0):  # a switch may be 0 (the other fields: positive)
        assert not FD.router_overlap(True)
    with FD.launch_overrides(router_overlap=1):
        assert FD.router_overlap(False)
    FD.launch_overrides(attn_splits=3)  # any KV split count
    with FD.launch_overrides(o_splits=4) as ov:
        assert ov.o_splits == 4 and ov.ffn_splits is None
    from wide.kernels.fused_decode import rules

    assert rules._OVERRIDES.get() is None  # the block's end restores the shape rules


def _check_split_k_paths(kernel_device, ks):
    torch.manual_seed(ks)
    b, hq, hk, d, dm, df, g = 3, 6, 2, 32, 88, 80, 16  # dm: not a multiple of the output tiles
    mask_a = torch.tensor([[True, False], [True, False], [False, False]])
    h, x, nw = torch.randn(b, dm), torch.randn(b, dm), torch.rand(dm) + 0.5
    w = torch.randn((hq + 2 * hk) * d, dm) / dm**0.5
    pos = torch.tensor([1, 4, 0])
    cos, sin = _rope(b, d, pos)
    for bias, qk in ((None, None), (torch.randn(w.shape[0]), (torch.rand(d) + 0.5, torch.rand(d) + 0.5))):
        qn, kn = qk if qk is not None else (None, None)  # the second pass: Qwen2 bias + Qwen3 q/k norm
        kc, vc = torch.randn(b, 6, hk, d), torch.randn(b, 6, hk, d)
        kr, vr = kc.clone(), vc.clone()
        q_ref = FD.qkv_rope_cache_ref(h, w, bias, cos, sin, pos, kr, vr, hq, qn, kn, 1e-6)
        dh, dw, db, dm_a, dcos, dsin, dpos, dkc, dvc, dqn, dkn = _to(
            kernel_device, h, w, bias, mask_a, cos, sin, pos, kc, vc, qn, kn
        )
        q = FD.qkv_rope_cache(dh, dw, db, dm_a, dcos, dsin, dpos, dkc, dvc, hq, dqn, dkn, 1e-6)
        torch.testing.assert_close(q.cpu()[:, :3], q_ref[:, :3], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dkc.cpu(), kr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dvc.cpu(), vr, rtol=1e-4, atol=1e-4)

    o = torch.randn(b, hq * d) * mask_a.repeat_interleave(hq // hk * d, dim=1)
    wo = torch.randn(dm, hq * d) / (hq * d) ** 0.5
    xr, hr = FD.o_proj_residual_norm_ref(o, wo, None, x, nw, 1e-5)
    args = _to(kernel_device, o, wo, None, mask_a, x, nw)
    xo, hn = FD.o_proj_residual_norm(*args, 1e-5)
    torch.testing.assert_close(xo.cpu(), xr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hn.cpu(), hr, rtol=1e-5, atol=1e-5)
    assert torch.equal(xo, FD.o_proj_residual_norm(*args, 1e-5)[0])

    mask_f = torch.rand(b, df // g) < 0.5
    wg, wu, wd = torch.randn(df, dm) / dm**0.5, torch.randn(df, dm) / dm**0.5, torch.randn(dm, df) / df**0.5
    xr, hr = FD.ffn_residual_norm_ref(h, wg, wu, wd, mask_f, x, nw, 1e-5)
    args = _to(kernel_device, h, wg, wu, wd, mask_f, x, nw)
    xo, hn = FD.ffn_residual_norm(*args, 1e-5, g)
    torch.testing.assert_close(xo.cpu(), xr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hn.cpu(), hr, rtol=1e-5, atol=1e-5)
    assert torch.equal(xo, FD.ffn_residual_norm(*args, 1e-5, g)[0])
