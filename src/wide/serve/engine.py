"""A continuous-batching engine over ``WideRuntime``'s static cache: one request per cache row ("slot").

One scheduler iteration (``Engine.step``):
  1. apply cancellations (a cancelled request's slot is freed at once);
  2. admit waiting requests, oldest first, into free slots, lowest slot first: each is prefilled ALONE into its
     row (``WideRuntime.prefill(ids, slot)``: no other row is read or written) and its first token is sampled;
  3. launch one decode step over rows [0, B), B = the padded size (1, 2, 4, 8, 16, ... <= max_batch) covering the
     highest busy slot (``max_batch`` in batch-invariant mode); each row at its own cache length, idle rows inside
     B flagged inactive (they run no attention / FFN group; docs/serving.md#what-idle-rows-compute); its tokens
     are sampled on the device and stay there as the next step's inputs;
  4. take the PREVIOUS step's tokens (read back while this one runs: docs/serving.md#overlap): append, finish on
     EOS / a stop string / max_tokens, free the slot at once.

Invariants:
  * Only the engine thread (whoever calls ``step``) touches the runtime and the slots; ``submit`` and ``cancel``
    are thread-safe and only queue work under the lock.
  * A request's tokens depend on its prompt, its sampling settings and seed, and (in batch-invariant mode) on
    nothing else; outside it, on a GPU, the rounding of its logits may depend on its batch-mates.
  * Prompt + max_tokens never exceeds the context (min of the model's max_position_embeddings and the cache's
    max_seq): checked at ``submit``, so a running request never overflows its row.
  * Streamed text deltas concatenate to the final text: text that could still become a stop string, or an
    incomplete UTF-8 character, is held back until it cannot.
  * On CUDA each padded batch size replays its own ``GraphedDecode``, captured when the engine is built.
  * Overlap: at most one launched step is not yet taken. A row runs in a step only while its tokens taken plus
    pending stay below max_tokens, so a request ending by length never runs a step too many; one ending by EOS,
    a stop string or a cancel may have run one more step, whose token is dropped (its cost is counted in its
    ``tokens_run``). Its slot may take a new request at once: the new prefill is queued after that step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from wide.runtime import WideRuntime
from wide.runtime.generate import GraphedDecode, groups_run, step_masks
from wide.serve.sampling import request_generator, sample, sample_tokens


class RequestError(ValueError):
    """A request the engine refuses (bad settings, too long); ``param``: the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """More waiting requests than the engine's queue bound."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings (OpenAI names). temperature 0: greedy; top_k 0 / top_p 1: off; seed None:
    a fresh random seed; stop: strings that end the text (not included in it); ignore_eos: run to max_tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        """RequestError naming the first setting out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens}", "max_tokens")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0: off), got {self.top_k}", "top_k")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty", "stop")


@dataclass
class Result:
    """A finished request. finish_reason: "stop" (EOS or a stop string), "length" (max_tokens), "cancelled" or
    "error". Sparsities: the fraction of attention / FFN groups its tokens skipped (prompt and generated tokens
    the model ran), None when dense."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float | None
    latency_s: float
    attn_sparsity: float | None
    ffn_sparsity: float | None


@dataclass
class Output:
    """One request's progress from one engine step: new token ids, new text, and its Result once finished."""

    request_id: str
    token_ids: list[int]
    text: str
    result: Result | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class _Request:
    """The engine's state of one request (owned by the engine thread once admitted)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Output], None]
    arrived: float
    generator: torch.Generator | None = None
    slot: int | None = None
    out: list[int] = field(default_factory=list)
    text: str = ""  # text of ``out`` up to a stop string
    emitted: int = 0  # characters of ``text`` already sent
    first_token_at: float | None = None
    tokens_run: int = 0  # tokens the model ran for it: the prompt and every decode step it ran in
    pending: int = 0  # tokens sampled on the device, not yet taken (0 or 1 between engine steps)
    done: bool = False  # finished: a launched step's token for it is dropped


@dataclass
class _Launched:
    """A decode step launched and not yet taken: its requests (busy-slot order) and their sampled tokens, valid on
    the host once ``ready`` has fired (None on the CPU: valid at once)."""

    rows: list[_Request]
    picks: torch.Tensor  # [N] int64, host (pinned on CUDA)
    ready: torch.cuda.Event | None


@dataclass
class Histogram:
    """Counts of observations <= each bound (Prometheus' cumulative buckets are sums of these), their sum and
    count: fixed memory however many requests pass."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, then one for +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if v <= b), len(self.bounds))] += 1
        self.total += v
        self.count += 1


_TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SPARSITY_BOUNDS = tuple(i / 10 for i in range(1, 11))


@dataclass
class EngineCounters:
    """Totals since the engine started (the server's /metrics reads them)."""

    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish_reason
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BOUNDS))  # seconds, per finished request
    attn_sparsity: Histogram = field(default_factory=lambda: Histogram(_SPARSITY_BOUNDS))  # per routed request
    ffn_sparsity: Histogram = field(default_factory=lambda: Histogram(_SPARSITY_BOUNDS))


def padded_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes the engine runs: powers of two below max_batch, and max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch} | {max_batch})


class Engine:
    """Continuous batching over ``rt``'s cache rows. ``tokenizer`` (optional): decodes text for stop strings and
    streaming (without it, requests give token ids and text stays empty); ``eos_ids``: tokens that end a request
    (default: the tokenizer's EOS); ``queue_size``: most waiting requests (``QueueFull`` past it);
    ``max_context``: the model's context (default: its config's max_position_embeddings);
    ``batch_invariant``: decode every step at max_batch rows (with the runtime built ``batch_invariant=True``, a
    request's greedy tokens then do not depend on its batch-mates); ``cuda_graphs``: replay captured decode steps
    on CUDA; ``step_hook(busy slots, their cached tokens before the step, the step's masks)``: called after every
    decode step (benchmarks: the bytes a step reads)."""

    def __init__(
        self,
        rt: WideRuntime,
        tokenizer=None,
        *,
        eos_ids: Sequence[int] | None = None,
        queue_size: int = 256,
        max_context: int | None = None,
        batch_invariant: bool | None = None,
        cuda_graphs: bool = True,
        step_hook: Callable[[list[int], list[int], list], None] | None = None,
    ):
        self.rt, self.tokenizer = rt, tokenizer
        self.max_batch, self.max_seq = rt.cache.k.shape[1], rt.cache.k.shape[2]
        self.device = rt.cache.k.device
        if eos_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_ids = [] if eos is None else [eos]
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.queue_size = queue_size
        model_ctx = getattr(rt.hf.config, "max_position_embeddings", None)
        self.max_context = min(c for c in (max_context, model_ctx, self.max_seq) if c is not None)
        self.batch_invariant = rt.batch_invariant if batch_invariant is None else batch_invariant
        self.sizes = [self.max_batch] if self.batch_invariant else padded_sizes(self.max_batch)
        self.slots: list[_Request | None] = [None] * self.max_batch
        self.counters = EngineCounters()
        self._waiting: deque[_Request] = deque()
        self._cancel: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last steps: tokens/s
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_error: str | None = None  # the last failed step's exception (its requests ended with "error")
        n_layers, routed = len(rt.layers), rt.routed
        # per slot: groups run so far (attention, FFN), summed over layers and tokens; device-side, read at finish
        self._ran = torch.zeros(self.max_batch, 2, dtype=torch.float64, device=self.device)
        self._groups = (n_layers * rt.wm.dims.n_kv_heads, n_layers * rt.weights[0].w_down.shape[1] // rt.g_ffn)
        self._meter = routed
        self.step_hook = step_hook
        # overlap (docs/serving.md#overlap): per slot the latest token sampled on the device, the next step's input
        # until the host has taken it; the launched, untaken step; per step parity, a host buffer of its inputs and
        # one of its tokens (pinned on CUDA: a copy from pageable memory would wait for the step in flight). A
        # step's buffers are written again two steps later, after the host has waited for it.
        self._last = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        self._inflight: _Launched | None = None
        pin = self.device.type == "cuda"
        self._stage = [torch.zeros(3 * self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._pick_bufs = [torch.zeros(self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self._graphs: dict[int, GraphedDecode] = {}
        if cuda_graphs and self.device.type == "cuda":
            rt.cache.reset()
            self._graphs = {b: GraphedDecode(rt, b, rows=True) for b in self.sizes}

    def warmup(self, max_prompt: int | None = None) -> int:
        """Prefill throw-away prompts of every length class the routed prefill kernels tune or compile for, so that
        no request pays it (docs/serving.md#warm-up): for each power of two p from 16 up to ``max_prompt`` (default:
        the context), prompts of p - 1 and p tokens (``m_bucket`` classes and Triton's divisible-by-16
        specialisation). Runs in slot 0, which must be free and is left free; no counter moves. -> prompts run."""
        if any(r is not None for r in self.slots) or self._thread is not None:
            raise RuntimeError("warmup() runs before the engine serves (every slot free, loop not started)")
        top = min(self.max_context - 1, max_prompt or self.max_context)
        lengths = sorted({n for p in (1 << k for k in range(4, max(4, top.bit_length()) + 1))
                          for n in (p - 1, p) if 1 <= n <= top})  # fmt: skip
        vocab = self.rt.hf.config.vocab_size
        g = torch.Generator().manual_seed(0)
        for n in lengths:
            ids = torch.randint(0, vocab, (1, n), generator=g).to(self.device)
            self.rt.prefill(ids, slot=0)
            self.rt.cache.release(0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(lengths)

    # ------------------------------------------------------------------ client side (any thread)
    def submit(
        self, prompt: Sequence[int], params: SamplingParams | None = None, sink: Callable[[Output], None] | None = None
    ) -> str:
        """Queue a request (prompt: token ids) -> its id. ``sink`` receives its Outputs from the engine thread.
        RequestError for bad settings or too long a request; QueueFull past the queue bound."""
        params = params or SamplingParams()
        params.check()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        need = len(prompt) + params.max_tokens
        if need > self.max_context:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the context of "
                f"{self.max_context} tokens (the smaller of the model's max_position_embeddings and the server's "
                "max_seq)",
                "max_tokens",
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the engine's tokenizer", "stop")
        vocab = self.rt.hf.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        with self._lock:
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue bound); retry later")
            rid = f"req-{next(self._ids)}"
            self._waiting.append(_Request(rid, prompt, params, sink or (lambda o: None), time.perf_counter()))
            self._wake.notify()
        return rid

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step boundary (its slot is freed then; its sink gets a "cancelled" result)."""
        with self._lock:
            self._cancel.add(request_id)
            self._wake.notify()

    def load(self) -> tuple[int, int]:
        """(busy slots, waiting requests)."""
        with self._lock:
            return sum(r is not None for r in self.slots), len(self._waiting)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Tokens generated per second over the last ``window_s``."""
        now = time.perf_counter()
        with self._lock:
            n = sum(k for t, k in self._recent if now - t <= window_s)
        return n / window_s

    # ------------------------------------------------------------------ the loop
    def has_work(self) -> bool:
        with self._lock:
            busy = self._inflight is not None or any(r is not None for r in self.slots)
            return bool(self._waiting or self._cancel) or busy

    @torch.no_grad()
    def step(self) -> None:
        """One scheduler iteration: cancellations, admissions (prefill), the launch of one decode step, the take of
        the step launched before it."""
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            kept = deque(r for r in self._waiting if r.id not in cancel)
            dropped = [r for r in self._waiting if r.id in cancel]
            self._waiting = kept
        for r in dropped:
            self._finish(r, "cancelled")
        for r in self.slots:
            if r is not None and r.id in cancel:
                self._finish(r, "cancelled")
        while True:
            slot = next((i for i, r in enumerate(self.slots) if r is None), None)
            with self._lock:
                if slot is None or not self._waiting:
                    break
                r = self._waiting.popleft()
            self._admit(r, slot)
        busy = [i for i, r in enumerate(self.slots) if r is not None and len(r.out) + r.pending < r.params.max_tokens]
        prev, self._inflight = self._inflight, None
        if busy:
            self._inflight = self._launch(busy)
        if prev is not None:
            self._collect(prev)

    def _admit(self, r: _Request, slot: int) -> None:
        r.slot, self.slots[slot] = slot, r
        r.generator = request_generator(r.params.seed, self.device) if r.params.temperature > 0 else None
        ids = torch.tensor([r.prompt], dtype=torch.long, device=self.device)  # [1, T]
        logits = self.rt.prefill(ids, slot=slot)  # [1, V]
        r.tokens_run = len(r.prompt)
        if self._meter:
            self._ran[slot] = groups_run([(m.attn, m.ffn) for m in self.rt.last_masks], 1)[0]
        self.counters.prompt_tokens += len(r.prompt)
        self._take(r, sample(logits, [r.params.temperature], [r.params.top_k], [r.params.top_p], [r.generator])[0])

    def _launch(self, busy: list[int]) -> _Launched:
        """Queue one decode step of the busy slots and the sampling of their next tokens; no host sync."""
        b = next(s for s in self.sizes if s > busy[-1])
        rows = [self.slots[i] for i in busy]
        # one host-to-device copy per step: ids [b] (-1: the token is still on the device) | active [b] | busy [n]
        flip, self._flip = self._flip, self._flip ^ 1
        host = self._stage[flip][: 2 * b + len(busy)]
        view = host.numpy()  # writes through numpy: a tensor item assignment costs microseconds, this nanoseconds
        view[:] = 0
        for i, r in zip(busy, rows, strict=True):
            view[i], view[b + i] = (r.out[-1] if r.pending == 0 else -1), 1
        view[2 * b :] = busy
        dev = host.to(self.device, non_blocking=True)
        active, sel = dev[b : 2 * b].bool(), dev[2 * b :]
        ids = torch.where(dev[:b] < 0, self._last[:b], dev[:b]).view(b, 1)  # [b, 1]
        graph = self._graphs.get(b)
        if graph is not None:  # the graph also counts the groups each row ran
            logits, masks, ran = graph(ids, active), graph.masks, graph.ran
        else:
            logits, masks = self.rt.decode(ids, active), step_masks(self.rt)
            ran = groups_run(masks, b) if self._meter else None
        if self._meter:
            self._ran[:b] += ran
        if self.step_hook is not None:
            self.step_hook(busy, [r.tokens_run for r in rows], masks)
        picks = sample_tokens(
            logits.index_select(0, sel),
            [r.params.temperature for r in rows],
            [r.params.top_k for r in rows],
            [r.params.top_p for r in rows],
            [r.generator for r in rows],
        )  # [n] on the device
        self._last.index_copy_(0, sel, picks)
        buf = self._pick_bufs[flip][: len(rows)]
        buf.copy_(picks, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for r in rows:
            r.tokens_run += 1
            r.pending += 1
        return _Launched(rows, buf, ready)

    def _collect(self, step: _Launched) -> None:
        """Take a launched step's tokens (waits for it); a request finished since it launched drops its token."""
        if step.ready is not None:
            step.ready.synchronize()
        for r, tok in zip(step.rows, step.picks.tolist(), strict=True):
            if r.done:
                continue
            r.pending -= 1
            self._take(r, tok)

    def _take(self, r: _Request, tok: int) -> None:
        """Append a sampled token to r, emit its progress, finish it when it ends."""
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
        with self._lock:
            self._recent.append((now, 1))
            while self._recent and now - self._recent[0][0] > 60:
                self._recent.popleft()
        self.counters.generated_tokens += 1
        p = r.params
        if tok in self.eos_ids and not p.ignore_eos:  # EOS ends the text; it is not part of it
            self._finish(r, "stop")
            return
        r.out.append(tok)
        reason = "length" if len(r.out) >= p.max_tokens else None
        hold = 0
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            cut = _first_stop(text, p.stop, max(0, r.emitted - max((len(s) for s in p.stop), default=0)))
            if cut is not None:
                text, reason = text[:cut], "stop"
            elif reason is None:
                hold = _holdback(text, p.stop)
            r.text = text
        if reason is not None:
            self._finish(r, reason, [tok])
            return
        new = r.text[r.emitted : len(r.text) - hold]
        r.emitted += len(new)
        r.sink(Output(r.id, [tok], new))

    def _finish(self, r: _Request, reason: str, toks: list[int] | None = None) -> None:
        now = time.perf_counter()
        r.done = True
        new = r.text[r.emitted :]  # the rest, held back until now
        r.emitted = len(r.text)
        attn = ffn = None
        if r.slot is not None:
            if self._meter and r.tokens_run:
                ran = self._ran[r.slot].tolist()
                attn = 1 - ran[0] / (r.tokens_run * self._groups[0])
                ffn = 1 - ran[1] / (r.tokens_run * self._groups[1])
            self.slots[r.slot] = None
        ttft = None if r.first_token_at is None else r.first_token_at - r.arrived
        res = Result(r.id, len(r.prompt), list(r.out), r.text, reason, ttft, now - r.arrived, attn, ffn)
        c = self.counters
        c.requests_finished[reason] = c.requests_finished.get(reason, 0) + 1
        if ttft is not None:
            c.ttft.observe(ttft)
        if attn is not None:
            c.attn_sparsity.observe(attn)
            c.ffn_sparsity.observe(ffn)
        r.sink(Output(r.id, toks or [], new, res))

    # ------------------------------------------------------------------ drivers
    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Result]:
        """Run requests to completion on this thread (all submitted at once; the engine must not be started)."""
        if self._thread is not None:
            raise RuntimeError("the engine's thread is running: use stream() / submit()")
        ps = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results: dict[str, Result] = {}

        def keep(o: Output) -> None:
            if o.result is not None:
                results[o.request_id] = o.result

        ids = [self.submit(p, sp, keep) for p, sp in zip(prompts, ps, strict=True)]
        while len(results) < len(ids):
            self.step()
        return [results[i] for i in ids]

    def start(self) -> None:
        """Run the scheduler loop on a daemon thread (``stream`` / ``astream`` / ``submit`` from any thread)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="wide-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            with self._lock:
                self._stopping = True
                self._wake.notify()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not (
                    self._waiting or self._cancel or any(r is not None for r in self.slots)
                ):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a failed step fails its requests, not the engine
                self._fail_all(f"{type(e).__name__}: {e}")

    def _fail_all(self, why: str) -> None:
        self._inflight = None  # its tokens are dropped with its requests
        for r in self.slots:
            if r is not None:
                r.text = r.text[: r.emitted]
                self._finish(r, "error")
        self.rt.cache.reset()
        self.last_error = why

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None) -> Iterator[Output]:
        """Submit a request and yield its Outputs as the engine thread makes them (starts the thread). Closing the
        iterator early cancels the request."""
        import queue

        q: queue.Queue[Output] = queue.Queue()
        self.start()
        rid = self.submit(prompt, params, q.put)
        done = False
        try:
            while not done:
                o = q.get()
                done = o.finished
                yield o
        finally:
            if not done:
                self.cancel(rid)

    def astream(self, prompt: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[Output]:
        """``stream`` for asyncio (call it inside the running loop): submits at once (RequestError / QueueFull
        raise here), then Outputs cross into the loop (``call_soon_threadsafe``); a consumer that stops early
        (client disconnect, task cancelled) cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Output] = asyncio.Queue()
        self.start()
        rid = self.submit(prompt, params, lambda o: loop.call_soon_threadsafe(q.put_nowait, o))
        return self._drain(rid, q)

    async def _drain(self, rid: str, q: asyncio.Queue) -> AsyncIterator[Output]:
        done = False
        try:
            while not done:
                o = await q.get()
                done = o.finished
                yield o
        finally:
            if not done:
                self.cancel(rid)


def _first_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string in text at or after ``start``, or None."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text not to stream yet: an incomplete UTF-8 character (U+FFFD) or the longest
    suffix that is a proper prefix of a stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    if text.endswith("\ufffd"):
        n = max(n, 1)
    return n
