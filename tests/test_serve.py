"""`fllama serve` end to end on the CPU: a real uvicorn server on 127.0.0.1 (a free port) over the tiny reference
model, driven by the official openai client (chat, completion, streaming, stops, seeds, concurrency) and by raw
HTTP where the client would hide what is tested (the SSE framing, a disconnect mid-stream)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from fllama_cli.server.app import ServeConfig
from fllama_cli.server.runner import start_server
from model_zoo.chat_template import encode_chat
from model_zoo.cpu_fast import CpuModel
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from model_zoo.scheduler import SchedulerConfig
from tests._serve_helpers import assert_same_greedy
from tests.helpers import byte_tokenizer, tiny_model

# the CPU backend on one thread: the scheduler's thread gets its own OpenMP team, which on a busy machine
# would fight the main thread's for the cores
MODEL, TOK = CpuModel(tiny_model(4).weights, threads=1), byte_tokenizer()
CTX = 200


@pytest.fixture(scope="module")
def server():
    with start_server(MODEL, TOK, ServeConfig("tiny", port=0, scheduler=SchedulerConfig(max_batch=4,
                                                                                        max_context=CTX))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alone(prompt, n, eos=True, **sampling):
    cfg = GenerationConfig(max_new_tokens=n, stop_at_eos=eos,
                           sampling=SamplingConfig(**{"temperature": 0.0, **sampling}))
    return generate(MODEL, TOK, [prompt], cfg)[0][0]


def raw(url: str, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def get_json(url: str, path: str) -> dict:
    conn, resp = raw(url, "GET", path)
    try:
        return json.loads(resp.read())
    finally:
        conn.close()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = get_json(server.url, "/health")
    assert h["status"] == "ok" and h["max_batch"] == 4 and h["max_context"] == CTX


def test_chat_completion_is_the_template_prompt_generated(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    want = alone(encode_chat(TOK, messages), 12)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == ("stop" if want.finish_reason == "eos" else "length")
    assert r.usage.prompt_tokens == len(encode_chat(TOK, messages))
    assert r.usage.completion_tokens == len(want.tokens) + (want.finish_reason == "eos")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_from_text_and_from_token_ids(client):
    ids = TOK.encode("Once upon")
    want = alone(ids, 15)
    for prompt in ("Once upon", ids):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=15, temperature=0)
        assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].finish_reason == ("stop" if want.finish_reason == "eos" else "length")


def test_streaming_chat_matches_the_whole_answer(server, client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    conn, resp = raw(server.url, "POST", "/v1/completions", json.dumps(body))
    events = [line for line in resp.read().decode().split("\n\n") if line]
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_stop_strings_cut_the_text(client):
    ids = TOK.encode("stop test")
    free = alone(ids, 40, eos=False).text
    stop = free[10:13]
    r = client.completions.create(model="tiny", prompt="stop test", max_tokens=40, temperature=0, stop=[stop, "@@"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free[:free.find(stop)]
    stream = client.completions.create(model="tiny", prompt="stop test", max_tokens=40, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == free[:free.find(stop)]


def test_seed_repeats_a_sampled_answer(client):
    ask = lambda seed: client.completions.create(model="tiny", prompt="dice", max_tokens=20, temperature=1.3,
                                                 top_p=1.0, seed=seed).choices[0].text
    a, b, c = ask(11), ask(11), ask(12)
    assert a == b and a != c
    extra = client.completions.create(model="tiny", prompt="dice", max_tokens=20, temperature=1.3, seed=11,
                                      extra_body={"top_k": 1, "repetition_penalty": 1.0}).choices[0].text
    assert extra == alone(TOK.encode("dice"), 20).text  # top_k 1 is greedy


def test_concurrent_clients_each_get_their_own_answer(client):
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(10)]  # more than the 4 slots
    budgets = [8 + 3 * i for i in range(10)]

    def one(i):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i], temperature=0)

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    for p, n, r in zip(prompts, budgets, results):
        ids = TOK.encode(p)
        want = alone(ids, n)
        if r.choices[0].text != want.text:  # a near tie decided apart in another batch, else a failure
            got = TOK.encode(r.choices[0].text, add_special_tokens=False)
            assert_same_greedy(MODEL, ids, got, want.tokens)
    assert one(0).choices[0].text == results[0].choices[0].text  # alone now, inside a full batch before


@pytest.mark.parametrize("body, needle", [
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, "does not exist"),
    ({"model": "tiny", "messages": []}, "at least one message"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CTX}, "lower max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}, "shorten it"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n must be 1"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": -7}, "top_k"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]}, "chat template"),
])
def test_bad_requests_get_openai_400s(server, body, needle):
    conn, resp = raw(server.url, "POST", "/v1/chat/completions", json.dumps(body))
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 400 and needle in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_and_long_prompts_and_the_server_lives_on(server, client):
    conn, resp = raw(server.url, "POST", "/v1/completions", '{"model": "tiny", "prompt": ')
    assert resp.status == 400 and "not valid JSON" in json.loads(resp.read())["error"]["message"]
    conn.close()
    with pytest.raises(openai.BadRequestError, match="context holds"):
        client.completions.create(model="tiny", prompt="y" * 300, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=5)
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=3).choices[0].finish_reason
    assert get_json(server.url, "/health")["status"] == "ok"


def test_api_key_is_required_when_set():
    cfg = ServeConfig("tiny", port=0, api_key="s3cret", scheduler=SchedulerConfig(max_batch=1, max_context=64))
    with start_server(MODEL, TOK, cfg) as s:
        for key in ("wrong", "s3cret"[:-1]):
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1
        assert get_json(s.url, "/health")["status"] == "ok"  # health and metrics stay open


class Slow:
    """The tiny model, 10 ms a forward call: streams long enough to disconnect from or queue behind."""

    def __init__(self, model):
        self._m = model

    def forward(self, *args, **kwargs):
        time.sleep(0.01)
        return self._m.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._m, name)


@pytest.fixture
def slow_server():
    cfg = ServeConfig("tiny", port=0, scheduler=SchedulerConfig(max_batch=1, max_context=CTX, max_queue=0))
    with start_server(Slow(MODEL), TOK, cfg) as s:
        yield s


def test_a_disconnect_mid_stream_frees_the_slot(slow_server):
    body = {"model": "tiny", "prompt": "go", "max_tokens": 150, "temperature": 0, "stream": True}
    conn, resp = raw(slow_server.url, "POST", "/v1/completions", json.dumps(body))
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    assert get_json(slow_server.url, "/health")["running"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 10
    while get_json(slow_server.url, "/health")["free_slots"] != 1:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    conn, resp = raw(slow_server.url, "GET", "/metrics")
    metrics = resp.read().decode()
    assert 'fllama_requests_total{finish_reason="cancelled"} 1.0' in metrics
    assert "fllama_time_to_first_token_seconds_count 1.0" in metrics


def test_overload_is_429_with_retry_after(slow_server):
    c = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model="tiny", prompt="busy", max_tokens=100, temperature=0, stream=True)
    next(iter(stream))  # it holds the only slot; the queue takes none
    got = {}

    def second():
        try:
            c.completions.create(model="tiny", prompt="me too", max_tokens=5)
        except openai.RateLimitError as e:
            got["err"] = e

    t = threading.Thread(target=second)
    t.start()
    t.join(20)
    stream.close()
    err = got["err"]
    assert err.status_code == 429 and int(err.response.headers["retry-after"]) >= 1
    assert err.body["code"] == "server_overloaded"


def test_the_load_test_runs_against_the_server(server):
    from tests.load_serve import render, run_load, summarize

    results, wall = run_load(server.url, "tiny", clients=3, requests=5, max_tokens=6, prompt_len=8)
    s = summarize(results, wall, 3)
    assert s["errors"] == 0 and s["requests"] == 5 and s["generated_tokens"] == 30  # ignore_eos: all 6 each
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["throughput_tok_s"] > 0
    assert "TTFT" in render({"model": "tiny", "max_tokens": 6, "prompt_len": 8, **s})


def test_load_summary_of_requests_streamed_in_one_chunk():
    """A fast server can stream a request's tokens in one chunk: no time between tokens to count, no division."""
    from tests.load_serve import Result, summarize

    one = [Result(sent=1.0, first=1.01, chunks=[1.01], tokens=6) for _ in range(3)]
    s = summarize(one, 0.05, 3)
    assert s["generated_tokens"] == 18 and s["decode_tok_s"] == 0.0 and s["throughput_tok_s"] == 360.0
    two = one + [Result(sent=1.0, first=1.01, chunks=[1.01, 1.06], tokens=6)]  # 5 tokens over 50 ms: 10 ms each
    assert summarize(two, 0.1, 4)["decode_tok_s"] == 400.0


def test_serve_command_errors_are_one_line(capsys, monkeypatch, tmp_path):
    import socket

    from tests.test_cli import assert_one_line_error, fllama

    code, out, _ = fllama(capsys, monkeypatch, "serve", "--help")
    assert code == 0 and "--max-batch" in out
    code, _, err = fllama(capsys, monkeypatch, "serve", "llama2-7b", "--scheme", "awq")
    assert_one_line_error(code, err, "--scheme")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = fllama(capsys, monkeypatch, "serve", "llama2-7b", "--random", "--port", str(port))
        assert_one_line_error(code, err, "cannot listen")
