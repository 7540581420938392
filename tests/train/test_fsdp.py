"""FSDP2 calibration / LoRA fine-tuning on CPU (gloo): two sharded ranks train the same routers and
adapters as one plain process over the same global batches, and checkpoints resume across 1 <-> 2 ranks.

Routing noise. Every rank draws its own Gumbel noise (rank r seeds seed + r), so a 2-rank run samples
other noise for the same rows than a 1-rank run: a statistically equivalent but different trajectory.
These tests swap in the noise-free straight-through estimator (hard argmax forward, sigmoid gradient),
which makes the two runs the same computation; LoRA dropout is 0 for the same reason. The 2-rank LoRA
run also uses CPU offload and a small clipping norm, so offload and the sharded gradient clip are checked.

Tolerance. What remains different is the order of floating-point sums: per-rank means combined by
all-reduces and FSDP's reduce-scatter instead of one mean over the batch, and the gradient norm summed
shard by shard. Those change a gradient by a few fp32 ulps; AdamW divides each gradient by its running
RMS, so relative errors pass to the update at the learning-rate scale (lr 1e-2 here) but are not
amplified: after a few steps the two runs agree to well inside ATOL / RTOL, which in turn sit two
orders of magnitude below one learning-rate step. A real fault (a lost or duplicated data shard,
LoRA shards mixed up on gather or resume, a wrong optimizer state) moves parameters by a sizeable
fraction of lr. The sparsity terms' reduction is checked exactly against a one-process computation
(`_check_global_terms`), since with equal token counts and rates on one side of the target the
per-rank and global sparsity losses have the same gradient.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import tiny_model
from tests.train.test_calibrate import _dataset
from wide.config import WideConfig
from wide.model import WideModel
from wide.train.calibrate import TrainConfig, calibrate
from wide.train.fsdp import ParallelConfig

ATOL, RTOL = 1e-4, 1e-3
CFG = dict(ffn_group_size=16, router_rank=8, sparsity=0.4)
TC = dict(steps=4, batch_size=4, seq_len=16, save_every=2, log_every=1, fit_mode="none", lr=1e-2)
LORA_TC = dict(TC, steps=3, max_grad_norm=0.05)  # small max norm: clipping is active

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def noise_free_execute(margin: torch.Tensor, tau) -> torch.Tensor:
    """hard_gumbel_execute without the Gumbel noise: argmax forward, sigmoid straight-through gradient.
    margin: [..., N_G] skip margins -> execute mask [..., N_G]."""
    soft_skip = torch.sigmoid(margin / tau)
    skip = (margin > 0).to(soft_skip.dtype) - soft_skip.detach() + soft_skip
    return 1.0 - skip


def _patch_noise() -> None:
    import wide.model.wide_model as wmod

    wmod.hard_gumbel_execute = noise_free_execute


def _calibrate(out, parallel: ParallelConfig, resume: bool = False) -> dict[str, torch.Tensor]:
    wm = WideModel(tiny_model("llama"), WideConfig(**CFG))
    calibrate(wm, _dataset(), TrainConfig(**TC, parallel=parallel), out, progress=False, resume=resume)
    return {k: v.detach().clone() for k, v in wm.routers.state_dict().items()}


def _finetune(out, parallel: ParallelConfig, resume: bool = False) -> dict[str, torch.Tensor]:
    from wide.train.fsdp import lora_state_dict
    from wide.train.lora import apply_lora

    model = tiny_model("llama")
    torch.manual_seed(7)
    adapter = apply_lora(model, r=4, alpha=8, dropout=0.0)
    wm = WideModel(model, WideConfig(**CFG))
    tc = TrainConfig(**LORA_TC, parallel=parallel)
    calibrate(wm, _dataset(), tc, out, progress=False, adapter=adapter, resume=resume)
    state = {f"routers.{k}": v.detach().clone() for k, v in wm.routers.state_dict().items()}
    state.update(lora_state_dict(adapter))
    return state


def _worker(rank: int, init_file: str, root: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _patch_noise()
        fsdp = ParallelConfig("fsdp", activation_checkpointing=True)
        results[f"fresh{rank}"] = _calibrate(f"{root}/fsdp2", fsdp)
        results[f"resume12_{rank}"] = _calibrate(f"{root}/resume12", fsdp, resume=True)  # written on 1 rank
        offload = ParallelConfig("fsdp", activation_checkpointing=True, cpu_offload=True)
        results[f"lora{rank}"] = _finetune(f"{root}/lora2", offload)
        results[f"lora_resume12_{rank}"] = _finetune(f"{root}/lora_resume12", fsdp, resume=True)
        results[f"terms{rank}"] = _global_terms_grads(rank)
    finally:
        dist.destroy_process_group()


def _terms_inputs(rank: int):
    """Rank-local inputs of global_batch_terms: label / token counts and skip rates that differ by rank,
    with the rates on either side of the sparsity target."""
    g = torch.Generator().manual_seed(0)
    attn, ffn, lm = torch.rand(2, 3, generator=g), torch.rand(2, 3, generator=g), torch.rand(2, generator=g) + 1
    labels = torch.zeros(2, 2, 8, dtype=torch.long)
    mask = torch.ones(2, 2, 8, dtype=torch.bool)
    labels[0, :, 6:] = -100  # rank 0: fewer label tokens
    mask[1, 0, 5:] = False  # rank 1: fewer real tokens
    return attn[rank], ffn[rank], lm[rank], labels[rank], mask[rank], (attn, ffn, lm, labels, mask)


def _global_terms_grads(rank: int) -> dict[str, torch.Tensor]:
    """One rank's loss value and gradients through global_batch_terms."""
    from wide.target import sparsity_loss
    from wide.train.distributed import global_batch_terms

    a, f, lm, labels, mask, _ = _terms_inputs(rank)
    a, f, lm = a.requires_grad_(), f.requires_grad_(), lm.requires_grad_()
    extra = lm.detach() * 3  # a second per-label-token mean (the logged LM loss beside a distillation objective)
    lm2, a2, f2, extra2 = global_batch_terms(lm, a, f, labels, mask, extra)
    sl = sparsity_loss(a2, f2, WideConfig(**CFG))
    (lm2 + sl).backward()
    out = {"lm_w": lm2.detach(), "sparsity": sl.detach(), "a": a.grad, "f": f.grad, "lm": lm.grad}
    return {**out, "extra_w": extra2}


def _check_global_terms(r0: dict, r1: dict) -> None:
    """Against one process over the concatenated batch: the same sparsity loss on every rank, the ranks'
    mean LM term is the global mean, and each rank's gradient / 2 (the rank average) is the global one."""
    from wide.target import sparsity_loss

    attn, ffn, lm, labels, mask = _terms_inputs(0)[5]
    attn, ffn, lm = attn.clone().requires_grad_(), ffn.clone().requires_grad_(), lm.clone().requires_grad_()
    n_lab = (labels[:, :, 1:] != -100).sum((1, 2)).float()  # [2]
    n_tok = mask.sum((1, 2)).float()  # [2]
    w = n_tok / n_tok.sum()
    lm_glob = (lm * n_lab).sum() / n_lab.sum()
    sl = sparsity_loss((attn * w[:, None]).sum(0), (ffn * w[:, None]).sum(0), WideConfig(**CFG))
    (lm_glob + sl).backward()
    for rank, r in enumerate((r0, r1)):
        torch.testing.assert_close(r["sparsity"], sl.detach())
        torch.testing.assert_close(r["a"] / 2, attn.grad[rank])
        torch.testing.assert_close(r["f"] / 2, ffn.grad[rank])
        torch.testing.assert_close(r["lm"] / 2, lm.grad[rank])
    torch.testing.assert_close((r0["lm_w"] + r1["lm_w"]) / 2, lm_glob.detach())
    torch.testing.assert_close((r0["extra_w"] + r1["extra_w"]) / 2, 3 * lm_glob.detach())


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL, msg=lambda m, k=k: f"{what} {k}: {m}")


def test_fsdp_two_ranks_match_one_process_and_resume_across_rank_counts(tmp_path, monkeypatch):
    import wide.model.wide_model as wmod

    monkeypatch.setattr(wmod, "hard_gumbel_execute", noise_free_execute)
    replica = ParallelConfig()
    ref = _calibrate(tmp_path / "ref1", replica)  # one plain process: the reference
    ref_lora = _finetune(tmp_path / "lora1", replica)
    shutil.copytree(tmp_path / "ref1", tmp_path / "resume12")  # latest: checkpoint-2, written by 1 rank
    shutil.copytree(tmp_path / "lora1", tmp_path / "lora_resume12")

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "pg"), str(tmp_path), results), nprocs=2, join=True)
        res = {k: dict(v) for k, v in results.items()}

    # the 2-rank sharded run equals the 1-process run; both ranks hold the same (replicated) routers
    _close(res["fresh0"], ref, "fsdp 2 ranks vs 1 process")
    for k in ref:
        assert torch.equal(res["fresh0"][k], res["fresh1"][k]), k
    _close(res["resume12_0"], ref, "resumed 1 -> 2 ranks")
    _close(res["lora0"], ref_lora, "LoRA + routers, fsdp 2 ranks vs 1 process")
    assert any("lora_A" in k for k in res["lora0"])
    _close(res["lora_resume12_0"], ref_lora, "LoRA resumed 1 -> 2 ranks")
    shutil.copytree(tmp_path / "lora2", tmp_path / "lora_resume21")  # optimizer state gathered from shards
    _close(_finetune(tmp_path / "lora_resume21", replica, resume=True), ref_lora, "LoRA resumed 2 -> 1 rank")
    _check_global_terms(res["terms0"], res["terms1"])

    # 2 -> 1: the sharded run's step-2 checkpoint resumes in one plain process
    shutil.copytree(tmp_path / "fsdp2", tmp_path / "resume21")
    assert (tmp_path / "resume21" / "latest").read_text() == "checkpoint-2"
    _close(_calibrate(tmp_path / "resume21", replica, resume=True), ref, "resumed 2 -> 1 rank")

    logs = [json.loads(x) for x in (tmp_path / "fsdp2" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2, 3, 4]  # rank 0 alone writes
    assert all(r["world_size"] == 2 and r["tokens_per_s_per_gpu"] > 0 for r in logs)
    ref_logs = [json.loads(x) for x in (tmp_path / "ref1" / "train_log.jsonl").read_text().splitlines()]
    for a, b in zip(logs, ref_logs):  # losses and sparsity statistics are the global batch's
        for key in ("loss", "lm_loss", "attn_skip", "ffn_skip"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    meta = json.loads((tmp_path / "fsdp2" / "wide_config.json").read_text())
    assert meta["training"]["world_size"] == 2
    assert meta["training"]["train_config"]["parallel"] == {
        "mode": "fsdp",
        "activation_checkpointing": True,
        "cpu_offload": False,
    }


def test_activation_checkpointing_recomputes_layers_and_keeps_gradients_and_names():
    """Each decoder layer runs twice per step (forward, then recomputed in backward), parameter names
    are unchanged, and the router gradients equal those without checkpointing (same Gumbel noise)."""
    from wide.train.fsdp import apply_activation_checkpointing

    def grads(ac: bool):
        wm = WideModel(tiny_model("llama"), WideConfig(**CFG))
        wm.freeze_base()
        names = [n for n, _ in wm.named_parameters()]
        if ac:
            apply_activation_checkpointing(wm)
            apply_activation_checkpointing(wm)  # idempotent
        calls = []
        wm.model.model.layers[1].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
        wm.mode = "gumbel"
        ids = _dataset().input_ids[:2]
        torch.manual_seed(3)
        h = wm.hidden_states(ids)
        a, f = wm.skip_rates()
        (h.square().mean() + a.mean() + f.mean()).backward()
        assert [n for n, _ in wm.named_parameters()] == names
        return [p.grad.clone() for p in wm.routers.parameters()], len(calls)

    plain, n_plain = grads(False)
    ckpt, n_ckpt = grads(True)
    assert (n_plain, n_ckpt) == (1, 2)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bad_parallel_options_fail_clearly(tmp_path):
    from wide.cli import main

    with pytest.raises(ValueError, match="--parallel must be one of"):
        ParallelConfig("ddp")
    with pytest.raises(ValueError, match="--compile cannot be combined"):
        TrainConfig(compile=True, parallel=ParallelConfig("fsdp"))
    with pytest.raises(ValueError, match="--compile cannot be combined"):
        TrainConfig(compile=True, parallel=ParallelConfig(activation_checkpointing=True))
    assert TrainConfig(parallel={"mode": "fsdp"}).parallel == ParallelConfig("fsdp")  # from a saved train_config
    assert main(["calibrate", "--out", str(tmp_path), "--cpu-offload"]) == 2  # needs --parallel fsdp
