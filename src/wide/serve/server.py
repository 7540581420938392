"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn: the ``serve`` extra).

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text format, written here). ``stream: true`` answers with server-sent events
(``data: {chunk}`` lines, then ``data: [DONE]``).

Invariants:
  * Every 4xx carries an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; the request it
    answers never reached a slot, and other requests are unaffected.
  * A full queue answers 429 with ``Retry-After`` at once (no request waits for queue room).
  * A streaming client that disconnects cancels its request: the engine frees its slot at the next step.
  * The engine runs on its own thread (``Engine.start``); handlers only submit, await Outputs and cancel.
docs/serving.md describes the API and its limits.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from wide.serve.engine import Engine, Histogram, QueueFull, RequestError, Result, SamplingParams


@dataclass
class ApiError(Exception):
    """An error answered as an OpenAI-style body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def _number(body: dict, name: str, default, kind: type):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    return kind(v)


def sampling_params(body: dict, max_tokens_field: str = "max_tokens") -> SamplingParams:
    """The OpenAI fields of a request body -> SamplingParams (ApiError 400 on a wrong type or value)."""
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "only n=1 is served", "n")
    for name, off in (
        ("logprobs", (None, False)),
        ("echo", (None, False)),
        ("best_of", (None, 1)),
        ("suffix", (None, "")),
    ):
        if body.get(name) not in off:
            raise ApiError(400, f"{name} is not served", name)
    max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
    p = SamplingParams(
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", 16, int),
        temperature=_number(body, "temperature", 1.0, float),
        top_p=_number(body, "top_p", 1.0, float),
        top_k=_number(body, "top_k", 0, int),
        seed=_number(body, "seed", None, int),
        stop=stop,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    try:
        p.check()
    except RequestError as e:
        raise ApiError(400, str(e), e.param) from None
    return p


def prometheus_text(engine: Engine) -> str:
    """The engine's state and totals in Prometheus' text exposition format (version 0.0.4)."""
    c = engine.counters
    busy, waiting = engine.load()
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:.10g}" for labels, value in samples)

    def histogram(name: str, help_: str, h: Histogram) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        run = 0
        for bound, n in zip((*h.bounds, float("inf")), h.counts, strict=True):
            run += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{name}_bucket{{le="{le}"}} {run}')
        lines.extend([f"{name}_sum {h.total:.10g}", f"{name}_count {h.count}"])

    metric("wide_generated_tokens_total", "counter", "Tokens generated.", [("", c.generated_tokens)])
    metric("wide_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", c.prompt_tokens)])
    metric("wide_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
           [("", engine.tokens_per_s())])  # fmt: skip
    metric("wide_active_slots", "gauge", "Cache slots holding a running request.", [("", busy)])
    metric("wide_slots", "gauge", "Cache slots (max batch).", [("", engine.max_batch)])
    metric("wide_queue_depth", "gauge", "Requests waiting for a slot.", [("", waiting)])
    metric("wide_requests_total", "counter", "Finished requests by finish reason.",
           [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(c.requests_finished.items())])  # fmt: skip
    histogram("wide_time_to_first_token_seconds", "Time from arrival to the first token.", c.ttft)
    histogram("wide_request_attention_sparsity", "Fraction of attention KV groups a request's tokens skipped.",
              c.attn_sparsity)  # fmt: skip
    histogram("wide_request_ffn_sparsity", "Fraction of FFN channel groups a request's tokens skipped.",
              c.ffn_sparsity)  # fmt: skip
    return "\n".join(lines) + "\n"


def create_app(engine: Engine, tokenizer, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model id ``model_name`` (the engine thread starts with it)."""
    created = int(time.time())

    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="WIDE", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), code=None).response()

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")  # fmt: skip
        return body

    def open_stream(ids: list[int], params: SamplingParams):
        try:
            return engine.astream(ids, params)
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", type="rate_limit_error") from None

    def usage(r: Result) -> dict:
        n = len(r.token_ids)
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": n, "total_tokens": r.prompt_tokens + n}

    def sparsity(r: Result) -> dict:
        return {"attention_sparsity": r.attn_sparsity, "ffn_sparsity": r.ffn_sparsity}

    async def finish(outputs) -> Result:
        res = None
        async for o in outputs:
            res = o.result
        if res.finish_reason == "error":
            raise ApiError(500, f"the engine failed this request: {engine.last_error}", type="server_error")
        return res

    def sse(outputs, chunk) -> StreamingResponse:
        async def events():
            async for o in outputs:
                if o.text or o.finished:
                    reason = o.result.finish_reason if o.finished else None
                    yield f"data: {json.dumps(chunk(o.text, reason))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        busy, waiting = engine.load()
        return {"status": "ok", "active_slots": busy, "queue_depth": waiting, "slots": engine.max_batch}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "wide"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer(prompt).input_ids if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request)", "prompt")
        params = sampling_params(body)
        outputs = open_stream(ids, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None) -> dict:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}

        if body.get("stream"):
            return sse(outputs, chunk)
        r = await finish(outputs)
        return {**chunk(r.text, r.finish_reason), "usage": usage(r), "wide": sparsity(r)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        msgs = body.get("messages")
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )  # fmt: skip
        if not ok:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string content",
                           "messages")  # fmt: skip
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, f"{model_name}'s tokenizer has no chat template: use /v1/completions", "messages")
        text = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in msgs], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        params = sampling_params(body, "max_completion_tokens")
        outputs = open_stream(ids, params)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None) -> dict:
            choice = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": reason}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [choice]}  # fmt: skip

        if body.get("stream"):
            return sse(outputs, chunk)
        r = await finish(outputs)
        choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason}
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name, "choices": [choice],
                "usage": usage(r), "wide": sparsity(r)}  # fmt: skip

    return app


def build_engine(
    model: str,
    routers: str | None,
    *,
    max_batch: int = 8,
    max_seq: int = 2048,
    queue_size: int = 256,
    batch_invariant: bool = False,
    dtype=None,
    device=None,
) -> tuple[Engine, object]:
    """Load ``model`` (and ``routers``: None serves it dense) into a runtime and an engine -> (engine, tokenizer)."""
    import math

    from wide.config import WideConfig
    from wide.model import WideModel, load_model, load_routers

    hf, tok = load_model(model, dtype=dtype, device=device)
    if routers is not None:
        from wide.baselines import method_of
        from wide.config import NO_GROUP_ROUTERS

        if method_of(routers) in NO_GROUP_ROUTERS:
            raise ValueError(f"--routers {routers}: the kernel runtime serves per-group routers")
        wm = load_routers(hf, routers)
    else:  # the dense runtime needs the model's dimensions only; these routers never run
        wm = WideModel(hf, WideConfig(ffn_group_size=math.gcd(hf.config.intermediate_size, 128)))
    wm.eval()
    from wide.runtime import WideRuntime

    rt = WideRuntime(wm, max_batch=max_batch, max_seq=max_seq, routed=routers is not None,
                     batch_invariant=batch_invariant)  # fmt: skip
    eos = getattr(hf.generation_config, "eos_token_id", None)
    eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    engine = Engine(rt, tok, eos_ids=sorted(eos_ids), queue_size=queue_size, batch_invariant=batch_invariant)
    return engine, tok


def serve(engine: Engine, tokenizer, model_name: str, host: str, port: int) -> None:
    """Run the server until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine, tokenizer, model_name), host=host, port=port, log_level="warning")
