"""Serve mode's pure parts, without processes: engine-channel messages, the JSON guards, the
access log's escaping, bounded sampling, the scheduler's cancel / n > 1 / failed pick, and
the start-up heap's freeze (in a process of its own)."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys

import msgpack
import pytest
import test_inference
import torch
from pydantic import ValidationError
from test_inference import PROMPTS

from distlm.inference.engine.ring import Pick
from distlm.inference.engine.sampler import Sampler, SamplingError, pick_token
from distlm.inference.engine.scheduler import Sequence
from distlm.inference.messages import (
    VERSION,
    Attach,
    Cancel,
    ChannelError,
    Control,
    Error,
    Finish,
    Health,
    Prompt,
    Ready,
    Shutdown,
    Submit,
    Token,
    TokenBatch,
    decode,
    decode_all,
    encode,
    encode_batch,
    pipe_frame,
    read_pipe_frame,
)
from distlm.inference.prompts import RequestError
from distlm.inference.request import sampling_settings
from distlm.inference.sampling_params import SamplingParams, make_params
from distlm.inference.server.access_log import escape
from distlm.inference.server.chat import NO_TEMPLATE, chat_prompt
from distlm.inference.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    json_depth,
    parse_json,
)
from distlm.inference.stats import StageBrief, StageInfo
from distlm.settings import MAX_SEED, SamplingSettings

tiny_models = test_inference.tiny_models
hf_reference = test_inference.hf_reference


def test_engine_messages_round_trip_and_refuse_what_they_do_not_know():
    msgs = [
        Attach(pid=7),
        Submit(rid=1, prompts=[[1, 2], [3]], n=2, params=SamplingParams(4, seed=MAX_SEED)),
        Cancel(rid=1),
        Cancel(rid=1, index=3),
        Shutdown(),
        Ready(
            hostname="h",
            pid=1,
            context=64,
            vocab_size=400,
            eos_token_id=None,
            lanes=4,
            stages=2,
            pipeline=[StageInfo(0, "h", 1, (0, 2), 1, "cpu")],
            weights="ab" * 32,
        ),
        TokenBatch(rid=[1, 2], index=[0, 1], token=[5, 6]),
        TokenBatch([1, 2], [0, 1], [5, 6], [None, -0.5], [None, [(5, -0.5), (7, -1.0)]]),
        Prompt(rid=1, index=0, logprobs=[None, -2.5], top=[None, [(3, -0.1)]]),
        Finish(rid=1, index=0, reason="length", tokens=4),
        Error(rid=None, index=None, status=503, message="gone"),
        Health(active=1, waiting=0, lanes_busy=1, stages=[StageBrief(0, 0.1, 0.0, 0.2)]),
        Control(state="stopping", reason="SIGTERM"),
        Control(state="failed", reason="the pipeline job ended", error=True),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
        assert decode_all(encode(m)) == [m]
    assert decode_all(encode_batch(msgs)) == msgs  # one engine step's messages, in order

    async def down_a_pipe(frames: bytes) -> list:  # the supervisor's word to an API process
        reader = asyncio.StreamReader()
        reader.feed_data(frames)
        reader.feed_eof()
        return [await read_pipe_frame(reader) for _ in range(3)]

    frames = pipe_frame(msgs[-1]) + pipe_frame(msgs[-2])
    assert asyncio.run(down_a_pipe(frames)) == [msgs[-1], msgs[-2], None]  # None: the pipe ended
    assert asyncio.run(down_a_pipe(frames[:-3]))[1] is None  # a frame cut short: the end too
    with pytest.raises(ChannelError, match="batch: expected a list"):
        decode_all(msgpack.packb([VERSION, "batch", [["cancel"]]]))
    with pytest.raises(ChannelError, match="version 99"):
        decode(msgpack.packb([99, "cancel", {"rid": 1}]))
    with pytest.raises(ChannelError, match="unknown message kind 'nope'"):
        decode(msgpack.packb([VERSION, "nope", {}]))
    with pytest.raises(ChannelError, match="cancel: fields"):
        decode(msgpack.packb([VERSION, "cancel", {"rid": 1, "extra": 2}]))
    with pytest.raises(ChannelError, match="finish: fields"):
        decode(msgpack.packb([VERSION, "finish", {"rid": 1}]))
    # typed fields: a value of the wrong type, or a params field that is not SamplingParams'
    with pytest.raises(ChannelError, match="tokenbatch: .*rid.0: Input should be a valid integer"):
        decode(msgpack.packb([VERSION, "tokenbatch", {"rid": ["x"], "index": [0], "token": [1]}]))
    with pytest.raises(ChannelError, match="tokenbatch: .*columns of unequal length"):
        decode(msgpack.packb([VERSION, "tokenbatch", {"rid": [1, 2], "index": [0], "token": [1]}]))
    with pytest.raises(ChannelError, match="unknown message kind 'token'"):  # not sent alone
        decode(msgpack.packb([VERSION, "token", {"rid": 1, "index": 0, "token": 1}]))
    # stage 0 builds a step's batch token by token; its entries come out as the API's Tokens
    built = TokenBatch()
    built.add(1, 0, 5)
    built.add(2, 1, 6, -0.5, [(5, -0.5), (7, -1.0)])
    assert built == msgs[7]
    assert decode(encode(built)).tokens() == [
        Token(1, 0, 5),
        Token(2, 1, 6, -0.5, [(5, -0.5), (7, -1.0)]),
    ]
    sub = {"rid": 1, "prompts": [[1]], "n": 1, "params": {"max_new_tokens": 1, "greedy": True}}
    with pytest.raises(ChannelError, match="submit: .*params.greedy: Unexpected keyword"):
        decode(msgpack.packb([VERSION, "submit", sub]))
    with pytest.raises(ChannelError, match="undecodable"):
        decode(b"\xc1garbage")
    with pytest.raises(ChannelError, match="not an engine-channel message"):
        encode(("work", 1))


def test_ring_messages_carry_a_version_and_refuse_another():
    """Ring messages travel as (RING_VERSION, message): another version, a bare message or a
    type that is not a ring message stops the stage with an error naming both stages."""
    import pickle

    from distlm.inference.engine.ring import RING_VERSION, Hello, PipelineError, Work, open_envelope

    work = Work((), None, release=(3,))
    got = open_envelope(pickle.loads(pickle.dumps((RING_VERSION, work))), rank=1, prev=0)
    assert got == work
    with pytest.raises(PipelineError, match="stage 1: from stage 0: ring message version 0"):
        open_envelope((0, work), rank=1, prev=0)
    with pytest.raises(PipelineError, match="Hello is not a .version, message. pair"):
        open_envelope(Hello(()), rank=1, prev=0)
    with pytest.raises(PipelineError, match="dict is not a ring message"):
        open_envelope((RING_VERSION, {"slots": ()}), rank=1, prev=0)


def test_json_guards():
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{", "b": "\\"[["}') == 1  # brackets in strings
    assert parse_json(b'{"a": [1, 2.5]}', max_depth=4, max_digits=8) == {"a": [1, 2.5]}
    # at the limit (no more brackets than it: not scanned), or beyond it only with brackets in
    # strings (scanned): taken
    assert parse_json(b'{"a": [[{"b": []}]]}', max_depth=5, max_digits=8)["a"] == [[{"b": []}]]
    assert parse_json(b'{"a": "[[[[[[", "b": [[]]}', max_depth=3, max_digits=8)["b"] == [[]]
    bad = [
        (b"[" * 50 + b"]" * 50, "nested 50 deep, at most 4"),
        (b'{"a": [[{"b": []}]]}', "nested 5 deep, at most 4"),
        (b'{"a": 123456789}', "a number of 9 characters, at most 8"),
        (b'{"a": -0.12345678}', "a number of 11 characters"),
        (b'{"a": 1e400}', "out of range"),
        (b'{"a": Infinity}', "Infinity is not a JSON number"),
        (b'{"a": 1', "not valid JSON"),
        (b"\xff", "not valid UTF-8"),
        (b"  ", "empty"),
    ]
    for raw, fragment in bad:
        with pytest.raises(RequestError, match=fragment.replace("(", r"\(")):
            parse_json(raw, max_depth=4, max_digits=8)


def test_escape_keeps_control_characters_out_of_the_log():
    assert escape("/a\x1b[31m\x07\x00\r\n\x9b\\z") == "/a\\x1b[31m\\x07\\x00\\r\\n\\x9b\\\\z"
    assert escape("/v1/completions?x=é") == "/v1/completions?x=é"


def test_request_model_mirrors_openai():
    r = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["a", "b"], "n": 2, "stop": "x", "user": "u", "logprobs": 2}
    )
    assert r.prompts() == ["a", "b"] and r.stops() == ["x"]
    for body, field, why in (
        ({"prompt": "a", "max_tokens": 1.5}, "max_tokens", "int_type"),
        ({"prompt": "a", "stream": 1}, "stream", "bool_type"),
        ({"prompt": "a", "unknown": 1}, "unknown", "extra_forbidden"),
        ({"max_tokens": 3}, "prompt", "missing"),
    ):
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate(body)
        [err] = e.value.errors()
        assert (err["loc"], err["type"]) == ((field,), why), body


def test_chat_request_fields_and_the_template(tiny_models):
    """The chat request shares the completions sampling fields and names its own (max_tokens or
    max_completion_tokens, top_logprobs); its messages render through the folder's template, and
    without one the 400 says how to add one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models[1])
    chat = [{"role": "user", "content": "A class"}]
    r = ChatCompletionRequest.model_validate(
        {"messages": chat, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2}
    )
    assert (r.new_tokens(), r.alternatives(), r.echoes()) == (3, 2, False)
    assert r.http_name("max_new_tokens") == "max_completion_tokens"
    assert r.http_name("prompt") == "messages" and r.http_name("temperature") == "temperature"
    assert ChatCompletionRequest.model_validate({"messages": chat}).alternatives() is None
    assert set(OpenAIRequest.model_fields) < set(ChatCompletionRequest.model_fields)
    with pytest.raises(RequestError, match=re.escape(NO_TEMPLATE)):
        r.prompts(tok)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.role }}> {{ m.content }}|{% endfor %}"
        "{% if add_generation_prompt %}bot>{% endif %}"
    )
    assert r.prompts(tok) == [tok("user> A class|bot>", add_special_tokens=False)["input_ids"]]
    for messages, why in (([{"role": "system", "content": "x"}], "no system"), ([], "empty")):
        with pytest.raises(
            RequestError, match=f"messages: the model's chat template refused .*{why}"
        ):
            chat_prompt(tok, messages)


def test_sampling_is_bounded():
    def params(**kw):
        sampling = {k: kw.pop(k) for k in list(kw) if k in SamplingSettings.model_fields}
        return make_params(SamplingSettings(max_new_tokens=4, **sampling), context=64, **kw)

    assert params(temperature=1e-40).greedy
    assert params(temperature=5e-324).greedy
    assert params(top_k=10**30, vocab_size=400).top_k == 0
    assert params(top_k=50, vocab_size=400).top_k == 50
    assert params(seed=MAX_SEED).seed == MAX_SEED
    for kw, msg in [
        ({"seed": MAX_SEED + 1}, "seed: must be in 0..2"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(RequestError, match=msg):
            sampling_settings(kw, defaults=SamplingSettings())
    for kw, msg in [
        ({"logprobs": 21}, "logprobs: must be in 0..20"),
        ({"logprobs": -1}, "logprobs"),
    ]:
        with pytest.raises(RequestError, match=msg):
            params(**kw)
    logits = torch.tensor([0.0, 3.0, 1.0])
    huge = SamplingParams(4, temperature=1e300, seed=1)
    assert 0 <= pick_token(logits, huge, torch.Generator().manual_seed(1)) < 3
    g = torch.Generator().manual_seed(MAX_SEED)  # the largest seed is one manual_seed takes
    assert pick_token(logits, SamplingParams(4, temperature=1.0), g) in (0, 1, 2)
    with pytest.raises(SamplingError, match="not finite"):
        pick_token(torch.full((3,), math.nan), SamplingParams(4), None)
    with pytest.raises(SamplingError, match="no finite distribution"):
        pick_token(
            torch.tensor([0.0, math.inf, 1.0]),
            SamplingParams(4, temperature=1.0),
            torch.Generator(),
        )


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected():
    """freeze_startup_heap (in a process of its own, as the server and the engine call it):
    start-up garbage is collected, not frozen; what is alive is frozen out of collections; cycles
    made afterwards are still collected."""
    script = """
import gc, weakref
from distlm.runtime.heap import freeze_startup_heap
from distlm.core.log import setup_logging

setup_logging()

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.b, b.a = b, a
    return weakref.ref(a)

kept = [Node() for _ in range(1000)]
before = cycle()  # start-up garbage: a cycle nothing refers to
n = freeze_startup_heap("test")
assert before() is None, "start-up garbage was frozen"
assert n > 1000 and gc.get_freeze_count() == n, n
after = cycle()
gc.collect()
assert after() is None, "a cycle made after the freeze was not collected"
assert gc.get_freeze_count() == n
print("ok", n)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]
    assert "test: " in r.stderr and "start-up objects frozen out of garbage collection" in r.stderr


def test_greedy_picks_of_a_micro_batch_are_each_rows_argmax():
    """One max over the micro-batch's logits gives each row's argmax (the first of equal maxima);
    a row with no finite logit gets None, and rows with some -inf, +inf or NaN keep argmax's
    answer as pick_token sees the row."""
    from distlm.inference.engine.sampler import row_argmax

    inf, nan = math.inf, math.nan
    fine = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, -1.0, 0.0, 5.0]])
    assert row_argmax(fine) == [1, 3] == fine.argmax(dim=1).tolist()
    rows = torch.tensor(
        [
            [0.0, 3.0, -inf, 1.0],  # -inf among finite logits: argmax
            [-inf, -inf, -inf, -inf],  # nothing finite: None
            [nan, nan, nan, nan],  # nothing finite: None
            [1.0, inf, 0.0, 2.0],  # +inf among finite logits: argmax (pick_token's call)
            [2.0, 7.0, 1.0, 0.0],
        ]
    )
    assert row_argmax(rows) == [1, None, None, 1, 1]


def test_a_step_in_flight_picks_from_the_logits_of_its_own_launch():
    """A micro-batch whose picks are taken after the next one starts (steps in flight) reads
    the logits of its own forward pass, though the model's output buffer (a CUDA graph's, which
    the next replay writes) has changed since: with `hold`, a row with no finite logit still
    fails its sequence and the others keep their argmax. Without it (one step at a time, whose
    picks are taken before any other step) the changed buffer would be read: the same row then
    gets a token, which is what `hold` is for."""
    from distlm.inference.engine.micro_batch import Item
    from distlm.inference.engine.ring import Slot
    from distlm.inference.engine.sampler import launch_last_stage

    inf = math.inf
    slots = tuple(Slot(Item(k, k, 0, 1), SamplingParams(4)) for k in range(3))

    def picks(hold: bool) -> list[Pick]:
        buf = torch.tensor([[0.0, 3.0, 1.0], [-inf, -inf, -inf], [2.0, 0.0, 1.0]])

        def model(items, x, every):  # the stage's static output buffer
            return buf

        step = launch_last_stage(model, Sampler(), slots, torch.zeros(3), hold=hold)  # type: ignore[arg-type]
        buf.copy_(torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.0, 7.0], [0.0, 9.0, 0.0]]))  # next step
        return step.picks()

    held = picks(True)
    assert [p.token for p in held[::2]] == [1, 0]
    assert held[1].error is not None and "not finite" in held[1].error
    assert picks(False)[1].error is None  # read from the buffer as the next step left it


def test_a_failed_pick_fails_its_sequence_only():
    s = Sampler()
    s.start(0, SamplingParams(4, temperature=1.0, logprobs=2))
    s.start(1, SamplingParams(4))
    bad = s.pick(7, 0, torch.tensor([0.0, math.inf, 1.0]))
    assert bad.error and "sampling failed" in bad.error and bad.token == -1
    good = s.pick(8, 1, torch.tensor([0.0, 2.0, 1.0]))
    assert good == Pick(8, 1)
    s.start(2, SamplingParams(4, logprobs=2))
    lp = s.pick(9, 2, torch.tensor([0.0, 2.0, 1.0]))
    assert lp.token == 1 and lp.top[0][0] == 1 and len(lp.top) == 2
    assert lp.logprob == pytest.approx(
        float(torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), 0)[1])
    )


def _ids(tok):
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def test_scheduler_n_shares_the_prefill_and_equals_separate_runs(tiny_models, hf_reference):
    from test_inference import _scheduler

    tok = hf_reference.tokenizer
    ids = _ids(tok)[0]
    params = [SamplingParams(8, temperature=1.0, seed=30 + j) for j in range(3)]
    sched = _scheduler(tiny_models[1], lanes=4)
    group = [Sequence(sched.new_id(), ids, p) for p in params]
    group[0].siblings = group[1:]
    sched.submit(group[0])
    items_before = sched.stats.items
    while sched.busy:
        sched.step()
    # one prefill of len(ids) tokens for the three, then 7 decode steps each
    assert sched.stats.items - items_before == 1 + 3 * 7
    alone = []
    for p in params:
        s = _scheduler(tiny_models[1], lanes=1)
        seq = Sequence(s.new_id(), ids, p)
        s.submit(seq)
        while s.busy:
            s.step()
        alone.append(seq.tokens)
    assert [g.tokens for g in group] == alone and len({tuple(t) for t in alone}) > 1
    # too few lanes: the sibling without one queues and prefills on its own
    sched = _scheduler(tiny_models[1], lanes=2)
    group = [Sequence(sched.new_id(), ids, p) for p in params]
    group[0].siblings = group[1:]
    sched.submit(group[0])
    while sched.busy:
        sched.step()
    assert [g.tokens for g in group] == alone and not sched.active and len(sched.free) == 2


def test_finished_and_cancelled_lanes_free_their_kv_cache(tiny_models, hf_reference):
    """Lanes whose sequences end (finished or cancelled) free their KV cache and sampling state;
    a stage with no lane busy holds no cache; fail_all frees every lane at once."""
    from test_inference import _scheduler

    from distlm.inference.engine.sampler import release_lanes

    ids = _ids(hf_reference.tokenizer)
    sched = _scheduler(tiny_models[1], lanes=2)
    model = sched.model
    a = Sequence(sched.new_id(), ids[0], SamplingParams(3, temperature=1.0, seed=1))
    b = Sequence(sched.new_id(), ids[1], SamplingParams(30))
    sched.submit(a)
    sched.submit(b)
    while a.finish_reason is None:
        sched.step()
    # a finished: its lane's cache positions and sampler gone; b's lane still holds its cache
    assert a.lane not in model.length and a.lane not in sched.sampler.lanes
    assert b.lane in model.length and model.cached_bytes() > 0 < sched.stats.cache_bytes
    sched.cancel(b)
    while sched.busy:
        sched.step()
    assert b.finish_reason == "cancelled" and model.length == {} and not sched.sampler.lanes
    assert model.cached_bytes() == 0 == sched.stats.cache_bytes and len(sched.free) == 2
    # the pipeline failed: every open sequence ends with the reason, every lane is freed
    seqs = [Sequence(sched.new_id(), i, SamplingParams(30)) for i in ids[:3]]
    for seq in seqs:
        sched.submit(seq)
    sched.step()
    assert model.cached_bytes() > 0 and sched.lanes_busy == 2
    failed = sched.fail_all("stage 1 died")
    assert sorted(f.id for f in failed) == sorted(s.id for s in seqs)
    assert all(f.finish_reason == "error" and f.error == "stage 1 died" for f in failed)
    assert model.cached_bytes() == 0 and sched.lanes_busy == 0 and not sched.busy
    # the last stage of two frees the lanes stage 0 names in Work.release (cache and sampler)
    from distlm.inference.engine.pipeline_stage import Item, load_stage
    from distlm.inference.engine.ring import Slot
    from distlm.inference.engine.sampler import last_stage

    first, last = (load_stage(tiny_models[2], st, world=2) for st in (0, 1))
    item = Item(0, 1, 0, len(ids[0]))
    hidden = first([item], torch.tensor(ids[0]))
    sampler = Sampler()
    last_stage(last, sampler, (Slot(item, SamplingParams(4)),), hidden)
    assert last.cached_bytes() > 0 and 1 in sampler.lanes
    release_lanes(last, sampler, (1,))
    assert last.cached_bytes() == 0 and not sampler.lanes and last.length == {}


def test_scheduler_cancel_frees_the_lane_at_once_or_at_the_next_token(tiny_models, hf_reference):
    from test_inference import _scheduler

    ids = _ids(hf_reference.tokenizer)
    sched = _scheduler(tiny_models[1], lanes=1)
    done = []
    seqs = [Sequence(sched.new_id(), i, SamplingParams(20), on_done=done.append) for i in ids[:3]]
    for s in seqs:
        sched.submit(s)
    sched.step()  # seqs[0] takes the only lane and has its first token (one stage: at once)
    assert seqs[0].lane == 0 and len(seqs[0].tokens) == 1
    sched.cancel(seqs[1])  # waiting: gone at once
    assert seqs[1].finish_reason == "cancelled" and seqs[1] in done
    sched.cancel(seqs[0])  # ready for its next step: freed at once
    assert seqs[0].finish_reason == "cancelled" and sched.free == [0]
    while sched.busy:
        sched.step()
    assert seqs[2].finish_reason == "length" and len(seqs[2].tokens) == 20
    assert len(seqs[0].tokens) == 1 and not seqs[1].tokens


def test_scheduler_fails_one_sequence_whose_pick_fails(tiny_models, hf_reference, monkeypatch):
    from test_inference import _scheduler

    from distlm.inference.engine import sampler as pipeline

    ids = _ids(hf_reference.tokenizer)
    real = pipeline.pick_token

    def flaky(logits, params, gen):
        if params.seed == 666:
            raise SamplingError("boom")
        return real(logits, params, gen)

    monkeypatch.setattr(pipeline, "pick_token", flaky)
    sched = _scheduler(tiny_models[1], lanes=2)
    bad = Sequence(sched.new_id(), ids[0], SamplingParams(5, temperature=1.0, seed=666))
    good = Sequence(sched.new_id(), ids[1], SamplingParams(5))
    sched.submit(bad)
    sched.submit(good)
    while sched.busy:
        sched.step()
    assert bad.finish_reason == "error" and "boom" in bad.error and not bad.tokens
    assert good.finish_reason == "length" and good.tokens == hf_reference(PROMPTS[1], 5)


def _reference_prompt_logprobs(folder, ids: list[int], n: int):
    """Single-process GPT2LMHeadModel: each prompt token's log-probability and the top n."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    chosen = lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    top = torch.topk(lp, n, dim=-1)
    return chosen, top.indices.tolist(), top.values.tolist()


def _check_prompt(got, ids, ref) -> None:
    chosen, top_ids, top_lps = ref
    assert len(got) == len(ids) - 1
    for (lp, alts), want, ti, tv in zip(got, chosen, top_ids, top_lps):
        assert lp == pytest.approx(want, abs=1e-4)
        assert [t for t, _ in alts] == ti
        assert [v for _, v in alts] == pytest.approx(tv, abs=1e-4)


@pytest.mark.parametrize("stages", [1, 3])
def test_prompt_logprobs_from_the_prefill_equal_gpt2lmheadmodel(tiny_models, hf_reference, stages):
    """The last stage scores the prompt in the prefill's own forward pass (no second pass), packed
    beside other sequences; the figures equal a single-process GPT2LMHeadModel to 1e-4."""
    from test_inference import _scheduler

    from distlm.inference.engine.pipeline_stage import Item, load_stage
    from distlm.inference.engine.ring import Slot
    from distlm.inference.engine.sampler import last_stage

    folder = tiny_models[1].parent / "model"
    ids = _ids(hf_reference.tokenizer)
    ref = [_reference_prompt_logprobs(folder, i, 3) for i in ids[:2]]
    # the stage chain: prefills of two scored prompts and one plain one, packed in one micro-batch
    models = [load_stage(tiny_models[stages], s, world=stages) for s in range(stages)]
    scored = SamplingParams(4, logprobs=3, prompt_logprobs=3)
    slots = (
        Slot(Item(0, 0, 0, len(ids[0])), scored, prompt=tuple(ids[0])),
        Slot(Item(1, 1, 0, len(ids[2])), SamplingParams(4)),
        Slot(Item(2, 2, 0, len(ids[1])), scored, prompt=tuple(ids[1])),
    )
    h = torch.tensor(ids[0] + ids[2] + ids[1])
    for m in models[:-1]:
        h = m([sl.item for sl in slots], h)
    picks = last_stage(models[-1], Sampler(), slots, h)
    assert picks[1].prompt is None and picks[1].token == hf_reference(PROMPTS[2], 1)[0]
    _check_prompt(picks[0].prompt, ids[0], ref[0])
    _check_prompt(picks[2].prompt, ids[1], ref[1])
    # the scheduler: max_new_tokens 0 scores the prompt only; n > 1 forks get it too
    sched = _scheduler(tiny_models[1], lanes=4)
    seen = {}
    only = Sequence(
        sched.new_id(),
        ids[0],
        SamplingParams(0, prompt_logprobs=3),
        on_prompt=lambda s, p: seen.setdefault(s.id, p.prompt),
    )
    group = [
        Sequence(
            sched.new_id(),
            ids[1],
            SamplingParams(5, temperature=1.0, seed=j, prompt_logprobs=3),
            on_prompt=lambda s, p: seen.setdefault(s.id, p.prompt),
        )
        for j in range(2)
    ]
    group[0].siblings = group[1:]
    sched.submit(only)
    sched.submit(group[0])
    while sched.busy:
        sched.step()
    assert only.finish_reason == "length" and only.tokens == [] and sched.free
    _check_prompt(seen[only.id], ids[0], ref[0])
    assert [len(g.tokens) for g in group] == [5, 5] and seen[group[0].id] == seen[group[1].id]
    _check_prompt(seen[group[1].id], ids[1], ref[1])
    # echo with max_tokens 0 (the prompt alone) is set after validation, which refuses 0
    with pytest.raises(RequestError, match="max_new_tokens: must be >= 1, got 0"):
        sampling_settings({"max_new_tokens": 0}, defaults=SamplingSettings())
    only = SamplingSettings().model_copy(update={"max_new_tokens": 0})
    assert make_params(only, context=64).max_new_tokens == 0


def test_a_steps_tokens_go_as_one_batch_in_the_order_of_its_messages(tmp_path):
    """Stage 0 queues a step's tokens for a channel into one TokenBatch; any other message
    between them closes it (a Finish after its choice's last token, an Updated before the
    tokens of the new weights), so the API server sees every event in the order it happened."""
    from distlm.inference.engine.serve import Channel

    with Channel(str(tmp_path), 2) as ch:
        ch.token(1, 10, 0, 5, None, None)
        ch.token(1, 11, 0, 6, -0.5, [(6, -0.5)])
        ch.token(2, 12, 0, 7, None, None)
        ch.send(Finish(rid=10, index=0, reason="length", tokens=1), 1)
        ch.token(1, 11, 0, 8, None, None)
        assert ch.pending[1] == [
            TokenBatch([10, 11], [0, 0], [5, 6], [None, -0.5], [None, [(6, -0.5)]]),
            Finish(rid=10, index=0, reason="length", tokens=1),
            TokenBatch([11], [0], [8]),
        ]
        assert ch.pending[2] == [TokenBatch([12], [0], [7])]
        assert ch.pending[0] == []


def test_metrics_written_together_are_what_one_by_one_writes_and_wait_at_most_flush_s():
    """The API server gathers what requests and tokens add and writes it at most FLUSH_S later
    (and before its own /metrics): a histogram's observations written together give the
    exposition that observing them one by one gives; outside an event loop each is written at
    once."""
    from distlm.inference.server.metrics import FLUSH_S, Metrics, observe_many

    one, many = Metrics(), Metrics()
    values = [0.0, 0.001, 0.005, 0.0051, 0.3, 30.0, 61.0]  # on bounds, between them, past the last
    for v in values:
        one.itl.observe(v)
    observe_many(many.itl, values)

    def itl(m: Metrics) -> list:
        return [
            (s.name, s.labels, s.value)
            for f in m.registry.collect()
            if f.name == "distlm_inter_token_latency_seconds"
            for s in f.samples
            if not s.name.endswith("_created")
        ]

    assert itl(one) == itl(many) and len(itl(one)) == 14 + 2  # 13 bounds and +Inf; sum, count

    def value(m: Metrics, name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    m = Metrics()

    async def serving() -> None:
        m.count(m.tokens, 3)
        m.count(m.child(m.requests, "/health", "200"))
        m.count(m.child(m.requests, "/health", "200"))
        m.observe(m.e2e, 0.2)
        m.open_sequences(5)
        m.open_sequences(4)
        assert value(m, "distlm_generation_tokens_total") == 0  # not yet
        await asyncio.sleep(FLUSH_S * 3)
        assert value(m, "distlm_generation_tokens_total") == 3
        assert value(m, "distlm_requests_total", route="/health", status="200") == 2
        assert value(m, "distlm_e2e_request_latency_seconds_count") == 1
        assert value(m, "distlm_sequences_open") == 4  # the latest
        m.count(m.tokens)
        m.flush()  # as /metrics does: at once
        assert value(m, "distlm_generation_tokens_total") == 4

    asyncio.run(serving())
    m.count(m.tokens, 2)  # outside an event loop: at once
    assert value(m, "distlm_generation_tokens_total") == 6
