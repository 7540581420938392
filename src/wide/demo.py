"""`wide demo`: SmolLM2-135M dense vs WIDE on the CPU — perplexity, real sparsity, a continuation."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import torch

from wide.model import SMOLLM2, WideModel, load_model, load_routers
from wide.model.checkpoint import has_adapter
from wide.paths import resolve_routers, shipped_routers

__all__ = ["run_demo", "shipped_routers"]

CALIBRATION_DEFAULT = "redpajama/sample_redpajama"  # under the data root


def calibration_source(data_dir: str | None, data: str | None) -> tuple[str, Path | None]:
    """(the text `wide demo --calibrate` trains on, the data root): --data, else the data root's RedPajama
    sample, else the sample packaged with `wide`. A --data path that does not exist is an error here, before
    any model loads."""
    from wide.paths import find_data_dir, packaged_calibration_sample
    from wide.train.data import source_fingerprint

    root = find_data_dir(data_dir)
    if data is None:
        default = root / CALIBRATION_DEFAULT if root is not None else None
        data = str(default if default is not None and default.is_dir() else packaged_calibration_sample())
    source_fingerprint(data, data_root=root)  # DataError (a ValueError) naming a missing path
    return data, root


def _short_calibration(model, tokenizer, data: str, root: Path | None, out: Path) -> Path:
    from wide.config import WideConfig
    from wide.train.calibrate import TrainConfig, calibrate
    from wide.train.data import load_calibration_data

    ds = load_calibration_data(data, tokenizer, seq_len=256, data_root=root)
    wm = WideModel(model, WideConfig(sparsity=0.5))
    tc = TrainConfig(steps=40, batch_size=4, seq_len=256, lr=5e-3, log_every=5, save_every=1000, fit_batches=2)
    print(
        f"calibrating routers: {tc.steps} steps x {tc.batch_size} x {tc.seq_len} tokens on the CPU, on {data}. This "
        "shows the mechanics only: 40 steps cannot teach 50% routing (the loss is still falling after 1,000 GPU "
        "steps of 16 x 2,048 tokens), so expect a broken model; the shipped routers are the quality reference."
    )
    calibrate(wm, ds, tc, out)
    wm.detach()
    return out


def _continue(model, tokenizer, prompt: str, n: int = 30) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _fmt_ppl(r: dict) -> str:
    wp = r.get("word_perplexity")
    word = f"word ppl {wp:8.2f}" if wp is not None else "word ppl      n/a"
    return f"{word} | token ppl {r['token_perplexity']:7.2f}"


def run_demo(
    *,
    routers: str | None = None,
    calibrate: bool = False,
    data_dir: str | None = None,
    data: str | None = None,
    max_tokens: int = 8192,
    prompt: str = "The history of the city begins",
    device: str | None = None,
) -> dict:
    """Print dense vs WIDE perplexity on a WikiText-2 slice, the real sparsity and FLOP saving, and a
    greedy continuation from each model. Returns the numbers.

    routers: a checkpoint folder or a shipped name (default: every shipped SmolLM2-135M checkpoint).
    data_dir: the data root (default: $WIDE_DATA / shared/data, else the WikiText-2 slice packaged with
    `wide`). data: the text `calibrate` trains on (default: the RedPajama sample under the data root, else
    the calibration sample packaged with `wide`). The calibrated routers live in a temporary folder that is
    removed on return (also on Ctrl-C)."""
    if not calibrate:
        return _run(resolve_routers(routers) if routers else None, data_dir, max_tokens, prompt, device)
    source = calibration_source(data_dir, data)
    with tempfile.TemporaryDirectory(prefix="wide-demo-") as tmp:
        return _run(None, data_dir, max_tokens, prompt, device, calibrate=(source, Path(tmp)))


def _run(
    routers: Path | None,
    data_dir: str | None,
    max_tokens: int,
    prompt: str,
    device: str | None,
    calibrate: tuple[tuple[str, Path | None], Path] | None = None,
) -> dict:
    """run_demo's body. calibrate: ((text, data root), folder) to train routers into first."""
    from wide.eval.perplexity import wikitext_perplexity

    dev = torch.device(device or "cpu")
    t0 = time.time()
    model, tok = load_model(SMOLLM2, dtype=torch.float32, device=dev)
    if calibrate is not None:
        (data, root), out = calibrate
        routers = _short_calibration(model, tok, data, root, out)
    ckpts = [routers] if routers else shipped_routers()
    print(f"model: SmolLM2-135M (embedded GGUF, fp32, {dev}); routers: {', '.join(c.name for c in ckpts)}")
    print(
        f"WikiText-2 test, first {max_tokens} tokens only (a CPU slice; the README's numbers are the "
        f"full set on the H200)"
    )

    def ppl(m, label: str, meter=None) -> dict:
        return wikitext_perplexity(
            m,
            tok,
            data_dir=data_dir,
            max_tokens=max_tokens,
            max_length=2048,
            batch_size=1,
            device=dev,
            meter=meter,
            desc=f"{label} wikitext",
        )

    results = {"dense": {"ppl": ppl(model, "dense"), "text": _continue(model, tok, prompt)}}
    print(f"WikiText-2 pages from: {results['dense']['ppl']['source']}")
    for ckpt in ckpts:
        # a stage-2 checkpoint merges its LoRA adapter into the weights it loads onto: a copy, as the base
        # model serves the other checkpoints
        m = copy.deepcopy(model) if has_adapter(ckpt) else model
        wm = load_routers(m, ckpt)
        wm.start_meter()
        r = ppl(m, ckpt.name.removeprefix("smollm2-135m-"), wm.meter)
        results[ckpt.name] = {
            "ppl": r,
            "sparsity": wm.stop_meter(),
            "text": _continue(m, tok, prompt),
            "target": wm.config.sparsity,
        }
        wm.detach()
    print()
    print(f"  {'dense':<30} {_fmt_ppl(results['dense']['ppl'])}")
    for name, r in list(results.items())[1:]:
        sp = r["sparsity"]
        print(
            f"  {name + ' (S=' + format(r['target'], '.0%') + ')':<30} {_fmt_ppl(r['ppl'])} | real sparsity "
            f"attn {sp['attn_sparsity']:.1%} / FFN {sp['ffn_sparsity']:.1%} | FLOPs removed {sp['flop_saving']:.1%}"
        )
    print("  (FLOPs removed counts the dense K/V projections, attention scores, lm_head and the routers)")
    print(f"\n  prompt: {prompt!r}")
    for name, r in results.items():
        print(f"  {name:<22}: {r['text']!r}")
    print(f"\n({time.time() - t0:.0f}s)")
    return results
