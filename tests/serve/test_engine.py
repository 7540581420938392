"""The continuous-batching engine on the CPU: greedy equality (batched == alone == the masked path), seeded
sampling, stop strings / EOS, streaming, cancellation, request checks."""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import tiny_model
from wide.config import WideConfig
from wide.model import WideModel
from wide.runtime import WideRuntime
from wide.serve import Engine, QueueFull, RequestError, SamplingParams
from wide.serve.engine import padded_sizes
from wide.serve.sampling import filter_logits


def _routed(seed: int = 0, routed: bool = True):
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv=2, inter=64, seed=seed)
    wm = WideModel(model, WideConfig(ffn_group_size=16, router_rank=8, sparsity=0.5))
    for r in wm.routers:  # mixed decisions
        torch.nn.init.normal_(r.attn.up.weight, std=2.0)
        torch.nn.init.normal_(r.ffn.up.weight, std=2.0)
    return wm


def _prompts(lengths, seed=0, vocab=101):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _masked_greedy(wm, prompt, n, routed=True):
    """The masked path's greedy continuation (re-scoring the whole sequence each step; dense: routing off)."""
    seq = torch.tensor([prompt])
    with torch.no_grad(), wm.routing("argmax" if routed else "dense"):
        for _ in range(n):
            seq = torch.cat([seq, wm(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, len(prompt) :].tolist()


@pytest.mark.parametrize("routed", [True, False])
def test_concurrent_greedy_equals_alone_and_the_masked_path(routed):
    """7 requests of mixed prompt lengths and output lengths over 3 slots (requests join and leave between steps):
    each one's tokens equal it run alone through the engine and the masked path's greedy continuation."""
    wm = _routed(seed=1)
    eng = Engine(WideRuntime(wm, max_batch=3, max_seq=40, routed=routed))
    prompts = _prompts([3, 11, 5, 17, 1, 8, 2])
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 2, 9, 4, 7, 1, 5)]
    together = eng.run(prompts, params)
    assert [r.finish_reason for r in together] == ["length"] * 7
    assert eng.load() == (0, 0) and all(s is None for s in eng.slots)
    for p, sp, r in zip(prompts, params, together, strict=True):
        assert len(r.token_ids) == sp.max_tokens
        assert eng.run([p], sp)[0].token_ids == r.token_ids
        assert _masked_greedy(wm, p, sp.max_tokens, routed) == r.token_ids


def test_reported_sparsity_is_what_the_masked_path_measures():
    """A request's reported sparsity = the masked path's meter over the tokens the model ran for it (its prompt
    and every generated token but the last)."""
    wm = _routed(seed=2)
    eng = Engine(WideRuntime(wm, max_batch=2, max_seq=32))
    prompts = _prompts([4, 9, 6], seed=3)
    res = eng.run(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    for p, r in zip(prompts, res, strict=True):
        wm.start_meter()
        with torch.no_grad():
            wm(torch.tensor([p + r.token_ids[:-1]]))
        m = wm.stop_meter()
        assert r.attn_sparsity == pytest.approx(m["attn_sparsity"], abs=1e-9)
        assert r.ffn_sparsity == pytest.approx(m["ffn_sparsity"], abs=1e-9)
        assert 0 < r.attn_sparsity < 1 and 0 < r.ffn_sparsity < 1


def test_seeded_sampling_reproduces_whatever_the_batch():
    wm = _routed(seed=3)
    eng = Engine(WideRuntime(wm, max_batch=4, max_seq=32))
    prompts = _prompts([5, 7, 3, 9], seed=4)
    sp = [
        SamplingParams(max_tokens=8, temperature=1.5, top_p=0.95, top_k=40, seed=s, ignore_eos=True) for s in range(4)
    ]
    batch = eng.run(prompts, sp)
    alone = [eng.run([p], s)[0] for p, s in zip(prompts, sp, strict=True)]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    other_seed = eng.run([prompts[0]], SamplingParams(max_tokens=8, temperature=1.5, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != batch[0].token_ids  # the draws follow the seed


def test_top_k_and_top_p_keep_what_they_should():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.count_nonzero(filter_logits(logits, 1.0, 2, 1.0)) == 2
    p = torch.softmax(logits, -1)
    kept = filter_logits(logits, 1.0, 0, float(p[0] + p[1] - 1e-4))  # the top two reach it, the top one does not
    assert torch.count_nonzero(kept) == 2 and kept.sum() == pytest.approx(p[0] + p[1])
    assert torch.count_nonzero(filter_logits(logits, 1.0, 0, 1e-6)) == 1  # the most likely token always stays


def test_padded_sizes():
    assert padded_sizes(16) == [1, 2, 4, 8, 16]
    assert padded_sizes(6) == [1, 2, 4, 6]
    assert padded_sizes(1) == [1]


def test_idle_rows_run_no_group_and_leave_the_busy_rows_alone():
    """A padded decode step with idle rows: the busy rows' logits equal the step over the busy rows alone, and the
    idle rows' masks are all False."""
    wm = _routed(seed=5)
    rt = WideRuntime(wm, max_batch=4, max_seq=16)
    prompts = _prompts([5, 5], seed=6)
    rt.prefill(torch.tensor([prompts[0]]), slot=0)
    rt.prefill(torch.tensor([prompts[1]]), slot=2)
    ids = torch.tensor([[7], [0], [9], [0]])
    active = torch.tensor([True, False, True, False])
    logits = rt.decode(ids, active)
    for m in rt.last_masks:
        assert not m.attn[~active].any() and not m.ffn[~active].any() and m.attn[active].any()
    assert rt.cache.lens.tolist() == [6, 1, 6, 1]  # idle rows restart at 0 and write position 0 only
    alone = WideRuntime(wm, max_batch=1, max_seq=16)
    for row in (0, 2):
        alone.prefill(torch.tensor([prompts[row // 2]]))
        torch.testing.assert_close(logits[row], alone.decode(ids[row : row + 1])[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    from wide.model import load_model
    from wide.model.loading import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    model, tok = load_model(str(path))
    import math

    wm = WideModel(model, WideConfig(ffn_group_size=math.gcd(model.config.intermediate_size, 128)))
    return wm, tok


def test_stop_strings_eos_and_streaming(tiny_with_tokenizer):
    wm, tok = tiny_with_tokenizer
    eng = Engine(WideRuntime(wm, max_batch=2, max_seq=64, routed=False), tok, eos_ids=[])
    prompt = tok("The history of the city").input_ids
    free = eng.run([prompt], SamplingParams(max_tokens=12))[0]
    assert free.finish_reason == "length" and len(free.text) > 8
    stop = free.text[5:8]  # a stop string met mid-text ends it there, itself excluded
    cut = eng.run([prompt], SamplingParams(max_tokens=12, stop=("@@never@@", stop)))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    # EOS: the 4th greedy token declared EOS ends the request after 3 tokens
    eos_eng = Engine(WideRuntime(wm, max_batch=2, max_seq=64, routed=False), tok, eos_ids=[free.token_ids[3]])
    first = free.token_ids.index(free.token_ids[3])
    r = eos_eng.run([prompt], SamplingParams(max_tokens=12))[0]
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:first]
    assert eos_eng.run([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids == free.token_ids
    # streamed deltas concatenate to the non-streamed text, with and without a stop string
    for sp, want in ((SamplingParams(max_tokens=12), free), (SamplingParams(max_tokens=12, stop=(stop,)), cut)):
        outs = list(eng.stream(prompt, sp))
        assert "".join(o.text for o in outs) == want.text and outs[-1].result.text == want.text
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    eng.stop()


def test_cancel_frees_the_slot_and_others_continue(tiny_with_tokenizer):
    wm, tok = tiny_with_tokenizer
    eng = Engine(WideRuntime(wm, max_batch=2, max_seq=256, routed=False), tok, eos_ids=[])
    prompt = tok("Once upon a time").input_ids
    want = eng.run([prompt], SamplingParams(max_tokens=6))[0]
    long = eng.stream(prompt, SamplingParams(max_tokens=200))
    next(long)
    assert eng.load()[0] >= 1
    long.close()  # the consumer leaves: the request is cancelled
    deadline = time.time() + 30
    while eng.load() != (0, 0) and time.time() < deadline:
        time.sleep(0.01)
    assert eng.load() == (0, 0)
    assert eng.counters.requests_finished.get("cancelled") == 1
    outs = list(eng.stream(prompt, SamplingParams(max_tokens=6)))  # the engine serves on
    assert outs[-1].result.token_ids == want.token_ids
    eng.stop()


def test_requests_are_checked_before_they_queue():
    wm = _routed()
    eng = Engine(WideRuntime(wm, max_batch=1, max_seq=16), queue_size=2)
    bad = [
        ([], SamplingParams(), "prompt"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(max_tokens=2, temperature=-0.1), "temperature"),
        ([1], SamplingParams(max_tokens=2, top_p=0.0), "top_p"),
        ([1], SamplingParams(max_tokens=2, top_p=1.5), "top_p"),
        ([1] * 10, SamplingParams(max_tokens=7), "max_tokens"),  # 17 > max_seq 16
        ([1000], SamplingParams(max_tokens=2), "prompt"),  # outside the vocabulary
        ([1], SamplingParams(max_tokens=2, stop=("x",)), "stop"),  # no tokenizer to find it with
    ]
    for prompt, sp, param in bad:
        with pytest.raises(RequestError) as e:
            eng.submit(prompt, sp)
        assert e.value.param == param
    with pytest.raises(RequestError, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) = 17 exceeds the context of 16"):
        eng.submit([1] * 10, SamplingParams(max_tokens=7))
    eng.submit([1], SamplingParams(max_tokens=2))
    eng.submit([2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        eng.submit([3], SamplingParams(max_tokens=2))
    while eng.has_work():
        eng.step()
    assert eng.load() == (0, 0)


@pytest.mark.slow
def test_smollm2_shipped_routers_concurrent_greedy_equals_alone_and_the_masked_path():
    """SmolLM2-135M with the shipped 50% routers, fp32: 4 requests of mixed prompt lengths over 3 slots give each
    request the tokens it gets alone through the engine and the masked path's greedy continuation."""
    from wide.model import load_model, load_routers
    from wide.paths import resolve_routers

    model, tok = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    wm = load_routers(model, str(resolve_routers("smollm2-135m-s50"))).eval()
    texts = [
        "The history of the city begins",
        "In 1969, the first",
        "Water boils at",
        "A recipe for bread: mix flour, water, salt and yeast, then",
    ]
    prompts = [tok(t).input_ids for t in texts]
    eng = Engine(WideRuntime(wm, max_batch=3, max_seq=64), tok)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 4, 5, 3)]  # 4 requests over 3 slots
    together = eng.run(prompts, params)
    for p, sp, r in zip(prompts, params, together, strict=True):
        assert eng.run([p], sp)[0].token_ids == r.token_ids
        assert _masked_greedy(wm, p, sp.max_tokens) == r.token_ids
        assert 0.3 < r.attn_sparsity < 0.7 and 0.3 < r.ffn_sparsity < 0.7  # the 50% routers, on these tokens
    assert eng.load() == (0, 0)


def test_warmup_prefills_every_length_class_and_leaves_the_engine_as_it_was():
    """warmup() runs prompts of p - 1 and p tokens for every power of two p from 16 up to its bound, leaves every
    slot free, every cache length 0 and the counters untouched; requests after it get what they get without it;
    it refuses to run while a request holds a slot."""
    wm = _routed(seed=3)
    prompts = _prompts([4, 13, 9])
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    cold = Engine(WideRuntime(wm, max_batch=2, max_seq=64)).run(prompts, sp)
    eng = Engine(WideRuntime(wm, max_batch=2, max_seq=64))
    assert eng.warmup(40) == 4  # 15, 16, 31, 32 (63 and 64 exceed 40)
    assert eng.warmup() == 5  # bound: the context (64 slots, so prompts up to 63 tokens)
    assert int(eng.rt.cache.lens.abs().sum()) == 0 and all(s is None for s in eng.slots)
    assert eng.counters.prompt_tokens == 0 and not eng.counters.requests_finished
    assert [r.token_ids for r in eng.run(prompts, sp)] == [r.token_ids for r in cold]
    eng.submit(prompts[0], sp)
    eng.step()  # admitted: slot 0 is busy
    with pytest.raises(RuntimeError, match="before the engine serves"):
        eng.warmup()


def test_overlap_runs_no_step_too_many_and_a_reused_slot_stays_clean():
    """Overlap (docs/serving.md#overlap): requests ending by length run exactly max_tokens - 1 decode steps; one
    ending by EOS runs at most one step past it; a request admitted into the slot it leaves (while that extra step
    is still launched) gets the tokens it gets alone."""
    wm = _routed(seed=3)
    steps: list[int] = []
    eng = Engine(WideRuntime(wm, max_batch=2, max_seq=40), step_hook=lambda busy, lens, masks: steps.append(len(busy)))
    prompts = _prompts([4, 9, 6], seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 8, 3)]
    free = eng.run(prompts, params)
    assert sum(steps) == sum(p.max_tokens - 1 for p in params)
    toks = free[1].token_ids
    k = toks.index(toks[3])  # the first place the 4th token appears: EOS there ends the request after k tokens
    steps.clear()
    hook = eng.step_hook
    eos = Engine(WideRuntime(wm, max_batch=1, max_seq=40), eos_ids=[toks[3]], step_hook=hook)
    first, second = eos.run(prompts[1:3], [SamplingParams(max_tokens=8), params[2]])
    assert first.finish_reason == "stop" and first.token_ids == toks[:k]
    assert second.token_ids == free[2].token_ids  # same slot, admitted right after the EOS
    assert k + params[2].max_tokens - 1 <= sum(steps) <= k + 1 + params[2].max_tokens - 1
    assert eos.load() == (0, 0) and not eos.has_work()
