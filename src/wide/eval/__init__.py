"""Evaluation: WikiText-2 perplexity, lm-eval integration (model type `wide`) over offline task data,
and the runner behind `wide eval`.

Importing this package registers the lm-eval model type `wide` (lazily: lm-eval's HFLM is imported
only when the type is instantiated).
"""

from __future__ import annotations


def _register_lm_eval_model() -> None:
    try:
        import lm_eval.models  # noqa: F401  (registers lm-eval's own lazy model types first)
        from lm_eval.api.registry import model_registry
    except ImportError:  # lm-eval not installed: `pip install wide[eval]`
        return
    if "wide" not in model_registry:
        model_registry.register("wide", target="wide.eval.lm_eval_model:WideLM")


_register_lm_eval_model()

__all__ = ["run_eval", "wikitext_perplexity"]


def __getattr__(name: str):
    if name == "run_eval":
        from wide.eval.runner import run_eval

        return run_eval
    if name == "wikitext_perplexity":
        from wide.eval.perplexity import wikitext_perplexity

        return wikitext_perplexity
    raise AttributeError(name)
