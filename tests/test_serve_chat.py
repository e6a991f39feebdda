"""POST /v1/chat/completions against a real server whose model folder has a chat template: the
openai client's `chat.completions.create` (streamed and not, n, stop, logprobs, usage), greedy
chat equal to the completions route on the rendered prompt, and lm-eval's
`local-chat-completions` model equal to its `hf` model with the same template. A folder without a
template (the shared server of test_server.py) and hostile messages: test_server.py,
test_serve_hostile.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_server
from test_server import TOKEN, client, start_server, stop_server

# Every test here talks to a real server and its MPI job: not in the fast loop.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
tiny_models = test_server.tiny_models
# a small Jinja chat template, as a tokenizer_config.json carries one; it refuses a system
# message that is not the first, as real templates refuse what they cannot render
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You answer in Python terms."},
    {"role": "user", "content": "A class"},
]


@pytest.fixture(scope="module")
def chat_server(tiny_models, tmp_path_factory):
    """A one-stage server on a copy of the tiny 1-stage folder, its tokenizer given TEMPLATE."""
    tmp = tmp_path_factory.mktemp("chat")
    folder = tmp / "s1"
    shutil.copytree(tiny_models[1], folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    server = start_server(folder, 1, tmp, lanes=4, timeout_s=30)
    yield server
    stop_server(server)


def rendered(server) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.folder)
    return list(tok.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])


def test_chat_greedy_equals_completions_on_the_rendered_prompt(chat_server):
    """Token for token, with the same log-probabilities; usage counts the rendered prompt."""
    c = client(chat_server)
    ids = rendered(chat_server)
    r = c.chat.completions.create(
        model="s1", messages=CHAT, max_tokens=9, temperature=0, logprobs=True, top_logprobs=3
    )
    want = c.completions.create(model="s1", prompt=ids, max_tokens=9, temperature=0, logprobs=3)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.system_fingerprint == want.system_fingerprint  # the same weights answered both
    assert r.system_fingerprint.startswith("fp_")
    assert choice.message.role == "assistant" and choice.message.content == want.choices[0].text
    assert choice.finish_reason == want.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 9 and r.usage.total_tokens == len(ids) + 9
    lp, wlp = choice.logprobs.content, want.choices[0].logprobs
    assert [t.token for t in lp] == wlp.tokens and len(lp) == 9
    assert [t.logprob for t in lp] == pytest.approx(wlp.token_logprobs, abs=1e-6)
    for t, top in zip(lp, wlp.top_logprobs):
        assert t.bytes == list(t.token.encode())
        assert {a.token: a.logprob for a in t.top_logprobs} == pytest.approx(top, abs=1e-6)
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    # logprobs without top_logprobs: the chosen token's, no alternatives; none unless asked
    r = c.chat.completions.create(model="s1", messages=CHAT, max_tokens=2, logprobs=True)
    assert [t.top_logprobs for t in r.choices[0].logprobs.content] == [[], []]
    r = c.chat.completions.create(model="s1", messages=CHAT, max_completion_tokens=2)
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 2


def test_chat_stream_n_stop_and_usage(chat_server):
    c = client(chat_server)
    whole = c.chat.completions.create(model="s1", messages=CHAT, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    chunks = list(
        c.chat.completions.create(
            model="s1",
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"  # the role first, then the content
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:-1])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(rendered(chat_server))
    # stop: cut before the first stop string, streamed too
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    r = c.chat.completions.create(model="s1", messages=CHAT, max_tokens=12, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        c.chat.completions.create(model="s1", messages=CHAT, max_tokens=12, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # n > 1, sampled: choice j is its own request with seed + j
    r = c.chat.completions.create(
        model="s1", messages=CHAT, max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=40
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    alone = [
        c.chat.completions.create(
            model="s1", messages=CHAT, max_tokens=8, temperature=1.0, top_p=0.9, seed=40 + j
        )
        .choices[0]
        .message.content
        for j in range(3)
    ]
    assert [ch.message.content for ch in r.choices] == alone and len(set(alone)) > 1
    # streamed n > 1: each choice opens with its role, and the texts are the same
    chunks = list(
        c.chat.completions.create(
            model="s1", messages=CHAT, max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=40,
            stream=True,
        )
    )  # fmt: skip
    for j in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in mine) == alone[j]
    assert chat_server.lanes_free()


def test_chat_content_parts_and_the_template_refusing(chat_server):
    """Text parts are joined by newlines (as vLLM gives them to a string template); a template
    that refuses the conversation is a 400 quoting it, and the server goes on."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "b"}]}
    ]
    joined = [{"role": "user", "content": "A\nb"}]
    answers = [
        chat_server.request(
            "POST", "/v1/chat/completions", {"messages": m, "max_tokens": 4, "temperature": 0}
        )
        for m in (parts, joined)
    ]
    assert answers[0][0] == 200 and answers[0][1]["choices"] == answers[1][1]["choices"]
    assert answers[0][1]["usage"] == answers[1][1]["usage"]
    status, err = chat_server.request(
        "POST", "/v1/chat/completions", {"messages": CHAT[::-1], "max_tokens": 4}
    )
    assert status == 400 and err["error"]["param"] == "messages", err
    assert "a system message must come first" in err["error"]["message"]
    status, err = chat_server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 80}]}
    )
    assert status == 400 and "a chat completions prompt is never truncated" in str(err)
    for extra, param, fragment in (
        ({"max_completion_tokens": 10**6}, "max_completion_tokens", "beyond the model's context"),
        ({"max_tokens": 30}, "max_tokens", "above this server's limit of 20"),
        ({"n": 10**6}, "n", "at most 8"),
        ({"temperature": -1}, "temperature", "must be >= 0"),
    ):
        status, err = chat_server.request(
            "POST", "/v1/chat/completions", {"messages": CHAT, **extra}
        )
        assert status == 400 and err["error"]["param"] == param, err
        assert fragment in err["error"]["message"], err
    assert client(chat_server).chat.completions.create(model="s1", messages=CHAT, max_tokens=2)


def test_lm_eval_local_chat_completions_equals_its_hf_model(chat_server, monkeypatch, hub_offline):
    """Greedy generation with stop strings through the chat template: lm-eval's
    `local-chat-completions` model (with --apply_chat_template) against distlm gives the answers
    of its `hf` model with the same template on the same weights, document by document."""
    pytest.importorskip("lm_eval")
    import test_ecosystem

    folder = chat_server.folder
    weights = test_server.tiny_models_folder(chat_server)
    monkeypatch.chdir(ROOT)  # the task YAMLs name their data relative to the repository root
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)  # sent as the bearer token
    api = test_ecosystem.chat_over_api("s1", chat_server.base)
    hf = test_ecosystem.chat_with_hf(weights, folder)
    test_ecosystem.assert_same_chat_answers(api, hf)
    assert any(d["filtered_resps"][0] for d in api["samples"]["distlm_gen"])  # not all empty
