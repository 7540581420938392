"""Served = evaluated: the shipped routers' quality through the runtime (the served path) and the masked
Hugging Face path (the reference), and their greedy generations, on one GPU.

    python -m bench.serve.served_vs_evaluated OUT --routers DIR [DIR ...] [--tasks all] [--batch-size 64]

Writes OUT/served-vs-evaluated.{json,md}: per router (and dense), WikiText-2 word perplexity through both
paths and their relative difference, the real sparsity each path measured, the zero-shot tasks through
the runtime (with --tasks all), and greedy agreement (prompts from WikiText-2, CUDA-graph decode
through the runtime vs re-scoring the whole sequence on the masked path at every step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def greedy_agreement(model_name: str, routers: str | None, n_prompts: int, prompt_len: int, new: int) -> dict:
    from wide.eval.lm_eval_model import load_routed
    from wide.eval.tasks import data_path
    from wide.runtime import WideRuntime, generate

    model, tok, wm = load_routed(model_name, routers, dtype="bfloat16", device="cuda")
    text = data_path("wikitext", 0, None).read_text(encoding="utf-8")
    toks = tok.encode(text)
    ids = torch.tensor([toks[i * 997 : i * 997 + prompt_len] for i in range(n_prompts)], device="cuda")
    if wm is None:  # dense: the runtime over routers it never reads
        from wide.config import WideConfig
        from wide.model import WideModel

        carrier = WideModel(model, WideConfig())
        rt = WideRuntime(carrier, max_batch=n_prompts, max_seq=prompt_len + new, routed=False)
        carrier.detach()
    else:
        rt = WideRuntime(wm, max_batch=n_prompts, max_seq=prompt_len + new)
    served = generate(rt, ids, new)[:, prompt_len:]
    seq = ids
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    ref = seq[:, prompt_len:]
    same = served == ref
    first = [int((~row).nonzero()[0]) if (~row).any() else new for row in same]
    return {
        "prompts": n_prompts,
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "token_agreement": float(same.float().mean()),
        "sequences_identical": int(sum(f == new for f in first)),
        "first_divergence": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--routers", nargs="+", required=True)
    ap.add_argument("--tasks", default="wikitext", help="wikitext, or all (zero-shot through the runtime too)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    from wide.eval.runner import run_eval

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(dtype="bfloat16", device="cuda", batch_size=a.batch_size, max_length=a.max_length,
                  check_wikitext=False)  # fmt: skip
    t0 = time.time()
    res: dict = {"model": a.model, "routers": a.routers, "settings": common | {"tasks": a.tasks}, "rows": {}}
    paths = {}
    for path in ("masked", "runtime"):
        t = time.time()
        paths[path] = run_eval(a.model, a.routers, "wikitext", runtime=path == "runtime", **common)
        res[f"{path}_wikitext_seconds"] = time.time() - t
    for name in paths["masked"]["rows"]:
        m, r = paths["masked"]["rows"][name], paths["runtime"]["rows"][name]
        pm, pr = m["wikitext"]["word_perplexity"], r["wikitext"]["word_perplexity"]
        res["rows"][name] = {
            "wikitext_word_ppl": {"masked": pm, "runtime": pr, "rel_diff": abs(pr - pm) / pm},
            "sparsity": {"masked": m["sparsity"].get("wikitext"), "runtime": r["sparsity"].get("wikitext")},
        }
        print(name, res["rows"][name]["wikitext_word_ppl"], flush=True)
    for name in res["rows"]:
        t = time.time()
        g = greedy_agreement(a.model, None if name == "dense" else name, a.prompts, 128, a.new_tokens)
        res["rows"][name]["greedy"] = g | {"seconds": time.time() - t}
        print(name, "greedy", g, flush=True)
        (out / "served-vs-evaluated.json").write_text(json.dumps(res, indent=1, default=str))
    if a.tasks == "all":
        t = time.time()
        zs = run_eval(a.model, a.routers, "arc_easy,arc_challenge,boolq,winogrande,piqa,openbookqa,hellaswag",
                      runtime=True, dense=False, out=str(out / "runtime-zero-shot"), **common)  # fmt: skip
        res["runtime_zero_shot"] = {k: {"tasks": v["tasks"], "sparsity": v["sparsity"].get("tasks")}
                                    for k, v in zs["rows"].items()}  # fmt: skip
        res["runtime_zero_shot_markdown"] = zs["markdown"]
        res["runtime_zero_shot_seconds"] = time.time() - t
    res["wall_seconds"] = time.time() - t0
    res["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    (out / "served-vs-evaluated.json").write_text(json.dumps(res, indent=1, default=str))
    lines = ["| row | WikiText-2 word ppl (masked) | (runtime) | rel. diff | greedy tokens equal | identical seqs |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in res["rows"].items():
        w, g = row["wikitext_word_ppl"], row["greedy"]
        lines.append(f"| {name} | {w['masked']:.3f} | {w['runtime']:.3f} | {w['rel_diff']:.2e} | "
                     f"{g['token_agreement']:.1%} | {g['sequences_identical']}/{g['prompts']} |")  # fmt: skip
    (out / "served-vs-evaluated.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
