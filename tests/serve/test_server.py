"""`wide serve` as a real uvicorn process on an ephemeral port, driven by the official `openai` client: SmolLM2-135M
with the shipped 50% routers for correctness and faults, a tiny random Llama for the load test."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import wide  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `wide serve` subprocess; ``url``: its base URL once /health answers."""

    def __init__(self, *args: str, timeout: float = 300, threads: int | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(Path(wide.__file__).parents[1]))
        if threads is not None:  # intra-op threads (the load test's server shares the cores with 32 client threads)
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "wide.cli", "serve", "--port", str(self.port), "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wide serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("wide serve did not answer /health in time")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_idle(self, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.health()
            if h["active_slots"] == 0 and h["queue_depth"] == 0:
                return h
            time.sleep(0.05)
        return self.health()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def smol():
    s = Server("--routers", "smollm2-135m-s50", "--max-batch", "4", "--max-seq", "512", "--queue-size", "2",
               "--served-model-name", "smol")  # fmt: skip
    yield s
    s.stop()


def test_models_completions_chat_and_streaming(smol):
    c = smol.client()
    assert [m.id for m in c.models.list().data] == ["smol"]
    prompt = "The history of the city begins"
    r = c.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    wide_info = r.model_extra["wide"]  # the sparsity this request ran
    assert 0.3 < wide_info["attention_sparsity"] < 0.7 and 0.3 < wide_info["ffn_sparsity"] < 0.7
    # streamed deltas concatenate to the non-streamed text (greedy)
    chunks = list(c.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # a stop string taken from the text ends it there
    stop = r.choices[0].text[3:6]
    s = c.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == r.choices[0].text.split(stop)[0]
    # seeded sampling reproduces
    a, b = (c.completions.create(model="smol", prompt=prompt, max_tokens=6, temperature=1.0, seed=7) for _ in "ab")
    assert a.choices[0].text == b.choices[0].text
    # chat through the tokenizer's template, streamed == not streamed
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = c.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    streamed = c.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == chat.choices[0].message.content
    assert smol.wait_idle()["active_slots"] == 0


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(model="nope"), 404, "model"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(temperature=-1), 400, "temperature"),
        (dict(top_p=0), 400, "top_p"),
        (dict(top_p=1.5), 400, "top_p"),
        (dict(prompt=""), 400, "prompt"),
        (dict(max_tokens=600), 400, "max_tokens"),  # prompt + max_tokens beyond --max-seq 512
        (dict(n=2), 400, "n"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_stays_up(smol, kwargs, status, param):
    c = smol.client()
    args = dict(model="smol", prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body if "message" in e.value.body else e.value.body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    assert c.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0).choices[0].text is not None


def test_malformed_bodies_and_too_long_chats_get_400(smol):
    for body in (b"{not json", b"[1, 2]", json.dumps({"prompt": 5}).encode()):
        r = httpx.post(smol.url + "/v1/completions", content=body, timeout=30)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(smol.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    c = smol.client()
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "word " * 600}], max_tokens=4)
    assert smol.health()["status"] == "ok"


def test_a_client_that_disconnects_mid_stream_frees_its_slot(smol):
    before = smol.metric('wide_requests_total{finish_reason="cancelled"}')
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", smol.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event arrived; leave
    h = smol.wait_idle()
    assert h["active_slots"] == 0 and h["queue_depth"] == 0
    assert smol.metric('wide_requests_total{finish_reason="cancelled"}') == before + 1


def test_requests_past_the_queue_bound_get_429_with_retry_after(smol):
    """4 slots + a queue of 2: of 10 long requests sent at once, at least 4 are refused at once with 429."""
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
    results: list = []
    opened = threading.Barrier(10)
    release = threading.Event()

    def one() -> None:
        try:
            with httpx.stream("POST", smol.url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    r.read()
                    results.append((r.status_code, r.headers.get("retry-after"), r.json()))
                else:
                    results.append((200, None, None))
                opened.wait(timeout=60)
                release.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while len(results) < 10 and time.time() < deadline:
        time.sleep(0.05)
    release.set()
    for t in threads:
        t.join()
    refused = [r for r in results if r[0] == 429]
    assert len(results) == 10 and len(refused) >= 4 and all(r[0] in (200, 429) for r in results)
    for _, retry, body_ in refused:
        assert retry == "1" and body_["error"]["type"] == "rate_limit_error" and body_["error"]["message"]
    assert smol.wait_idle()["active_slots"] == 0  # the accepted ones were dropped mid-stream: cancelled, freed


def test_load_200_requests_at_concurrency_32(tmp_path):
    """A tiny random Llama served dense: 200 requests, 32 at a time, short outputs: every one answered, none
    failed, every slot free at the end."""
    from wide.model.loading import save_tiny_llama

    path = save_tiny_llama(tmp_path / "tiny")
    # one intra-op thread: spinning OpenMP threads on cores shared with the client threads slow every small op
    server = Server("--model", str(path), "--max-batch", "8", "--max-seq", "64", "--queue-size", "64", threads=1)
    try:
        c = server.client()

        def one(i: int) -> str:
            r = c.completions.create(model=str(path), prompt=f"Request {i}:", max_tokens=4, temperature=0.7, seed=i)
            return r.choices[0].finish_reason

        with ThreadPoolExecutor(32) as pool:
            reasons = list(pool.map(one, range(200)))
        assert len(reasons) == 200 and set(reasons) <= {"length", "stop"}
        h = server.wait_idle()
        assert h["active_slots"] == 0 and h["queue_depth"] == 0
        finished = server.metric('wide_requests_total{finish_reason="length"}')
        finished += server.metric('wide_requests_total{finish_reason="stop"}')
        assert finished == 200
    finally:
        server.stop()
