"""The `wide` command: calibrate, finetune, refit, eval, viz, demo, generate, bench."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import pickle
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from wide.paths import SHIPPED_ROUTERS


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _train_device(a: argparse.Namespace) -> torch.device:
    """Under torchrun: join the process group and use this rank's GPU; else as _device (with a
    one-rank process group for --parallel fsdp)."""
    from wide.train.distributed import init_from_env

    return init_from_env(single_process=a.parallel == "fsdp") or _device(a.device)


def _load_device(a: argparse.Namespace, device: torch.device) -> torch.device:
    """Where the backbone is loaded: the CPU under --parallel fsdp (FSDP moves each rank's shards to
    its GPU: no rank ever holds the whole model on its GPU), else the training device."""
    return torch.device("cpu") if a.parallel == "fsdp" else device


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }[name]


def _data_source(a: argparse.Namespace) -> tuple[str, Path | None]:
    """(--data, data root): --data defaults to the RedPajama sample under the data root."""
    from wide.paths import data_dir, find_data_dir

    # --data alone: relative paths still resolve under a data root if one is found (train.data does that)
    root = data_dir(a.data_dir) if a.data_dir else (None if a.data else find_data_dir())
    if a.data is None and root is None:
        raise FileNotFoundError(
            "no training text: pass --data (a .txt/.jsonl/.json/.parquet file, a folder, or a Hugging Face dataset "
            "name when online), or --data-dir / WIDE_DATA for the RedPajama sample of a data folder"
        )
    if a.data is None and not (root / "redpajama" / "sample_redpajama").is_dir():
        raise FileNotFoundError(
            f"no training text: the data root {root} has no redpajama/sample_redpajama; pass --data (a file, a "
            "folder, or a Hugging Face dataset name when online)"
        )
    return a.data or str(root / "redpajama" / "sample_redpajama"), root


def _training_data(a: argparse.Namespace, tok, seq_len: int, mode: str = "packed"):
    """(dataset, source) from --data, defaulting to the RedPajama sample under the data root."""
    from wide.train.data import load_calibration_data

    data, root = _data_source(a)
    ds = load_calibration_data(data, tok, seq_len=seq_len, mode=mode, data_root=root)
    print(f"training data: {len(ds)} sequences x {seq_len} tokens from {data}", file=sys.stderr)
    return ds, data


def _train_config(a: argparse.Namespace, **extra):
    from wide.train.calibrate import TrainConfig
    from wide.train.fsdp import ParallelConfig

    return TrainConfig(
        steps=a.steps,
        batch_size=a.batch_size,
        grad_accum=a.grad_accum,
        seq_len=a.seq_len,
        lr=a.lr,
        save_every=a.save_every,
        log_every=a.log_every,
        seed=a.seed,
        parallel=ParallelConfig(a.parallel, a.activation_checkpointing, a.cpu_offload),
        compile=a.compile,
        **extra,
    )


def _print_summary(summary: dict) -> None:
    print(
        json.dumps(
            {k: v for k, v in summary.items() if k not in ("train_config", "skip_bias_fit")}, indent=1, default=str
        )
    )


# ----------------------------------------------------------------------- calibrate
def _method(a: argparse.Namespace) -> str:
    """--method, with --module-skipping as the older spelling of --method module-skip."""
    if a.module_skipping and a.method not in ("wide", "module-skip"):
        raise ValueError(f"--module-skipping contradicts --method {a.method}")
    return "module-skip" if a.module_skipping else a.method


# what a warm start must share with the checkpoint it starts from: the routers' tensors (what they read,
# --router-input / --ffn-router-source, may change: the weights are a start)
_ROUTER_STRUCTURE = ("method", "attn_group_size", "ffn_group_size", "router_rank")


def _router_shape(a: argparse.Namespace) -> dict:
    """--attn-group-size, --ffn-group-size, --router-rank as given; a flag left out takes the --init-routers
    checkpoint's value when there is one (a warm start must match it), else WideConfig's default."""
    from wide.config import WideConfig
    from wide.model.checkpoint import check_checkpoint, has_adapter

    given = {"attn_group_size": a.attn_group_size, "ffn_group_size": a.ffn_group_size, "router_rank": a.router_rank}
    base = WideConfig()
    # a stage-2 checkpoint is refused in one line by _check_init_routers, not read here
    if a.init_routers and None in given.values() and not has_adapter(a.init_routers):
        base = WideConfig.from_dict(check_checkpoint(a.init_routers)["config"])
    return {k: getattr(base, k) if v is None else v for k, v in given.items()}


def _check_init_routers(ckpt: str, cfg) -> None:
    """--init-routers CKPT: a stage-1 checkpoint of this run's trained method and router shapes (its FFN group
    size may also be a multiple of this run's: its groups are then split, `split_router_groups`)."""
    from wide.baselines import TRAINING_FREE
    from wide.config import WideConfig
    from wide.model.checkpoint import check_checkpoint, has_adapter

    if cfg.method in TRAINING_FREE:
        raise ValueError(f"--init-routers: {cfg.method} has no routers to train")
    if has_adapter(ckpt):  # its routers were trained with an adapter that a calibration run would drop
        raise ValueError(f"--init-routers {ckpt}: a stage-2 checkpoint (it holds a LoRA adapter); use stage 1")
    saved = WideConfig.from_dict(check_checkpoint(ckpt)["config"])
    for k in _ROUTER_STRUCTURE:
        theirs, ours = getattr(saved, k), getattr(cfg, k)
        # WIDE's FFN routers decide per channel group: narrower groups split the coarse ones (cmd_calibrate);
        # module and layer skipping have one decision per block whatever the group size
        splittable = k == "ffn_group_size" and cfg.method == "wide"
        if splittable and theirs % ours == 0:
            continue
        if theirs != ours:
            flag = "--" + k.replace("_", "-")
            hint = " (a divisor of it splits its groups)" if splittable else ""
            raise ValueError(f"--init-routers {ckpt}: its {k} is {theirs!r}, this run's {flag} is {ours!r}{hint}")


def _run_lock(out: str):
    """--out's run lock (wide.train.run_lock), held by rank 0 (the one process writing there)."""
    import contextlib

    from wide.train.distributed import world
    from wide.train.run_lock import run_lock

    return run_lock(out) if world()[0] == 0 else contextlib.nullcontext()


def cmd_calibrate(a: argparse.Namespace) -> int:
    from wide.config import WideConfig
    from wide.model import resolve_model_id
    from wide.train.calibrate import check_out_dir, run_provenance

    method = _method(a)
    device = _train_device(a)
    cfg = WideConfig(
        **_router_shape(a),
        sparsity=a.sparsity,
        attn_sparsity=a.attn_sparsity,
        ffn_sparsity=a.ffn_sparsity,
        alpha=a.alpha,
        tau_start=a.tau_start,
        tau_end=a.tau_end,
        router_input=a.router_input,
        ffn_router_source=a.ffn_router_source,
        method=method,
        sparsity_kind=a.sparsity_kind,
        distill=a.distill,
        seed=a.seed,
    )
    model_id = resolve_model_id(a.model)
    extra = {"model": model_id, "data": _data_source(a)[0]}  # compared on --resume
    if a.init_routers:
        _check_init_routers(a.init_routers, cfg)  # before the model loads
        extra["init_routers"] = str(a.init_routers)
    tc = _train_config(a, data_mode=a.data_mode, fit_mode=a.fit_mode, extra=extra)
    # --out / --resume problems surface before the model and the data load; nothing is written yet
    check = dict(resume=a.resume, overwrite=a.overwrite, config=cfg, base_model=model_id)
    check.update(provenance=run_provenance(_dtype(a.dtype, device), device), resume_anyway=a.resume_anyway)
    check_out_dir(a.out, tc, **check)
    with _run_lock(a.out):  # one writer per --out, from before the model loads to the end
        check_out_dir(a.out, tc, **check)  # again, now that no other run can change --out
        return _calibrate_locked(a, cfg, tc, device)


def _calibrate_locked(a: argparse.Namespace, cfg, tc, device: torch.device) -> int:
    """cmd_calibrate, holding --out's run lock."""
    from wide.baselines import TRAINING_FREE, build, calibrate_training_free, load
    from wide.model import check_context, load_model
    from wide.routing import split_router_groups
    from wide.train.calibrate import calibrate, seed_everything

    method = cfg.method
    # Weights stay in the model dtype (bf16 on GPU); the routers are fp32 and autocast handles the rest.
    # training-free methods never shard: they score on the training device
    load_device = device if method in TRAINING_FREE else _load_device(a, device)
    model, tok = load_model(a.model, dtype=_dtype(a.dtype, device), device=load_device)
    check_context(model, a.seq_len, what="--seq-len")
    start = None
    if a.init_routers:  # warm start: the checkpoint's router tensors (skip offsets included) after its checks
        plain = load(model, a.init_routers)  # dimensions, base model, tensor names and shapes
        start = plain.routers.state_dict()
        if plain.config.ffn_group_size != cfg.ffn_group_size:  # a divisor of it (_check_init_routers)
            start = split_router_groups(start, "ffn", plain.config.ffn_group_size // cfg.ffn_group_size)
        plain.detach()
    seed_everything(cfg.seed)  # the routers' initialisation draws from the global generator
    wm = build(model, cfg)  # unsupported architectures and bad group sizes fail here, before data
    if start is not None:  # the hooks are this run's (its router input), the tensors the checkpoint's
        wm.routers.load_state_dict(start, strict=True)
    ds, data = _training_data(a, tok, a.seq_len, a.data_mode)
    if method in TRAINING_FREE:  # no training: scores / thresholds from --calib-batches batches
        summary = calibrate_training_free(
            wm,
            ds,
            a.out,
            batches=a.calib_batches,
            batch_size=a.batch_size,
            seq_len=a.seq_len,
            seed=a.seed,
            allocation=a.allocation,
            compensate=a.bias_compensation,
        )
    else:
        kw = dict(resume=a.resume, overwrite=a.overwrite, device=device, resume_anyway=a.resume_anyway)
        summary = calibrate(wm, ds, tc, a.out, **kw)
    summary["data"] = str(data)
    _print_summary(summary)
    return 0


# ------------------------------------------------------------------------ finetune
def cmd_finetune(a: argparse.Namespace) -> int:
    from wide.baselines import load, method_of
    from wide.config import WideConfig
    from wide.model import check_context, load_model, resolve_model_id
    from wide.model.checkpoint import check_checkpoint, has_adapter
    from wide.train.calibrate import calibrate, check_out_dir, run_provenance, seed_everything
    from wide.train.lora import apply_lora, check_lora_args

    check_lora_args(a.lora_r, a.lora_alpha, a.lora_dropout)  # flag errors first, before any file is read
    method = method_of(a.routers)
    if method == "teal":
        raise ValueError(f"--routers {a.routers}: LoRA recovery is not implemented for teal (no routers to train)")
    if has_adapter(a.routers):  # its saved adapter would hold the new LoRA only, not the one merged below it
        raise ValueError(f"--routers {a.routers}: a stage-2 checkpoint (it holds a LoRA adapter); start from stage 1")
    device = _train_device(a)
    cfg = WideConfig.from_dict(check_checkpoint(a.routers)["config"])
    if a.distill is not None:  # stage 2's own objective; the dense teacher is the base with the adapter off
        cfg = dataclasses.replace(cfg, distill=a.distill)
    model_id = resolve_model_id(a.model)
    extra = {"model": model_id, "data": _data_source(a)[0], "routers": str(a.routers)}
    extra.update(lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout)
    # static masks are constant routers: nothing to re-fit after training
    tc = _train_config(a, extra=extra, **({"fit_mode": "none"} if method == "static-width" else {}))
    check = dict(resume=a.resume, overwrite=a.overwrite, config=cfg, base_model=model_id)
    check.update(provenance=run_provenance(_dtype(a.dtype, device), device), resume_anyway=a.resume_anyway)
    check_out_dir(a.out, tc, **check)
    with _run_lock(a.out):  # one writer per --out, from before the model loads to the end
        check_out_dir(a.out, tc, **check)
        model, tok = load_model(a.model, dtype=_dtype(a.dtype, device), device=_load_device(a, device))
        check_context(model, a.seq_len, what="--seq-len")
        seed_everything(a.seed)  # LoRA's initialisation draws from the global generator
        adapter = apply_lora(model, r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout)
        wm = load(model, a.routers, strict_base=not a.no_strict_base)  # hooks on the LoRA-wrapped modules
        wm.config = cfg  # the routers' config with this stage's objective (saved with the adapter)
        ds, data = _training_data(a, tok, a.seq_len)
        kw = dict(resume=a.resume, overwrite=a.overwrite, device=device, resume_anyway=a.resume_anyway)
        summary = calibrate(wm, ds, tc, a.out, adapter=adapter, **kw)
    summary["data"], summary["stage1_routers"] = str(data), str(a.routers)
    _print_summary(summary)
    return 0


# ---------------------------------------------------------------------------- eval
def cmd_eval(a: argparse.Namespace) -> int:
    from wide.eval.runner import run_eval
    from wide.model.checkpoint import check_checkpoint

    for r in a.routers or []:  # a broken checkpoint fails here, not after the dense row was evaluated
        check_checkpoint(r)
    device = _device(a.device)
    res = run_eval(
        a.model,
        a.routers or [],
        a.tasks,
        data_dir=a.data_dir,
        limit=a.limit,
        batch_size=a.batch_size,
        max_length=a.max_length,
        dtype=_dtype(a.dtype, device),
        device=str(device),
        out=a.out,
        dense=not a.no_dense,
        check_wikitext=not a.no_lm_eval_check,
        runtime={"runtime": True, "masked": False, None: None}[a.path],
        strict_base=not a.no_strict_base,
        online=a.online or None,
    )
    if not a.out:
        print(json.dumps(res, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------- demo
def cmd_demo(a: argparse.Namespace) -> int:
    from wide.demo import run_demo

    run_demo(
        routers=a.routers,
        calibrate=a.calibrate,
        data_dir=a.data_dir,
        data=a.data,
        max_tokens=a.max_tokens,
        prompt=a.prompt,
        device=a.device,
    )
    return 0


# ------------------------------------------------------------------------ generate
def cmd_generate(a: argparse.Namespace) -> int:
    """One request through the serving engine over the kernel runtime (routed with --routers, else dense): greedy
    or sampled, ending at EOS, a stop string or --max-new-tokens; timed, with the real sparsity of its tokens."""
    import math

    from wide.config import WideConfig
    from wide.model import WideModel, check_context, load_model, load_routers
    from wide.runtime import WideRuntime
    from wide.serve import Engine, RequestError, SamplingParams

    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    try:  # bytes that are not UTF-8 reach argv as lone surrogates
        a.prompt.encode("utf-8")
        for s in a.stop:
            s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("--prompt and --stop take valid UTF-8 text") from None
    params = SamplingParams(
        max_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
        stop=tuple(a.stop),
    )  # fmt: skip
    try:
        params.check()  # before the model loads
    except RequestError as e:
        flag = {"max_tokens": "max-new-tokens"}.get(e.param, (e.param or "").replace("_", "-"))
        raise ValueError(f"--{flag}: {e}") from None
    device = _device(a.device)
    model, tok = load_model(a.model, dtype=_dtype(a.dtype, device), device=device)
    routed = a.routers is not None
    if routed:
        from wide.baselines import method_of
        from wide.config import NO_GROUP_ROUTERS

        method = method_of(a.routers)
        if method in NO_GROUP_ROUTERS:
            raise ValueError(f"--routers {a.routers}: the kernel runtime serves per-group routers, not {method}")
        wm = load_routers(model, a.routers)
    else:  # the dense runtime needs the model's dimensions only; these routers are never run
        wm = WideModel(model, WideConfig(ffn_group_size=math.gcd(model.config.intermediate_size, 128)))
    text = a.prompt
    if a.chat:
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(f"--chat: {a.model}'s tokenizer has no chat template")
        text = tok.apply_chat_template(
            [{"role": "user", "content": a.prompt}], add_generation_prompt=True, tokenize=False
        )
    ids = tok(text, add_special_tokens=not a.chat).input_ids  # the template carries its own special tokens
    if len(ids) == 0:
        raise ValueError("the prompt encodes to no tokens")
    check_context(model, len(ids) + a.max_new_tokens, what=f"--prompt ({len(ids)} tokens) + --max-new-tokens")
    rt = WideRuntime(
        wm, max_batch=1, max_seq=len(ids) + a.max_new_tokens, routed=routed, compile=a.compile,
        fused_decode=a.fused_decode,
    )  # fmt: skip
    engine = Engine(rt, tok)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    (res,) = engine.run([ids], params)
    sync()
    dt = time.perf_counter() - t0
    print(res.text)
    n = len(res.token_ids)
    line = (
        f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s; prefill, warm-up and any compilation included; "
        f"finish: {res.finish_reason})"
    )
    if res.attn_sparsity is not None:  # the decisions the kernels ran, over the prompt and the generated tokens
        line += f"; real sparsity attention {res.attn_sparsity:.1%} / FFN {res.ffn_sparsity:.1%}"
    print(line, file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- serve
def cmd_serve(a: argparse.Namespace) -> int:
    """An OpenAI-compatible server over the continuous-batching engine (docs/serving.md)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print('error: wide serve needs the serving extra: pip install "wide[serve]"', file=sys.stderr)
        return 2
    from wide.serve.server import build_engine, serve

    device = _device(a.device)
    engine, tok = build_engine(
        a.model,
        a.routers,
        max_batch=a.max_batch,
        max_seq=a.max_seq,
        queue_size=a.queue_size,
        batch_invariant=a.batch_invariant,
        dtype=_dtype(a.dtype, device),
        device=device,
    )
    if engine.device.type == "cuda":  # the routed prefill kernels tune per length class: before the first request
        t0 = time.time()
        print(f"warming up for prompts up to {engine.max_context - 1} tokens (once) ...", file=sys.stderr, flush=True)
        n = engine.warmup()
        print(f"warmed up: {n} prompts in {time.time() - t0:.0f} s", file=sys.stderr)
    name = a.served_model_name or a.model
    mode = f"routers {a.routers}" if a.routers else "dense"
    print(f"serving {name} ({mode}) on http://{a.host}:{a.port}/v1 ({a.max_batch} slots)", file=sys.stderr)
    serve(engine, tok, name, a.host, a.port)
    return 0


# --------------------------------------------------------------------------- refit
def cmd_refit(a: argparse.Namespace) -> int:
    from wide.baselines import TRAINING_FREE, load, method_of
    from wide.model import check_context, load_model
    from wide.model.checkpoint import ADAPTER_FILES, has_adapter
    from wide.paths import check_outside_package
    from wide.train.data import DataOrder
    from wide.train.threshold_fit import fit_thresholds, trained_bias_of

    if method_of(a.routers) in TRAINING_FREE:
        raise ValueError(f"--routers {a.routers}: {method_of(a.routers)} has no trained thresholds to re-fit")
    check_outside_package(a.out, "--out")  # the shipped checkpoints are inputs, never rewritten
    if a.batches < 1 or a.batch_size < 1 or a.seq_len < 1:
        raise ValueError("--batches, --batch-size and --seq-len must be >= 1")
    _data_source(a)  # no text to fit on: refused before the model loads
    device = _device(a.device)
    model, tok = load_model(a.model, dtype=_dtype(a.dtype, device), device=device)
    check_context(model, a.seq_len, what="--seq-len")
    wm = load(model, a.routers)
    ds, data = _training_data(a, tok, a.seq_len)
    order = DataOrder(len(ds), a.batch_size, seed=a.seed)
    batches = [ds.batch(order.next_batch()) for _ in range(a.batches)]
    summary = dict(wm.training_summary)
    # the rates training ran at: under the offsets it sampled with (stage 2: the stage-1 fit's)
    fit = fit_thresholds(wm, batches, device, a.mode, trained_bias_of(summary.get("skip_bias_fit")))
    summary["skip_bias_fit"] = fit
    summary.setdefault("refits", []).append(
        {"mode": a.mode, "tokens": a.batches * a.batch_size * a.seq_len, "data": str(data), "device": str(device)}
    )
    wm.save(a.out, training=summary)
    same = Path(a.out).resolve() == Path(a.routers).resolve()
    if not same and has_adapter(a.routers):  # the thresholds were fit with the adapter merged: it travels along
        for name in ADAPTER_FILES:
            shutil.copyfile(Path(a.routers) / name, Path(a.out) / name)
    mean = lambda d, k: sum(v for n, v in d.items() if n.startswith(k)) / max(1, sum(n.startswith(k) for n in d))  # noqa: E731
    for when in ("before", "after"):
        d = fit[f"argmax_skip_{when}"]
        print(f"argmax skip {when:>6}: attention {mean(d, 'attn'):.1%}, FFN {mean(d, 'ffn'):.1%}")
    print(f"wrote {a.out}")
    return 0


# ----------------------------------------------------------------------------- viz
def cmd_viz(a: argparse.Namespace) -> int:
    from wide import viz
    from wide.baselines import load, method_of
    from wide.eval.perplexity import wikitext_perplexity
    from wide.model import load_model

    if method_of(a.routers) == "teal":
        raise ValueError(f"--routers {a.routers}: teal has no routing decisions to plot")
    device = _device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(a.model, dtype=_dtype(a.dtype, device), device=device)
    wm = load(model, a.routers)
    wm.start_meter()
    wikitext_perplexity(
        model,
        tok,
        data_dir=a.data_dir,
        max_tokens=a.max_tokens,
        max_length=2048,
        batch_size=1,
        device=device,
        meter=wm.meter,
        desc=f"{Path(a.routers).name} wikitext",
    )
    summary = wm.stop_meter()
    made = [
        viz.plot_layer_profile(
            summary["per_layer"],
            out / "layer_sparsity.png",
            f"skip rate per layer on WikiText-2 ({summary['tokens']} tokens)",
        )
    ]
    toks, ffn, attn = viz.token_routing(wm, tok, a.text)
    made.append(viz.plot_token_map(toks, ffn, attn, out / "token_routing.png"))
    log = Path(a.routers) / "train_log.jsonl"
    if log.is_file():
        made.append(viz.plot_training(log, out / "training.png", target=wm.config.sparsity))
    (out / "layer_sparsity.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(str(m) for m in made))
    return 0


# ---------------------------------------------------------------------------- bench
def cmd_bench(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available() and a.what != "serve":  # serve says itself what the CPU takes (--smoke)
        raise ValueError(
            f"wide bench {a.what} times the Triton kernels on an NVIDIA GPU: it needs CUDA (torch "
            f"{torch.__version__} sees none here) and the `kernels` extra"
        )
    if a.what == "kernels":
        from wide.bench.kernels import run_kernel_bench

        t = time.time()
        rows = run_kernel_bench(a.out, quick=a.quick)
        print(f"{len(rows)} records in {time.time() - t:.0f}s -> {a.out}")
        return 0
    if a.what == "e2e":
        from wide.bench.e2e import run_e2e_bench

        t = time.time()
        kw = {k: v for k, v in (("batches", a.batches), ("sparsities", a.sparsities)) if v}
        rows = run_e2e_bench(
            a.out, quick=a.quick, compile=a.compile, fused_decode=a.fused_decode, ffn_group_size=a.ffn_group_size, **kw
        )
        print(f"{len(rows)} records in {time.time() - t:.0f}s -> {a.out}")
        return 0
    if a.what == "serve":
        from wide.bench.serve import run_serve_bench

        t = time.time()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and not a.smoke:
            raise ValueError("wide bench serve measures a GPU: on the CPU run it with --smoke")
        rows = run_serve_bench(
            a.out,
            smoke=a.smoke,
            device=device,
            dtype=torch.bfloat16 if device == "cuda" else torch.float32,
            budget_s=a.budget_s,
            workloads=a.workloads,
            concurrency=a.concurrency,
            parts=a.parts,
            command="wide " + shlex.join(sys.argv[1:]),
        )
        print(f"{len(rows)} records in {time.time() - t:.0f}s -> {a.out}")
        return 0
    raise SystemExit(f"unknown benchmark {a.what!r}")


# ---------------------------------------------------------------------------- parser
def _csv(cast, lo, hi):
    """argparse type: a comma list of ``cast`` values in [lo, hi] -> tuple."""

    def parse(text: str) -> tuple:
        try:
            vals = tuple(cast(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {cast.__name__}s, got {text!r}") from None
        if any(v < lo or (hi is not None and v > hi) for v in vals):
            raise argparse.ArgumentTypeError(f"values must lie in [{lo}, {hi if hi is not None else '∞'}]: {text!r}")
        return vals

    return parse


_OVERWRITE_HELP = (
    "start a new run in a non-empty --out (WIDE writes its own files there; an earlier WIDE run's are replaced)"
)
_RESUME_ANYWAY_HELP = (
    "with --resume: continue even though the dtype, device kind, data content or versions differ from the "
    "run's (each change is printed and recorded in wide_run.json; the result is no longer the uninterrupted run's)"
)
_NO_STRICT_HELP = "load routers calibrated on another base model of the same dimensions"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help, except where there is no default (None / off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def _finite(text: str) -> float:
    """argparse type: a finite float (NaN and inf pass no range check; the configs check the range)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _routers(text: str) -> str:
    """argparse type: a router checkpoint folder, or a shipped checkpoint's name (wide.paths.SHIPPED_ROUTERS)."""
    from wide.paths import resolve_routers

    try:
        return str(resolve_routers(text))
    except FileNotFoundError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ROUTERS_HELP = f"router checkpoint folder, or a shipped one by name: {', '.join(SHIPPED_ROUTERS)}"
DATA_HELP = (
    "text to train on: a .txt/.jsonl/.json/.parquet file, a folder of them, or a Hugging Face dataset "
    "name[:config[:split]] (online; cached by datasets); commas join several (default: the RedPajama sample "
    "under the data root)"
)
DATA_DIR_HELP = "data root laid out like shared/data (default: $WIDE_DATA, else a shared/data next to the repo)"
DTYPE_HELP = "model weights: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32"
DEVICE_HELP = "torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)"
MODEL_HELP = "base model: smollm2-135m (embedded), a local folder or a Hugging Face hub id"


def _add_training_args(p: argparse.ArgumentParser, *, lr: float) -> None:
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (over all ranks under torchrun)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches accumulated per step")
    p.add_argument("--lr", type=_finite, default=lr, help="peak AdamW learning rate (10%% warm-up, cosine decay)")
    p.add_argument("--save-every", type=int, default=200, help="write a resumable checkpoint every N steps")
    p.add_argument("--log-every", type=int, default=10, help="append to train_log.jsonl every N steps")
    p.add_argument("--seed", type=int, default=0, help="router / LoRA initialisation, data order, Gumbel noise")
    p.add_argument(
        "--parallel",
        choices=["replica", "fsdp"],
        default="replica",
        help="under torchrun: a full model copy per rank (replica), or the backbone sharded per decoder "
        "layer with FSDP2 (fsdp; also valid on one process); see docs/training.md",
    )
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each decoder layer in the backward pass"
    )
    p.add_argument("--cpu-offload", action="store_true", help="--parallel fsdp: keep the sharded parameters on the CPU")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the decoder layers (routing hooks and LoRA included)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wide", description="Token-level dynamic width pruning (WIDE).", formatter_class=_HelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("calibrate", formatter_class=_HelpFormatter, help="stage 1: train routers on a frozen model")
    c.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    c.add_argument("--data", help=DATA_HELP)
    c.add_argument("--data-dir", help=DATA_DIR_HELP)
    c.add_argument(
        "--data-mode",
        choices=["packed", "padded"],
        default="packed",
        help="packed: documents joined with EOS and cut into full sequences; padded: one document per row",
    )
    c.add_argument("--sparsity", type=_finite, default=0.5, help="shared target S (paper eq. 6)")
    c.add_argument(
        "--attn-sparsity", type=_finite, help="separate attention target (eq. 22, with --ffn-sparsity; default: off)"
    )
    c.add_argument("--ffn-sparsity", type=_finite, help="separate FFN target (eq. 22; default: off)")
    c.add_argument(
        "--attn-group-size", type=int, help="query heads per attention decision (default: Hq/Hk, or --init-routers')"
    )
    c.add_argument(
        "--ffn-group-size", type=int, help="FFN channels per routing decision, G_ffn (default: 128, or --init-routers')"
    )
    c.add_argument(
        "--router-rank", type=int, help="router bottleneck width r, D -> r -> 2 N_G (default: 32, or --init-routers')"
    )
    c.add_argument(
        "--router-input",
        choices=["normed", "residual"],
        default="normed",
        help="what the routers read: the block's normed input or the residual stream",
    )
    c.add_argument(
        "--ffn-router-source",
        choices=["block", "layer"],
        default="block",
        help="where the FFN router reads it: the FFN block's input (the paper) or the layer's, as the attention "
        "router does (both decisions known at the layer's start)",
    )
    c.add_argument(
        "--method",
        choices=["wide", "module-skip", "layer-skip", "static-width", "teal"],
        default="wide",
        help="WIDE or a baseline (docs/baselines.md): token-wise module / layer skipping (trained like WIDE), "
        "static width pruning or TEAL-style thresholding (training-free: fitted on --calib-batches batches)",
    )
    c.add_argument(
        "--module-skipping",
        action="store_true",
        help="same as --method module-skip (SkipGPT-style routing of whole attention / FFN blocks per token)",
    )
    c.add_argument(
        "--sparsity-kind",
        choices=["groups", "flops"],
        default="groups",
        help="what --sparsity measures: the fraction of routing groups skipped (activations zeroed for teal), "
        "or the fraction of the forward's FLOPs removed",
    )
    c.add_argument(
        "--distill",
        choices=["none", "kl", "kl+lm"],
        default="none",
        help="calibration objective: LM loss, KL to the dense model's next-token distribution, or both "
        "(kl+lm: lower perplexity at 50%%, docs/baselines.md)",
    )
    c.add_argument("--calib-batches", type=int, default=8, help="static-width / teal: calibration batches")
    c.add_argument(
        "--allocation",
        choices=["standardized", "global", "uniform"],
        default="standardized",
        help="static-width: rank groups over all layers after standardising scores within each layer (FLAP), "
        "rank raw scores over all layers, or remove the same count in every layer",
    )
    c.add_argument(
        "--bias-compensation",
        action="store_true",
        help="static-width: add the removed groups' mean output as a bias after O / down (FLAP's compensation)",
    )
    c.add_argument("--alpha", type=_finite, default=20.0, help="weight of the sparsity loss (paper eq. 6)")
    c.add_argument("--tau-start", type=_finite, default=5.0, help="Gumbel-Softmax temperature at step 0")
    c.add_argument("--tau-end", type=_finite, default=0.5, help="Gumbel-Softmax temperature at the last step")
    _add_training_args(c, lr=2e-3)
    c.add_argument(
        "--fit-mode",
        choices=["kind", "router", "global", "none"],
        default="kind",
        help="after training, fit argmax thresholds to the Gumbel-time skip rates: per router, "
        "per kind (attention / FFN), one global offset, or none",
    )
    c.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    c.add_argument("--device", help=DEVICE_HELP)
    c.add_argument("--out", required=True, help="output directory (checkpoints, log, final routers)")
    c.add_argument(
        "--init-routers",
        type=_routers,
        help="warm start from a stage-1 checkpoint's routers (same method, attention groups and rank; FFN groups "
        "the same or a divisor of its, each of its groups split); the target, objective, schedule and router input "
        "are this run's: " + ROUTERS_HELP,
    )
    c.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    c.add_argument("--resume-anyway", action="store_true", help=_RESUME_ANYWAY_HELP)
    c.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    c.set_defaults(func=cmd_calibrate)

    f = sub.add_parser(
        "finetune", formatter_class=_HelpFormatter, help="stage 2: LoRA recovery together with stage-1 routers"
    )
    f.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    f.add_argument("--routers", required=True, type=_routers, help="stage-1 routers: " + ROUTERS_HELP)
    f.add_argument("--data", help=DATA_HELP)
    f.add_argument("--data-dir", help=DATA_DIR_HELP)
    f.add_argument("--lora-r", type=int, default=16, help="LoRA rank (all seven linear modules)")
    f.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha")
    f.add_argument("--lora-dropout", type=_finite, default=0.1, help="LoRA dropout")
    f.add_argument(
        "--distill",
        choices=["none", "kl", "kl+lm"],
        help="stage-2 objective: LM loss, KL to the dense model (the base, adapter and routing off), or both "
        "(default: the stage-1 routers' own; kl+lm: lower perplexity at 50%%, docs/baselines.md)",
    )
    _add_training_args(f, lr=2e-4)
    f.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    f.add_argument("--device", help=DEVICE_HELP)
    f.add_argument("--out", required=True, help="output: routers + LoRA adapter (peft format)")
    f.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    f.add_argument("--resume-anyway", action="store_true", help=_RESUME_ANYWAY_HELP)
    f.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    f.add_argument("--no-strict-base", action="store_true", help=_NO_STRICT_HELP)
    f.set_defaults(func=cmd_finetune)

    e = sub.add_parser(
        "eval", formatter_class=_HelpFormatter, help="WikiText-2 perplexity and zero-shot tasks, dense vs routed"
    )
    e.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    e.add_argument("--routers", nargs="*", type=_routers, help="one row each: " + ROUTERS_HELP)
    e.add_argument(
        "--tasks",
        default="wikitext",
        help="comma list of wikitext, arc_easy, arc_challenge, boolq, winogrande, piqa, openbookqa, hellaswag; or all",
    )
    e.add_argument(
        "--data-dir",
        help=DATA_DIR_HELP + "; WikiText-2 also comes from the Hugging Face hub when online",
    )
    e.add_argument("--limit", type=int, help="examples per task (documents for wikitext; default: all)")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    e.add_argument("--max-length", type=int, default=4096, help="context window (WikiText-2 rolling windows too)")
    e.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    e.add_argument("--device", help=DEVICE_HELP)
    e.add_argument(
        "--out",
        help="JSON file (a markdown table is written next to it; rewritten after every row; default: print JSON)",
    )
    e.add_argument("--no-dense", action="store_true", help="only the router checkpoints (no dense base-model row)")
    path = e.add_mutually_exclusive_group()
    path.add_argument(
        "--runtime",
        dest="path",
        action="store_const",
        const="runtime",
        help="score through the served runtime (routed kernels, static cache); default: on a GPU wherever it "
        "serves the routers (on the CPU the two paths are bit-identical)",
    )
    path.add_argument(
        "--masked",
        dest="path",
        action="store_const",
        const="masked",
        help="score through the masked Hugging Face path (the reference) only",
    )
    e.add_argument(
        "--no-lm-eval-check",
        action="store_true",
        help="skip re-running WikiText-2 through lm-eval itself to confirm the native number",
    )
    e.add_argument("--no-strict-base", action="store_true", help=_NO_STRICT_HELP)
    e.add_argument(
        "--online",
        action="store_true",
        help="load what the data root does not hold (the zero-shot tasks, the full WikiText-2 test set) from the "
        "Hugging Face hub (default: offline, as HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say, else 1; without a data "
        "root WikiText-2 is then the packaged slice and the zero-shot tasks are refused)",
    )
    e.set_defaults(func=cmd_eval)

    d = sub.add_parser(
        "demo", formatter_class=_HelpFormatter, help="SmolLM2-135M dense vs WIDE: perplexity, sparsity, a continuation"
    )
    d.add_argument("--routers", type=_routers, help=ROUTERS_HELP + " (default: every shipped one)")
    d.add_argument(
        "--calibrate",
        action="store_true",
        help="first train 50%% routers for 40 steps on the CPU (the mechanics only) and score those instead",
    )
    d.add_argument(
        "--data-dir",
        help=DATA_DIR_HELP + "; without one the WikiText-2 slice packaged with wide is scored",
    )
    d.add_argument(
        "--data",
        help="with --calibrate: " + DATA_HELP.removesuffix(")") + ", else the calibration sample packaged with wide)",
    )
    d.add_argument(
        "--max-tokens",
        type=int,
        default=8192,
        help="WikiText-2 test tokens to score (a CPU slice; more than the packaged pages hold needs a data root or "
        "the hub)",
    )
    d.add_argument("--prompt", default="The history of the city begins", help="prompt of the greedy continuations")
    d.add_argument("--device", help="torch device (default: cpu)")
    d.set_defaults(func=cmd_demo)

    gn = sub.add_parser(
        "generate",
        formatter_class=_HelpFormatter,
        help="one prompt through the serving engine over the routed kernels (or dense): greedy or sampled, timed",
    )
    gn.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    gn.add_argument("--routers", type=_routers, help=ROUTERS_HELP + " (default: none, the dense runtime runs)")
    gn.add_argument("--prompt", default="The history of the city begins", help="text to continue")
    gn.add_argument("--max-new-tokens", type=int, default=32, help="most tokens to generate (EOS ends it sooner)")
    gn.add_argument("--temperature", type=_finite, default=0.0, help="sampling temperature (0: greedy)")
    gn.add_argument("--top-p", type=_finite, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    gn.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    gn.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same text (default: random)")
    gn.add_argument("--stop", action="append", default=[], help="a string that ends the text (repeatable)")
    gn.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template as a user turn")
    gn.add_argument("--compile", action="store_true", help="torch.compile the runtime's layer step")
    gn.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        help="decode through the fused decode layer (<= 6 launches per layer; default: on a GPU where it serves)",
    )
    gn.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    gn.add_argument("--device", help=DEVICE_HELP)
    gn.set_defaults(func=cmd_generate)

    sv = sub.add_parser(
        "serve",
        formatter_class=_HelpFormatter,
        help="an OpenAI-compatible HTTP server (continuous batching; needs the serve extra)",
    )
    sv.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    sv.add_argument("--routers", type=_routers, help=ROUTERS_HELP + " (default: none, the model is served dense)")
    sv.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    sv.add_argument("--max-batch", type=int, default=8, help="cache slots: requests decoded together")
    sv.add_argument("--max-seq", type=int, default=2048, help="tokens per slot: prompt + max_tokens at most")
    sv.add_argument("--queue-size", type=int, default=256, help="waiting requests beyond which the server answers 429")
    sv.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens do not depend on its batch-mates (fixed attention splits and decode batch size)",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    sv.add_argument("--device", help=DEVICE_HELP)
    sv.set_defaults(func=cmd_serve)

    rf = sub.add_parser(
        "refit",
        formatter_class=_HelpFormatter,
        help="re-fit the argmax thresholds of a router checkpoint (no training)",
    )
    rf.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    rf.add_argument("--routers", required=True, type=_routers, help=ROUTERS_HELP)
    rf.add_argument(
        "--mode",
        choices=["kind", "router", "global", "none"],
        default="kind",
        help="offsets fitted: per kind (attention / FFN), per router, one global, or none (clear them)",
    )
    rf.add_argument("--data", help=DATA_HELP.replace("text to train on", "text the skip rates are measured on"))
    rf.add_argument("--data-dir", help=DATA_DIR_HELP)
    rf.add_argument("--batches", type=int, default=4, help="batches the skip rates are measured on")
    rf.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    rf.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    rf.add_argument("--seed", type=int, default=1, help="seed of the batch order")
    rf.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    rf.add_argument("--device", help=DEVICE_HELP)
    rf.add_argument(
        "--out", required=True, help="output directory (the --routers folder itself to rewrite it; not a shipped one)"
    )
    rf.set_defaults(func=cmd_refit)

    v = sub.add_parser(
        "viz",
        formatter_class=_HelpFormatter,
        help="routing plots: per-layer sparsity, token routing map, training curves",
    )
    v.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    v.add_argument("--routers", required=True, type=_routers, help=ROUTERS_HELP)
    v.add_argument(
        "--text",
        default="A boy is running on the track while the crowd cheers for him.",
        help="sentence of the token routing map",
    )
    v.add_argument("--max-tokens", type=int, default=4096, help="WikiText-2 tokens for the layer profile")
    v.add_argument("--data-dir", help=DATA_DIR_HELP + "; else the packaged WikiText-2 slice, else the hub")
    v.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    v.add_argument("--device", help=DEVICE_HELP)
    v.add_argument("--out", default="plots", help="output folder for the PNGs and layer_sparsity.json")
    v.set_defaults(func=cmd_viz)

    b = sub.add_parser(
        "bench", formatter_class=_HelpFormatter, help="GPU benchmarks (CUDA only; serve --smoke runs on the CPU)"
    )
    b.add_argument(
        "what",
        choices=["kernels", "e2e", "serve"],
        help="kernels: routed ops vs cuBLAS / SDPA; e2e: TTFT / TPOT; serve: the serving engine under load",
    )
    b.add_argument("--out", default="bench/results", help="output folder for the JSON / markdown records")
    b.add_argument("--quick", action="store_true", help="a few shapes only (a smoke run)")
    b.add_argument(
        "--compile", action="store_true", help="e2e: torch.compile the runtime's layer step (dense and WIDE alike)"
    )
    b.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        help="e2e: decode through the fused decode layer (dense and WIDE alike; default: the runtime's choice)",
    )
    b.add_argument("--batches", type=_csv(int, 1, None), help="e2e: comma list of batch sizes (default 1,16)")
    b.add_argument(
        "--sparsities",
        type=_csv(float, 0.0, 0.99),
        help="e2e: comma list of WIDE sparsity levels (default 0,0.25,0.5,0.7)",
    )
    b.add_argument(
        "--ffn-group-size", type=int, default=128, help="e2e: the routers' FFN channels per decision (G_ffn)"
    )
    b.add_argument("--smoke", action="store_true", help="serve: a tiny model and tiny lengths (runs on the CPU)")
    b.add_argument("--budget-s", type=float, default=420.0, help="serve: start no new row past this many seconds")
    b.add_argument(
        "--workloads", type=lambda t: tuple(t.split(",")), default=("chat", "long"), help="serve: chat, long"
    )
    b.add_argument("--concurrency", type=_csv(int, 1, 16), default=(1, 4, 16), help="serve: requests in flight")
    b.add_argument(
        "--parts",
        type=lambda t: tuple(t.split(",")),
        default=("engine", "bare", "hf", "batch"),
        help="serve: engine rows, the bare B 1 step, HF generate, greedy batch dependence",
    )
    b.set_defaults(func=cmd_bench)
    return p


def _user_error(e: BaseException) -> str | None:
    """The one line a user sees for e, None for an exception that is a bug (its traceback is shown)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, OSError) and e.errno is not None:  # raised by the OS: name the file, say what to do
        what = {
            errno.ENOSPC: "no space left on the device: free some space or write elsewhere",
            errno.EDQUOT: "disk quota exceeded: free some space or write elsewhere",
            errno.EACCES: "permission denied: choose a path you can write to",
            errno.EPERM: "operation not permitted: choose a path you can write to",
            errno.EROFS: "read-only file system: write elsewhere",
            errno.ENOTDIR: "a part of this path is not a directory",
            errno.EISDIR: "is a directory, a file was expected",
            errno.ENOENT: "no such file or directory",
        }.get(e.errno, e.strerror or first)
        return f"{e.filename}: {what}" if e.filename is not None else what
    if isinstance(e, UnicodeError):
        return f"text that is not valid UTF-8 ({first}): pass UTF-8 text and files"
    if isinstance(e, pickle.UnpicklingError):
        return f"a pickled file was refused (unpickling can run code; use safetensors files): {first}"
    if isinstance(e, (OSError, ValueError)):  # wide's own errors are one line (FileNotFoundError, ValueError)
        return first
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one `wide` command. Bad input, files and the OS's refusals end in one line on stderr and exit
    code 2; set WIDE_DEBUG=1 for the traceback instead."""
    args = build_parser().parse_args(argv)
    if os.environ.get("WIDE_DEBUG", "") not in ("", "0"):
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        msg = _user_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
