"""Hostile clients against the real API server on loopback (the session server of test_server.py,
started under RLIMIT_NOFILE = 1100), and a soak. Every case is bounded in count and time, and is
followed by a normal request that must succeed."""

from __future__ import annotations

import http.client
import json
import os
import random
import resource
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_server
from test_server import LIMITS, NOFILE, TOKEN, Server

# Every test here talks to a real server and its MPI job: not in the fast loop.
pytestmark = pytest.mark.slow

tiny_models = test_server.tiny_models
hf_reference = test_server.hf_reference
server = test_server.server
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


def raw(server: Server, data: bytes, *, timeout: float = 20) -> bytes:
    """Send `data` on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        return _read_all(s)


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except (TimeoutError, ConnectionResetError):
        return out


def post_head(body_len: bytes | None, *, chunked: bool = False, close: bool = True) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + AUTH
    if body_len is not None:
        head += b"Content-Length: " + body_len + b"\r\n"
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n"
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n"


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def body_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def stage_pid(server: Server, stage: int) -> int:
    return server.health()["pipeline"][stage]["pid"]


class Stopped:
    """A pipeline stage SIGSTOPped for the block: requests stay in flight (resumed on exit)."""

    def __init__(self, server: Server, stage: int = 1) -> None:
        self.pid = stage_pid(server, stage)

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def access_lines(server: Server) -> list[str]:
    return [
        ln
        for ln in server.log.read_text(errors="replace").splitlines()
        if "distlm.inference.access" in ln
    ]


def wait_for(what, within_s: float = 20) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------- sampling values


def test_extreme_sampling_values_never_take_the_pipeline_down(server):
    greedy = server.request(
        "POST", "/v1/completions", {"prompt": "A class", "max_tokens": 6, "temperature": 0}
    )[1]
    ok = [
        {"temperature": 1e-40},  # greedy: 1 / t would overflow to inf
        {"temperature": 5e-324},
        {"temperature": 1e300, "seed": 2**63 - 1},
        {"temperature": 1.0, "top_k": 10**30},  # capped at the vocabulary
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1e-4, "top_k": 1},
    ]
    for extra in ok:
        status, body = server.request(
            "POST", "/v1/completions", {"prompt": "A class", "max_tokens": 6, **extra}
        )
        assert status == 200, (extra, body)
        assert body["usage"]["completion_tokens"] == 6
        if extra.get("temperature", 1) < 1e-5:
            assert body["choices"][0]["text"] == greedy["choices"][0]["text"]
        server.ok()
    refused = [
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**70)}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": -1e-40}, "temperature"),
        ({"top_k": -(10**30)}, "top_k"),
        ({"n": 10**30}, "n"),
    ]
    for extra, param in refused:
        status, err = server.request("POST", "/v1/completions", {"prompt": "A class", **extra})
        assert status == 400 and err["error"]["param"] == param, (extra, err)
        server.ok()


# ----------------------------------------------------------------------------- HTTP framing


def test_negative_and_missing_content_length(server):
    body = b'{"prompt": "A class", "max_tokens": 2}'
    for length in (b"-1", b"-100", b"1e3", b"99999999999999999999999"):
        got = raw(server, post_head(length) + body)
        assert status_of(got) in (400, 413), got[:300]
        server.ok()
    got = raw(server, post_head(None))  # no Content-Length, no body
    assert status_of(got) == 400 and "request body is empty" in body_of(got)["error"]["message"]
    server.ok()


def test_oversize_chunked_body_counts_the_bytes_read(server):
    limit = LIMITS["max_request_bytes"]
    chunk = b"x" * 512
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(post_head(None, chunked=True) + b'200\r\n{"prompt": "' + chunk[12:] + b"\r\n")
        got = b""
        for _ in range(4 * limit // len(chunk)):  # bounded: at most 4x the limit is offered
            try:
                s.sendall(b"200\r\n" + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        got = _read_all(s)
    assert status_of(got) == 413, got[:300]
    assert f"over the limit of {limit} bytes" in body_of(got)["error"]["message"]
    server.ok()


def test_slowloris_headers_and_body_get_408(server):
    # the head, one byte at a time, slower than serve.header_timeout_s allows in total
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        head = post_head(b"10")
        got = b""
        for i in range(len(head)):  # bounded by the head's length (0.25 s a byte)
            try:
                s.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.25)
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            break
        s.settimeout(20)
        got += _read_all(s)
    assert status_of(got) == 408, got[:300]
    server.ok()
    # a complete head, then the body stalls: the app's body deadline answers
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(post_head(b"100") + b'{"prompt": ')
        got = _read_all(s)
    assert status_of(got) == 408, got[:300]
    assert "serve.body_timeout_s" in body_of(got)["error"]["message"]
    server.ok()
    # and a connection that never sends anything is closed too
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        got = _read_all(s)
    assert status_of(got) == 408
    server.ok()


def _own_nofile(at_least: int) -> None:
    """This test process holds that many sockets too: its soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least:
        if hard != resource.RLIM_INFINITY and hard < at_least:
            pytest.skip(f"needs {at_least} descriptors, the hard limit here is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (at_least, hard))


def test_an_oversize_body_still_being_sent_gets_its_status(server):
    """A 64 MB body against the 2 KB limit, sent whole before reading, as urllib and requests do:
    the server answers 413 at once and then reads and discards (lingering close, bounded by
    serve.linger_bytes / linger_s), so the client reads the 413 rather than a reset. The same for
    the 400 of a Content-Length of -1, refused by the HTTP parser while the body is on its way."""
    body = b"x" * (64 << 20)
    for length, want in ((str(len(body)).encode(), 413), (b"-1", 400)):
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
            s.sendall(post_head(length, close=False) + body)
            got = _read_all(s)
        assert got and status_of(got) == want, got[:300]
        if want == 413:
            assert "over the limit of 2048" in body_of(got)["error"]["message"]
        server.ok()


def test_a_request_head_over_serve_max_header_bytes_gets_400(server):
    """A request head longer than serve.max_header_bytes (4 KB here) gets a 400 naming the key:
    sent whole (the parser sees it at once), and a header that never ends, sent in pieces (the
    bytes the parser holds for it are counted). A head just within the limit is answered."""
    head = post_head(b"2", close=False)[:-2]  # without the blank line that ends it
    got = raw(server, head + b"X-Big: " + b"a" * 8000 + b"\r\n\r\n{}")
    assert status_of(got) == 400 and b"serve.max_header_bytes" in got, got[:300]
    server.ok()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(head + b"X-Big: ")
        for _ in range(64):  # 64 KB at most, 1 KB a send
            try:
                s.sendall(b"a" * 1024)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)
        got = _read_all(s)
    assert status_of(got) == 400 and b"serve.max_header_bytes" in got, got[:300]
    server.ok()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    body = json.dumps({"prompt": "Hello", "max_tokens": 2})
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Pad": "a" * 3000}
    conn.request("POST", "/v1/completions", body, headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()[:300]
    conn.close()


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return (
            s.recv(1, socket.MSG_PEEK) != b""
        )  # data or EOF; the server sends none unless closing
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def test_1000_idle_connections_never_lock_out_a_client(server):
    """1,000 connections that send nothing (within serve.header_timeout_s, 2 s here): all held
    open, and a normal client is still answered, /health within a second."""
    _own_nofile(1200)
    socks = []
    try:
        t0 = time.monotonic()
        for _ in range(1000):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=20))
        status, _ = server.request("GET", "/health", token=None, timeout=1)
        assert status == 200
        server.ok()
        opened_for = time.monotonic() - t0
        still = sum(_still_open(s) for s in socks)
        if opened_for < LIMITS["header_timeout_s"]:  # else the header deadline closed some
            assert still == 1000, f"{1000 - still} idle connections were closed"
    finally:
        for s in socks:
            s.close()


def test_out_of_descriptors_the_refusal_stays_clear(server):
    """More idle connections than the server's RLIMIT_NOFILE: accept fails with EMFILE, is logged
    and resumes; the header deadline closes the idle ones; afterwards the server serves."""
    _own_nofile(NOFILE + 300)
    socks = []
    try:
        for _ in range(NOFILE + 200):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=20))
        assert wait_for(
            lambda: "out of system resource" in server.log.read_text(errors="replace"), within_s=30
        ), "EMFILE on accept was not logged"
    finally:
        for s in socks:
            s.close()
    server.ok()
    assert server.request("GET", "/health", token=None)[0] == 200


def test_deep_json_and_huge_numbers_get_400(server):
    cases = [
        (b'{"prompt": "A class", "x": ' + b"[" * 900 + b"]" * 900 + b"}", "nested 901 deep"),
        (b'{"prompt": ' + b"{" * 20 + b"}" * 20 + b"}", "serve.max_json_depth"),
        (b'{"prompt": "A class", "max_tokens": ' + b"9" * 1000 + b"}", "serve.max_number_digits"),
        (b'{"prompt": "A class", "temperature": 0.' + b"1" * 500 + b"}", "serve.max_number_digits"),
        (b'{"prompt": "A class", "seed": -' + b"9" * 40 + b"}", "serve.max_number_digits"),
        (b'{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "max_tokens": 2}', None),  # in a string
    ]
    for body, fragment in cases:
        status, err = server.request("POST", "/v1/completions", body)
        if fragment is None:
            assert status == 200, err
        else:
            assert status == 400 and fragment in err["error"]["message"], (body[:60], err)
        server.ok()


def test_hostile_chat_messages_get_4xx_naming_the_field(server):
    """Messages are checked before any template renders them (the shared server's folder has
    none, so each case below would otherwise be that 400): oversized, deep, ill-typed."""
    user = {"role": "user", "content": "A class"}

    def chat(messages, **extra):
        return json.dumps({"messages": messages, "max_tokens": 2, **extra}).encode()

    cases = [
        (chat([user] * 200), 413, None, "over the limit of 2048"),  # ~ 8 KB of messages
        (chat([{"role": "user", "content": "x" * 3000}]), 413, None, "serve.max_request_bytes"),
        (chat([{"role": "user", "content": [[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]}]), 400, None,
         "serve.max_json_depth"),
        (chat({"role": "user", "content": "A"}), 400, "messages", "a non-empty list of messages"),
        (chat([]), 400, "messages", "a non-empty list"),
        (chat(None), 400, "messages", "a non-empty list"),
        (chat([user, user, ["user", "A"]]), 400, "messages[2]", "an object with role and content"),
        (chat([user, {"role": "tool", "content": "x"}]), 400, "messages[1].role", "'assistant'"),
        (chat([{"role": None, "content": "x"}]), 400, "messages[0].role", "got None"),
        (chat([{"role": {"$gt": ""}, "content": "x"}]), 400, "messages[0].role", "expected one"),
        (chat([{"role": "user"}]), 400, "messages[0].content", "required"),
        (chat([{"role": "assistant", "content": None}]), 400, "messages[0].content", "a string"),
        (chat([{"role": "user", "content": 1e300}]), 400, "messages[0].content", "a string"),
        (chat([{"role": "user", "content": ["A", "B"]}]), 400, "messages[0].content[0]", "text part"),
        (chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         400, "messages[0].content[0]", "text part"),
        (chat([{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400,
         "messages[0].content[0]", "text part"),
        (chat([{"role": "user", "content": "x", "\x1b[31m": 1}]), 400, "messages[0].\x1b[31m",
         "unknown field"),
        (chat([{"role": "user", "content": "x", "tool_calls": []}]), 400,
         "messages[0].tool_calls", "unknown field"),
        (chat([{"role": "user", "content": "x", "name": ["a"]}]), 400, "messages[0].name",
         "a string"),
        (chat([user], logprobs=5), 400, "logprobs", "valid boolean"),
        (chat([user], logprobs=True, top_logprobs=10**30), 400, "top_logprobs", "0..20"),
        (chat([user], logprobs=True, top_logprobs=-1), 400, "top_logprobs", "0..20"),
        (chat([user], top_logprobs=2), 400, "top_logprobs", "needs logprobs: true"),
        (chat([user], max_tokens=2, max_completion_tokens=3), 400, "max_completion_tokens",
         "give one of them"),
        (chat([user], tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
         "not supported"),
        (chat([user], prompt="A class"), 400, "prompt", "unknown field (OpenAI's chat"),
    ]  # fmt: skip
    for body, status, param, fragment in cases:
        got, err = server.request("POST", "/v1/chat/completions", body)
        assert got == status, (body[:80], err)
        assert fragment in err["error"]["message"] and err["error"]["param"] == param, err
        assert err["error"]["type"] == "invalid_request_error"
        server.ok()


def test_control_characters_in_the_request_line_are_escaped_in_the_log(server):
    for line in (
        b"GET /\x1b[31mred\x07 HTTP/1.1",
        b"GET /%1b[2J%07%00%0d%0abell HTTP/1.1",
        b"G\x1bET / HTTP/1.1",
    ):
        got = raw(server, line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status_of(got) in (400, 404), got[:200]
        server.ok()
    text = server.log.read_bytes()
    assert b"\x1b" not in text and b"\x07" not in text and b"\x00" not in text
    assert any("GET /\\x1b[2J\\x07\\x00\\r\\nbell 404" in ln for ln in access_lines(server))


# ----------------------------------------------------------------------------- cancellation


def _cancelled(server: Server) -> float:
    return server.metrics().get('distlm_sequences_total{reason="cancelled"}', 0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_disconnect_frees_the_lane(server, stream):
    before = _cancelled(server)
    body = json.dumps({"prompt": "A class", "max_tokens": 20, "stream": stream}).encode()
    with Stopped(server):  # the sequence stays in flight until the client is gone
        s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        s.sendall(post_head(str(len(body)).encode()) + body)
        assert wait_for(lambda: server.health()["lanes_busy"] >= 1)
        if stream:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")  # the stream started
        n = len(access_lines(server))
        s.close()
        assert wait_for(
            lambda: any("cancelled=client gone" in ln for ln in access_lines(server)[n:])
        )
    assert server.lanes_free()
    assert _cancelled(server) == before + 1  # ended as cancelled, not generated to the end
    server.ok()


def test_a_full_queue_answers_429_with_retry_after(server):
    capacity = 4 + LIMITS["max_queued_sequences"]  # inference.lanes + serve.max_queued_sequences
    with ThreadPoolExecutor(1) as pool, Stopped(server):  # resumed before the pool waits
        first = pool.submit(
            server.request,
            "POST",
            "/v1/completions",
            {"prompt": "A class", "max_tokens": 2, "n": capacity},
        )
        assert wait_for(lambda: server.health()["open"] == capacity)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "A", "max_tokens": 2}),
            {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        r = conn.getresponse()
        err = json.loads(r.read())
        conn.close()
        assert r.status == 429 and r.getheader("Retry-After") == "1"
        assert "serve.max_queued_sequences" in err["error"]["message"]
    status, body = first.result(timeout=60)
    assert status == 200 and len(body["choices"]) == capacity
    server.ok()


@pytest.mark.slow
def test_a_timed_out_request_is_cancelled_in_the_pipeline(tiny_models, tmp_path):
    s = test_server.start_server(
        tiny_models[2], 2, tmp_path, serve={"request_timeout_s": 3}, timeout_s=60
    )
    try:
        before = _cancelled(s)
        with Stopped(s):
            status, err = s.request("POST", "/v1/completions", {"prompt": "A", "max_tokens": 5})
            assert status == 504 and "serve.request_timeout_s" in err["error"]["message"]
            # streamed: the stream's last event is the 504 (its status went out at its start)
            t0 = time.monotonic()
            body = {"prompt": "A", "max_tokens": 5, "stream": True}
            status, text = s.request("POST", "/v1/completions", body)
            assert 2.5 < time.monotonic() - t0 < 30
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            assert status == 200 and "error" in events[-1], text
            message = events[-1]["error"]["message"]
            assert "the stream not done within the request timeout" in message
            assert "serve.request_timeout_s" in message
            assert "[DONE]" not in text
        assert s.lanes_free()
        assert _cancelled(s) == before + 2
        s.ok()
    finally:
        test_server.stop_server(s)


# ----------------------------------------------------------------------------- soak


@pytest.mark.slow
@pytest.mark.with_requeue  # a fixed 60 s: tests/run.sh runs it beside the SLURM waits
def test_soak_16_clients_for_60_s(server, hf_reference):
    """Streamed, plain and bad requests from 16 clients for 60 s: every good request answered in
    full, and the counts match /metrics."""
    prompts = test_server.PROMPTS
    want = {
        p: hf_reference.tokenizer.decode(hf_reference(p, 8), skip_special_tokens=True)
        for p in prompts
    }
    before = server.metrics()
    stop_at = time.monotonic() + 60
    lock = threading.Lock()
    counts = {"200": 0, "400": 0, "429": 0, "tokens": 0, "wrong": []}

    def one(rng: random.Random) -> None:
        kind = rng.choice(["plain", "stream", "bad"])
        p = rng.choice(prompts)
        if kind == "bad":
            status, _ = server.request("POST", "/v1/completions", {"prompt": p, "top_p": 7})
            with lock:
                counts[str(status)] = counts.get(str(status), 0) + 1
            return
        body = {"prompt": p, "max_tokens": 8, "temperature": 0, "stream": kind == "stream"}
        status, got = server.request("POST", "/v1/completions", body)
        with lock:
            counts[str(status)] = counts.get(str(status), 0) + 1
        if status == 429:
            time.sleep(0.2)
            return
        if kind == "stream":
            events = [json.loads(ln[6:]) for ln in got.splitlines() if ln.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            ok = got.rstrip().endswith("data: [DONE]") and text == want[p]
            n = 8
        else:
            text = got["choices"][0]["text"]
            ok = text == want[p] and got["usage"]["completion_tokens"] == 8
            n = got["usage"]["completion_tokens"]
        with lock:
            counts["tokens"] += n
            if not ok or status != 200:
                counts["wrong"].append((kind, p, status, str(got)[:200]))

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            one(rng)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    assert not counts["wrong"], counts["wrong"][:5]
    assert counts["200"] > 50 and counts["400"] > 10
    assert server.lanes_free()
    after = server.metrics()

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    for status in ("200", "400", "429"):
        key = f'distlm_requests_total{{route="/v1/completions",status="{status}"}}'
        assert grew(key) == counts[status], (status, counts)
    assert grew("distlm_generation_tokens_total") == counts["tokens"]
    assert grew('distlm_sequences_total{reason="length"}') == counts["200"]
    server.ok()
