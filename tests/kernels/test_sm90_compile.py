"""The fused decode layer's kernels compile for Hopper (sm_90) on any machine.

Triton's NVIDIA backend and ptxas ship with its wheel, so a CPU box can build the PTX an H200 would run. The
interpreter tests check what the kernels compute; this checks what they compile to, which the interpreter cannot:
that the GPU compiler accepts every variant (QKV dense / routed / with bias and q/k norm, attention, norm, and O's
and the FFN's weight loops: routed or dense, predicated or compacted, the down loop's own pipeline depth), that
every weight and KV loop is software-pipelined, and how many weight tiles each loop holds in flight. It runs in a
subprocess: the test session imports the kernels interpreted. ``pytest -s`` prints each variant's record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")

# both subprocess scripts start with this: one sm_90 compile of a kernel as a launch would specialise it
_SM90 = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget


# fn compiled for sm_90: sig maps each runtime arg to its type, const the constexprs; the pointers and the args
# named in div are 16-divisible (aligned pointers, widths and strides that are multiples of 16)
def sm90(fn, sig, const, div, warps=4, stages=3):
    sig = dict(sig) | {k: "constexpr" for k in const}
    marked = [i for i, a in enumerate(fn.arg_names) if sig[a][0] == "*" or a in div]
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                                    attrs={(i,): [["tt.divisibility", 16]] for i in marked})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
"""

_COMPILE = r"""
from wide.kernels.fused_decode import kernels as FD

BF, F32, I32, U8 = "*bf16", "*fp32", "*i32", "*u8"
O_ARGS = [BF] * 3 + [U8] + [BF] * 4 + [F32, F32, I32, I32] + ["i32"] * 6 + ["fp32"]
FFN_ARGS = [BF] * 5 + [U8] + [BF] * 5 + [F32, F32, I32, I32] + ["i32"] * 5 + ["fp32"]
O_CONST = dict(KS=2, HAS_BIAS=False, BM=16, BLOCK_N=64, BLOCK_K=128, T_P=64, RB=2, NB=4096, PREC="tf32", PDL=False,
               NS_P=32)
FFN_CONST = dict(KS=4, CPG=4, CH=32, HAS_BIAS=True, BM=16, BLOCK_K=256, BLOCK_N=64, BLOCK_KD=128, T_P=64, RB=2,
                 NB=4096, PREC="tf32", PDL=False, NS_P=32, SUB=1)
# (routed, compacted, the down loop's own stages (None: the kernel's), constants that differ); "down-rule": O's
# kernel on an 8B down projection at its shape rule (32 columns x 2 splits; K step 256 dense, the group's 128 routed)
O_VARIANTS = [(False, False, None, {}), (True, False, None, {}), (True, True, None, {}),
              (True, False, None, {"num_stages": 5}), (True, True, None, {"num_stages": 5}),
              (True, True, None, {"num_stages": 7})]
DOWN_VARIANTS = [(False, False, None, dict(BLOCK_N=32, BLOCK_K=256)), (True, False, None, dict(BLOCK_N=32))]
# + 32-channel groups, four a down step (the rule at 8B shapes) and eight (launch_overrides(down_span=256))
FFN_VARIANTS = [(False, False, None, {}), (True, False, None, {}), (True, True, None, {}), (True, True, 3, {}),
                (True, False, 3, {}), (True, True, None, {"BLOCK_KD": 32, "SUB": 4}),
                (True, False, None, {"BLOCK_KD": 32, "SUB": 4}), (True, True, None, {"BLOCK_KD": 32, "SUB": 8}),
                (True, False, None, {"BLOCK_KD": 32, "SUB": 8})]
# as a launch specialises them: 16-byte aligned pointers, widths and strides that are multiples of 16
DIV = {"D", "K", "G", "K_CHUNK", "DF", "s_kb", "s_ks", "s_kh", "s_vb", "s_vs", "s_vh"}


def build(name, fn, args, const, stages=3, warps=4, **rec):
    runtime = [a for a in fn.arg_names if a not in const]
    assert len(runtime) == len(args), (name, runtime)
    k = sm90(fn, dict(zip(runtime, args)), const, DIV, warps, stages)
    ptx = k.asm["ptx"]
    out.append(dict(kernel=name, **rec, stages=stages, shared=k.metadata.shared, ptx_lines=ptx.count("\n"),
                    mma="mma" in ptx, cp_async=ptx.count("cp.async.c")))


out = []
for name, fn, args, const, variants in (("o", FD._o_kernel, O_ARGS, O_CONST, O_VARIANTS),
                                        ("down-rule", FD._o_kernel, O_ARGS, O_CONST, DOWN_VARIANTS),
                                        ("ffn", FD._ffn_kernel, FFN_ARGS, FFN_CONST, FFN_VARIANTS)):
    for routed, compact, dstages, extra in variants:
        extra = dict(extra)
        stages = extra.pop("num_stages", 3)
        c = dict(const, **extra, ROUTED=routed, COMPACT=compact, **({"DSTAGES": dstages} if name == "ffn" else {}))
        build(name, fn, args, c, stages, routed=routed, compact=compact, dstages=dstages, sub=c.get("SUB", 1))
# the rest of the layer at Llama-3.1-8B shapes: QKV (dense; routed; routed + bias + Qwen3 q/k norm), attention, norm
QKV_ARGS = [BF] * 3 + [U8, F32, F32, BF, BF, "*i64", BF, BF, BF, F32, I32] + ["i32"] * 3 + ["fp32"] + ["i32"] * 6
QKV_CONST = dict(KS=2, HQ=32, HK=8, HEAD_D=128, BM=16, BLOCK_K=256, PREC="tf32", PDL=False)
for routed, extra in ((False, dict(RS=2, HAS_BIAS=False, QK_NORM=False)), (True, dict(RS=2, HAS_BIAS=False,
                      QK_NORM=False)), (True, dict(RS=1, HAS_BIAS=True, QK_NORM=True))):
    build("qkv", FD._qkv_kernel, QKV_ARGS, dict(QKV_CONST, ROUTED=routed, **extra), routed=routed, compact=False,
          dstages=None)
ATTN_ARGS = [BF, BF, BF, I32, U8, BF, F32, F32, I32, "fp32"] + ["i32"] * 5 + ["i32"] * 6
for routed, pairs, bn in ((True, 8, 64), (True, 128, 128), (False, 128, 128)):  # B 1 routed; B 16 routed, dense
    build("attn", FD._attn_kernel, ATTN_ARGS, dict(HQ=32, HK=8, HPG_P=16, HEAD_D=128, BLOCK_N=bn, NS_P=16,
          PAIRS_P=pairs, PREC="tf32", ROUTED=routed, PDL=False), warps=8, routed=routed, compact=False, dstages=None)
build("norm", FD._norm_kernel, [BF, BF, BF, "i32", "i32", "fp32"], dict(RB=2, NB=4096, PDL=False), routed=False,
      compact=False, dstages=None)
print(json.dumps(out))
"""


def test_fused_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    res = subprocess.run([sys.executable, "-c", _SM90 + _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    if res.returncode and "GPUTarget" in res.stderr and "ImportError" in res.stderr:
        pytest.skip("this Triton has no NVIDIA backend")
    assert res.returncode == 0, res.stderr[-3000:]
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    for r in recs:  # pytest -s shows them: shared memory a program, asynchronous copies, PTX size per variant
        print(json.dumps(r))
    assert len(recs) == 24  # O: dense, predicated, compacted at 3 stages + 3 deeper; down-rule: 2; the FFN: 9; QKV 3,
    # attention 3 (routed at B 1 and 16, dense at B 16), the norm
    for r in recs:
        assert r["ptx_lines"] > 100 and (r["mma"] or r["kernel"] == "norm"), r  # tensor-core dots, a real kernel
        assert 0 < r["shared"] <= 227 * 1024, r  # fits one SM's shared memory
    by = {
        (r["kernel"], r["routed"], r["compact"], r["dstages"]): r
        for r in recs
        if r["stages"] == 3 and r.get("sub", 1) == 1
    }
    multi = {(r["compact"], r["sub"]): r for r in recs if r.get("sub", 1) > 1}  # several groups a down step
    deep = {(r["compact"], r["stages"]): r["shared"] for r in recs if r["kernel"] == "o" and r["routed"]}
    # the compacted loop is different code from the predicated one (its list and barrier), not a no-op
    assert by["o", True, True, None]["ptx_lines"] != by["o", True, False, None]["ptx_lines"]
    assert by["ffn", True, True, None]["ptx_lines"] != by["ffn", True, False, None]["ptx_lines"]
    # every K loop is software-pipelined (asynchronous copies into shared memory): O's kernel has no other loop;
    # in the FFN the producers' loops alone make about two thirds of the copies (docs/kernels.md#fused-decode-layer)
    assert all(by["o", r, c, None]["cp_async"] > 0 for r, c in ((False, False), (True, False), (True, True)))
    dense, routed = by["down-rule", False, False, None], by["down-rule", True, False, None]
    assert dense["cp_async"] > 0 and routed["cp_async"] > 0  # both pipelined; the K step sets the shared memory
    assert dense["shared"] == 2 * routed["shared"]
    # buffers in flight: the predicated loop holds stages - 1 weight tiles, the list-driven one about (stages - 1) / 2
    # (its list load takes stages of its own), so it needs 5+ stages to hold as many bytes (docs/kernels.md)
    assert deep[False, 5] == 2 * deep[False, 3]
    assert deep[True, 3] < deep[False, 3] and 1.9 < deep[True, 5] / deep[True, 3] < 2.1
    assert 2.9 < deep[True, 7] / deep[True, 3] < 3.1
    ffn = by["ffn", True, False, None]["cp_async"]
    assert all(by["ffn", True, c, s]["cp_async"] > 0.8 * ffn for c, s in ((True, None), (True, 3), (False, 3)))
    # four or eight 32-channel groups a step: its own loop code (predicated sub-steps), still pipelined
    assert len(multi) == 4 and all(
        r["cp_async"] > 0.8 * ffn and r["ptx_lines"] != by["ffn", True, c, None]["ptx_lines"]
        for (c, _), r in multi.items()
    )
    assert all(r["cp_async"] > 0 for r in recs if r["kernel"] in ("qkv", "attn"))  # their weight / KV loops too


_ROUTER = r"""
from wide.kernels.router import ops as R

TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
fn = R._router_kernel
PTR = {"h_ptr": "*bf16", "wd_ptr": "*bf16", "out_ptr": "*u8", "cnt_ptr": "*i32"}
out = []
# Llama-3.1-8B's FFN router at G 32: D 4,096 (8 splits of D), rank 32, 448 groups; each schedule at both head steps
# of one program's head, and the split schedule's shared head (one program per 32 groups)
for serial, block_g, progs in [(0, 128, 0), (0, 512, 0), (1, 128, 0), (1, 512, 0), (0, 32, 14)]:
    const = dict(PREC="tf32", BLOCK_M=R.ROUTER_BLOCK_M, BLOCK_R=32, BLOCK_D=128, BLOCK_G=block_g, SPLITS=8,
                 OUT_MARGIN=False, HEAD_FIRST=1, SERIAL=serial, HEAD_PROGS=progs, PDL=False)
    sig = {a: PTR.get(a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
    k = sm90(fn, sig, const, ("D", "stride_hm", "stride_wd"))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(k.asm["cubin"])
    use = subprocess.run([TOOL, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    os.unlink(fh.name)
    line = next(x for x in use.splitlines() if "REG:" in x)
    regs, stack = (int(line.split(key)[1].split()[0]) for key in ("REG:", "STACK:"))
    rule = R.head_schedule(448, dict(SERIAL=serial, SPLITS=8)) == (block_g, progs)
    out.append(dict(serial=serial, block_g=block_g, head_progs=progs, rule=rule, regs=regs, stack=stack))
print(json.dumps(out))
"""


def test_router_head_step_fits_each_schedule_sm90():
    """The router's head schedule (``head_schedule``) as the sm_90 build allocates it: the serial schedule (many
    rows) keeps 128-group steps, which need no stack and leave an SM room for more 4-warp programs than a 512-group
    step's registers do; the split schedule (decode) shares G 32's 448 groups over 14 programs of 32 groups each,
    with no stack, where one program's 512-group step spills (docs/kernels.md#fused-decode-layer; the register
    counts move with the Triton release, the order does not). ``pytest -s`` prints the registers and stack bytes of
    each build."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    res = subprocess.run([sys.executable, "-c", _SM90 + _ROUTER], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode and ("GPUTarget" in res.stderr and "ImportError" in res.stderr or "cuobjdump" in res.stderr):
        pytest.skip("this Triton has no NVIDIA backend or no cuobjdump")
    assert res.returncode == 0, res.stderr[-3000:]
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    for r in recs:
        print(json.dumps(r))
    by = {(r["serial"], r["block_g"]): r for r in recs}
    assert [k for k, r in by.items() if r["rule"]] == [(1, 128), (0, 32)]
    assert by[0, 32]["stack"] == 0 and by[0, 32]["regs"] <= by[0, 512]["regs"]

    def programs_per_sm(regs: int) -> int:  # 64K registers an SM, a 4-warp program's threads in units of 8
        return 65536 // (128 * -(-regs // 8) * 8)

    assert by[1, 128]["stack"] == 0
    # why the serial schedule does not take 512 a step: about twice the registers, fewer programs an SM
    assert by[1, 512]["regs"] > 1.5 * by[1, 128]["regs"]
    assert programs_per_sm(by[1, 128]["regs"]) > programs_per_sm(by[1, 512]["regs"])
