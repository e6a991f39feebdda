"""Pipeline inference: sampling, prompts, stage shards vs Hugging Face generate, MPI runs, workflow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.faults import slow_reader_env

from distlm import DistlmError
from distlm.inference.engine.micro_batch import Item, _Plan
from distlm.inference.engine.pipeline_stage import load_stage
from distlm.inference.engine.sampler import pick_token
from distlm.inference.engine.scheduler import Scheduler, Sequence
from distlm.inference.prompts import RequestError, encode_prompt, read_prompts, resolve_prompts_path
from distlm.inference.request import sampling_settings
from distlm.inference.sampling_params import SamplingParams, make_params
from distlm.inference.stats import StageStats
from distlm.runtime.dist import MPI_RING, Topology
from distlm.settings import InferenceSettings, SamplingSettings, init_settings

ROOT = Path(__file__).resolve().parents[1]
INFER = "distlm.entry.infer"  # the stage entry point, as rule inference starts it
N_LAYER = 5  # divisible by neither 2 nor 3 stages
PROMPTS = [
    "The for statement in Python",
    "A class",
    "Exceptions are raised when the",
    "The import statement combines two operations: it searches",
    "x",
]


def build_tiny_models(root: Path) -> dict[int, Path]:
    """A 5-layer GPT-2 written as a model folder and pipeline folders of 1, 2 and 3 stage shards.

    Weights are drawn wider than GPT-2's init so that greedy decoding does not settle on one
    repeated token and the equality tests compare varied sequences.
    """
    from harness.synthetic import corpus_model_folder

    from distlm.model import write_pipeline_dir

    done = {s: root / f"s{s}" for s in (1, 2, 3)}
    if all((p / "shards" / "manifest.json").is_file() for p in done.values()):
        return done
    init = init_settings(n_positions=64, n_embd=32, n_layer=N_LAYER, n_head=2, dropout=0.0)
    corpus_model_folder(root, init, texts=150, vocab=400, created_by="test", spread=0.3)
    for s, path in done.items():
        write_pipeline_dir(root / "model", path, stages=s)
    return done


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[int, Path]:
    return build_tiny_models(tmp_path_factory.getbasetemp() / "inference-models")


@pytest.fixture(scope="session")
def hf_reference(tiny_models):
    """Greedy token ids from single-process GPT2LMHeadModel.generate, per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_models[1].parent / "model"  # the model folder the pipeline folders were cut from
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cache = {}

    def ref(prompt: str, max_new: int) -> list[int]:
        if (prompt, max_new) not in cache:
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(
                ids,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
            )
            cache[prompt, max_new] = out[0, ids.shape[1] :].tolist()
        return cache[prompt, max_new]

    ref.tokenizer = tok
    return ref


def icfg(**over) -> InferenceSettings:
    """The inference section with `over` (validated as a config file is)."""
    from distlm.dag.config import validate_config

    return InferenceSettings.model_validate(validate_config({"inference": over})["inference"])


# ----------------------------------------------------------------------------- sampling


def test_sampling_settings_and_make_params_reject_bad_values_naming_the_field():
    """Ranges are SamplingSettings' (one definition); make_params checks what only the model and
    the server know (context, serve.max_tokens). Each error is neutral: it names the field."""
    defaults = SamplingSettings()
    cases = [
        ({"max_new_tokens": 0}, "max_new_tokens: must be >= 1, got 0"),
        ({"max_new_tokens": -3}, "max_new_tokens: must be >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens: expected an integer"),
        ({"max_new_tokens": True}, "max_new_tokens: expected an integer"),
        ({"temperature": -0.1}, "temperature: must be >= 0"),
        ({"top_p": 0.0}, "top_p: must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p: must be in (0, 1]"),
        ({"top_k": -1}, "top_k: must be >= 0"),
        ({"seed": -1}, "seed: must be in 0..2**63-1"),
        ({"temperature": float("nan")}, "temperature: must be >= 0"),
    ]
    for kw, msg in cases:
        with pytest.raises(RequestError, match=re.escape(msg)) as e:
            sampling_settings(kw, defaults=defaults)
        assert e.value.param == next(iter(kw))
    assert sampling_settings({"top_k": None}, defaults=defaults) == defaults  # None: not given
    with pytest.raises(RequestError, match="max_new_tokens: 64 is beyond the model's context"):
        make_params(SamplingSettings(max_new_tokens=64), context=64)
    with pytest.raises(RequestError, match="above this server's limit of 10"):
        make_params(SamplingSettings(max_new_tokens=11), context=64, max_allowed=10)
    assert make_params(SamplingSettings(max_new_tokens=63), context=64).greedy
    # the `inference` settings are the sampling settings: handed down as they are, not rebuilt
    settings = InferenceSettings(temperature=0.7, top_k=5)
    assert sampling_settings({"seed": None}, defaults=settings) is settings
    request = sampling_settings({"seed": 3}, defaults=settings)
    assert (request.temperature, request.top_k, request.seed) == (0.7, 5, 3)
    assert not make_params(settings, context=64).greedy
    assert make_params(InferenceSettings(), context=64).greedy  # the default, temperature 0
    # the same values again: the settings made for them, reused (they are frozen); a value equal
    # to a reused one but of another type (True == 1) is validated afresh, and refused
    assert sampling_settings({"seed": 3}, defaults=settings) is request
    assert sampling_settings({"max_new_tokens": 1}, defaults=defaults).max_new_tokens == 1
    with pytest.raises(RequestError, match="max_new_tokens: expected an integer"):
        sampling_settings({"max_new_tokens": True}, defaults=defaults)
    assert sampling_settings({"seed": 3}, defaults=InferenceSettings()).temperature == 0.0
    with pytest.raises(RequestError, match="seed: expected an integer"):  # unhashable: not kept
        sampling_settings({"seed": [3]}, defaults=settings)


def test_pick_token_greedy_topk_topp_and_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -5.0])
    assert pick_token(logits, SamplingParams(4), None) == 1
    gen = lambda s: torch.Generator().manual_seed(s)
    p = SamplingParams(4, temperature=1.0, top_k=2, seed=0)
    picks = {pick_token(logits, p, gen(s)) for s in range(50)}
    assert picks == {1, 3}  # top-2 only, both reachable
    p = SamplingParams(4, temperature=1.0, top_p=0.01)
    assert {pick_token(logits, p, gen(s)) for s in range(20)} == {1}  # nucleus of one token
    p = SamplingParams(4, temperature=5.0)
    a = [pick_token(logits, p, g) for g in [gen(7)] for _ in range(30)]
    g = gen(7)
    assert a == [pick_token(logits, p, g) for _ in range(30)]  # same seed, same draws
    assert len(set(a)) > 2


# ----------------------------------------------------------------------------- prompts


def test_encode_prompt_adds_the_tokenizers_own_special_tokens():
    """A tokenizer that starts every text with BOS (as Llama 3's does) gets it in a text prompt,
    as `tok(text)` and vLLM's completions give it; the model saw BOS first in training."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", unk_token="[UNK]")
    ids, cut = encode_prompt(tok, "a b", context=16, max_new_tokens=2, overflow="reject")
    assert ids == [0, 1, 2] == tok("a b")["input_ids"] and cut == 0


def test_text_ids_are_the_tokenizers_call(hf_reference):
    """A fast tokenizer's ids come from the tokenizers library's encode directly, and are
    `tok(text)`'s: its special tokens, a special token's text in the prompt, any text. Where the
    backend was left truncating, or splitting special tokens against the tokenizer's setting,
    the call itself runs; a class that changes the encoding is never taken past."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from distlm.inference.prompts import runs_backend, text_ids

    t = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    bos = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", unk_token="[UNK]")
    texts = ["a b", " The history  of\n\nthe city é 😀 ", "<|endoftext|>a<s>b", "word " * 50]
    for tok in (hf_reference.tokenizer, bos):
        assert runs_backend(type(tok))
        for text in texts:
            assert text_ids(tok, text) == tok(text)["input_ids"], text
        want = tok(texts[3])["input_ids"]
        tok.backend_tokenizer.enable_truncation(3)
        assert text_ids(tok, texts[3]) == want  # the call: it sets no truncation
        tok.split_special_tokens = True
        try:
            for text in texts:
                assert text_ids(tok, text) == tok(text)["input_ids"], text
        finally:
            tok.split_special_tokens = False
            tok("a")  # the backend as the call leaves it

    class Lowered(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.lower(), *args, **kwargs)

    assert not runs_backend(Lowered)
    low = Lowered(tokenizer_object=t, bos_token="<s>", unk_token="[UNK]")
    assert text_ids(low, "A b") == [0, 1, 2] == low("A b")["input_ids"]


def test_encode_prompt_truncates_or_rejects(hf_reference):
    tok = hf_reference.tokenizer
    text = "word " * 80
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    ids, cut = encode_prompt(tok, text, context=64, max_new_tokens=10, overflow="truncate")
    assert len(ids) == 54 and cut == n - 54
    with pytest.raises(RequestError, match=f"prompt: {n} prompt tokens \\+ 10 new tokens exceed"):
        encode_prompt(tok, text, context=64, max_new_tokens=10, overflow="reject")
    with pytest.raises(RequestError, match="prompt: empty prompt"):
        encode_prompt(tok, "", context=64, max_new_tokens=10, overflow="truncate")
    assert encode_prompt(tok, "A class", context=64, max_new_tokens=10, overflow="reject")[1] == 0


def test_read_prompts_and_resolution(tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_bytes(b"first\n\n  \nsecond\\nline\r\n")
    assert read_prompts(f) == ["first", "second\nline"]
    f.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DistlmError, match=r"p.txt:2: not valid UTF-8"):
        read_prompts(f)
    f.write_bytes(b"\n \n")
    with pytest.raises(DistlmError, match="no prompts"):
        read_prompts(f)
    # relative: the working directory first, then the repository root
    monkeypatch.chdir(tmp_path)
    assert (
        resolve_prompts_path("config/prompts.txt", ROOT)
        == (ROOT / "config" / "prompts.txt").resolve()
    )
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "prompts.txt").write_text("mine\n")
    assert (
        resolve_prompts_path("config/prompts.txt", ROOT)
        == (tmp_path / "config" / "prompts.txt").resolve()
    )
    with pytest.raises(DistlmError, match="inference.prompts: prompt file 'nope.txt' not found"):
        resolve_prompts_path("nope.txt", ROOT)


# ----------------------------------------------------------------------------- stages in one process


def test_shard_digest_mismatch_is_refused(tiny_models, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models[2], bad)
    shard = bad / "shards" / "stage-01.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert load_stage(bad, 0, world=2).cut.first
    with pytest.raises(
        DistlmError, match=r"stage-01.safetensors: sha256 .* does not match the manifest"
    ):
        load_stage(bad, 1, world=2)
    with pytest.raises(DistlmError, match="has 2 stage shards but the pipeline runs 3 ranks"):
        load_stage(bad, 0, world=3)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stage_chain_packed_matches_generate(tiny_models, hf_reference, stages):
    """All prompts packed in one micro-batch, passed through the S stage modules in turn."""
    tok = hf_reference.tokenizer
    models = [load_stage(tiny_models[stages], s, world=stages) for s in range(stages)]
    assert [len(m.cut.layers) for m in models] and sum(len(m.cut.layers) for m in models) == N_LAYER
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    n_new = 12
    items = [Item(k, k, 0, len(i)) for k, i in enumerate(ids)]
    x = torch.tensor([t for i in ids for t in i])
    got = [[] for _ in ids]
    for step in range(n_new):
        h = x
        for m in models:
            h = m(items, h)
        nxt = h.argmax(-1)
        for k in range(len(ids)):
            got[k].append(int(nxt[k]))
        items = [Item(k, k, len(ids[k]) + step, 1) for k in range(len(ids))]
        x = nxt
    for p, g in zip(PROMPTS, got):
        ref = hf_reference(p, n_new)
        assert len(set(ref)) > 3, "the reference should not be one repeated token"
        assert g == ref, p


@pytest.mark.parametrize(
    "lanes,path",
    [((0, 1, 2, 3, 4), "whole"), ((4, 2, 3, 7, 5), "in-place"), ((0, 11, 23, 35, 47), "gathered")],
    ids=["cache-rows-whole", "cache-rows-in-place", "lanes-gathered"],
)
def test_decode_on_any_lanes_matches_generate(tiny_models, hf_reference, lanes, path):
    """Decode items on consecutive lanes in order are the cache's rows, queries and outputs as
    they are (whole); on lanes out of order with a gap (lane 6 holds no item) they attend over
    the cache rows in place; lanes spread wide are gathered. All pick generate's tokens."""
    tok = hf_reference.tokenizer
    model = load_stage(tiny_models[1], 0, world=1)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    n_new = 8
    items = [Item(k, lanes[k], 0, len(i)) for k, i in enumerate(ids)]
    x = torch.tensor([t for i in ids for t in i])
    got = [[] for _ in ids]
    for step in range(n_new):
        nxt = model(items, x).argmax(-1)
        for k in range(len(ids)):
            got[k].append(int(nxt[k]))
        items = [Item(k, lanes[k], len(ids[k]) + step, 1) for k in range(len(ids))]
        x = nxt
        decode = _Plan(items, torch.device("cpu")).decode
        assert decode is not None and decode.whole == (path == "whole")
        assert (decode.lanes is None) == (path != "gathered")
    for p, g in zip(PROMPTS, got):
        assert g == hf_reference(p, n_new), p


@pytest.mark.parametrize("prefill_first", [False, True], ids=["decodes-first", "prefill-first"])
def test_prefill_joining_decodes_matches_generate(tiny_models, hf_reference, prefill_first):
    """A prefill in the same micro-batch as decodes (what serving does all the time). With the
    decodes first, on lanes in order (the scheduler's launch order), their queries and outputs
    are the batch's first rows as they are (aligned); with the prefill first they are picked by
    index. Either way every sequence picks generate's tokens."""
    tok = hf_reference.tokenizer
    model = load_stage(tiny_models[1], 0, world=1)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    late = len(ids) - 1  # the last prompt arrives one step late, on the next lane
    got: list[list[int]] = [[] for _ in ids]

    def step(items: list[Item]) -> _Plan:
        x = torch.tensor(
            [t for it in items for t in (ids[it.seq] if it.pos == 0 else got[it.seq][-1:])]
        )
        nxt = model(items, x).argmax(-1)
        for i, it in enumerate(items):
            got[it.seq].append(int(nxt[i]))
        return _Plan(items, torch.device("cpu"))

    step([Item(k, k, 0, len(ids[k])) for k in range(late)])
    decodes = [Item(k, k, len(ids[k]), 1) for k in range(late)]
    prefill = Item(late, late, 0, len(ids[late]))
    mixed = step([prefill, *decodes] if prefill_first else [*decodes, prefill])
    assert mixed.decode is not None and not mixed.decode.whole
    assert mixed.decode.aligned == (not prefill_first)
    for _ in range(6):
        step([Item(k, k, len(ids[k]) + len(got[k]) - 1, 1) for k in range(len(ids))])
    for p, g in zip(PROMPTS, got):
        assert g == hf_reference(p, len(g)), p


def _scheduler(folder, *, lanes, eos=None, hw=None):
    model = load_stage(folder, 0, world=1, hw=hw)
    return Scheduler(
        model,
        None,
        Topology.single(hw, backend=MPI_RING),
        lanes=lanes,
        eos_token_id=eos,
        context=64,
        timeout_s=10,
        stats=StageStats(0),
    )


def _run(sched, prompts_ids, params):
    seqs = [Sequence(sched.new_id(), ids, p) for ids, p in zip(prompts_ids, params)]
    for s in seqs:
        sched.submit(s)
    while sched.busy:
        sched.step()
    return seqs


def test_scheduler_lanes_stop_and_seeded_sampling(tiny_models, hf_reference):
    tok = hf_reference.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    greedy = [SamplingParams(8)] * len(ids)
    seqs = _run(_scheduler(tiny_models[1], lanes=2), ids, greedy)  # 5 prompts queue for 2 lanes
    for p, s in zip(PROMPTS, seqs):
        assert s.tokens == hf_reference(p, 8) and s.finish_reason == "length"
        assert s.t_first >= s.t_admit >= s.t_submit
    # end of text: make the 3rd greedy token of prompt 0 the EOS id
    eos = seqs[0].tokens[2]
    s = _run(_scheduler(tiny_models[1], lanes=2, eos=eos), ids[:1], greedy[:1])[0]
    assert s.tokens == seqs[0].tokens[:3] and s.finish_reason == "stop"
    # sampling: a seed fixes the draw, whatever shares the lanes
    sp = [
        SamplingParams(10, temperature=1.0, top_k=50, top_p=0.9, seed=11 + i)
        for i in range(len(ids))
    ]
    alone = [_run(_scheduler(tiny_models[1], lanes=1), [i], [p])[0].tokens for i, p in zip(ids, sp)]
    together = [s.tokens for s in _run(_scheduler(tiny_models[1], lanes=4), ids, sp)]
    assert alone == together
    other = _run(
        _scheduler(tiny_models[1], lanes=1), ids[:1], [SamplingParams(10, temperature=1.0, seed=99)]
    )
    assert other[0].tokens != alone[0]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_two_steps_in_flight_give_what_one_at_a_time_gives(
    tiny_models, hf_reference, graphs, device
):
    """A one-stage engine with two micro-batches on the device at once (`steps_in_flight` 2, on
    the CPU and on CUDA; with `static` its decode steps are the GPU's static steps, CUDA graphs
    on a GPU, whose output the next replay writes again): the host picks one
    micro-batch's tokens while the other runs, and every sequence gets what one step at a time
    gives it: greedy (generate's tokens), an end of text, seeded sampling with
    log-probabilities, the prompt's log-probabilities, n = 2 sharing a prefill, one cancelled
    from its own token's callback."""
    from distlm.runtime.device import DeviceBackend

    tok = hf_reference.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    eos = hf_reference(PROMPTS[0], 8)[5]  # prompt 0 stops at its 6th greedy token

    def run(steps: int) -> tuple[list[tuple], int]:
        hw = DeviceBackend(
            torch.device(device),
            decode_graphs=graphs,
            capture_graphs=graphs and device == "cuda",
            steps_in_flight=steps,
        )
        sched = _scheduler(tiny_models[1], lanes=4, eos=eos, hw=hw)
        assert sched.max_in_flight == steps and sched.cap == 4 // steps
        most = [0]
        land = sched._land

        def landing() -> None:
            most[0] = max(most[0], sched.in_flight)
            land()

        sched._land = landing  # type: ignore[method-assign]
        seen: dict[int, list] = {}

        def on_token(seq: Sequence, pick) -> None:
            seen.setdefault(seq.id, []).append((pick.token, pick.logprob, pick.top))
            if seq.params.max_new_tokens == 20 and len(seq.tokens) == 3:
                sched.cancel(seq)

        def on_prompt(seq: Sequence, pick) -> None:
            seen.setdefault(-1 - seq.id, []).append(pick.prompt)

        params = [
            SamplingParams(8),
            SamplingParams(10, temperature=1.0, top_k=40, seed=5, logprobs=2),
            SamplingParams(6, prompt_logprobs=1),
            SamplingParams(7, temperature=0.8, seed=9),
            SamplingParams(20),
        ]
        seqs = [
            Sequence(sched.new_id(), i, p, on_token=on_token, on_prompt=on_prompt)
            for i, p in zip(ids, params)
        ]
        twin = Sequence(
            sched.new_id(), ids[3], SamplingParams(7, temperature=0.8, seed=10), on_token=on_token
        )
        seqs[3].siblings = [twin]
        for q in seqs:
            sched.submit(q)
        while sched.busy:
            sched.step()
        assert not sched.local and not sched.active and len(sched.free) == 4
        every = [*seqs, twin]
        return [(q.tokens, q.finish_reason, seen.get(q.id), seen.get(-1 - q.id)) for q in every], (
            most[0]
        )

    one, most_one = run(1)
    two, most_two = run(2)
    assert most_one == 1 and most_two == 2  # two micro-batches were on the device at once
    # the same tokens and ends; the log-probabilities to float rounding (micro-batches of two
    # rows, not four, sum in another order)
    for (tokens, reason, picks, prompt), got in zip(one, two, strict=True):
        assert (got[0], got[1]) == (tokens, reason)
        assert [(t, top and [a for a, _ in top]) for t, _, top in picks or ()] == [
            (t, top and [a for a, _ in top]) for t, _, top in got[2] or ()
        ]
        flat = [
            v for _, lp, top in picks or () if lp is not None for v in (lp, *dict(top).values())
        ]
        flat2 = [
            v for _, lp, top in got[2] or () if lp is not None for v in (lp, *dict(top).values())
        ]
        assert flat2 == pytest.approx(flat, abs=1e-4)
        assert (prompt is None) == (got[3] is None)
        if prompt is not None:
            mine = [lp for p in prompt for lp, _ in p]
            theirs = [lp for p in got[3] for lp, _ in p]
            assert theirs == pytest.approx(mine, abs=1e-4)
    ref = hf_reference(PROMPTS[0], 8)
    assert one[0][:2] == (ref[: ref.index(eos) + 1], "stop")
    assert one[2][0] == hf_reference(PROMPTS[2], 6) and one[2][3] is not None
    assert one[1][2] is not None and all(lp is not None for _, lp, _ in one[1][2])
    assert one[4][:2] == (hf_reference(PROMPTS[4], 3), "cancelled")
    assert one[3][0] != one[5][0]  # the two choices of one prompt, their own seeds


def test_scheduler_launches_decodes_first_by_lane(tiny_models, hf_reference):
    """Sequences end at different lengths and their lanes are reused, so the order sequences come
    back in drifts from the lanes' order; every micro-batch still goes to the stage with its
    decodes first, by lane, then its prefills (the order in which the stage reads the decode
    rows in place), and every sequence still picks generate's tokens."""
    tok = hf_reference.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    lengths = [3, 8, 5, 8, 6]
    sched = _scheduler(tiny_models[1], lanes=3)
    launched: list[list[Item]] = []
    forward = sched.model.forward
    sched.model.forward = lambda items, x, **kw: (
        launched.append(list(items)) or forward(items, x, **kw)
    )
    seqs = _run(sched, ids, [SamplingParams(n) for n in lengths])
    for p, n, s in zip(PROMPTS, lengths, seqs):
        assert s.tokens == hf_reference(p, n)
    for items in launched:
        decodes = [it for it in items if it.pos > 0]
        assert items[: len(decodes)] == decodes  # prefills after the decodes
        assert [it.lane for it in decodes] == sorted(it.lane for it in decodes)
    mixed = [items for items in launched if 0 < sum(it.pos > 0 for it in items) < len(items)]
    assert mixed, "a prefill should have joined decodes"
    # the drift happened: prompt 3 took the lane prompt 0 freed, so some micro-batch's lane
    # order is not its sequences' order
    assert any(
        [it.seq for it in items if it.pos > 0] != sorted(it.seq for it in items if it.pos > 0)
        for items in launched
    )


def test_with_decode_graphs_a_micro_batch_is_decodes_or_prefills(tiny_models, hf_reference):
    """Where the stage replays its decode steps as graphs (a GPU; here its static steps on the
    CPU), a micro-batch is all decodes or all prefills: prefills wait for each other up to
    PREFILL_EVERY decode micro-batches, then go together; every sequence still picks
    generate's tokens, and the lanes are reused as before."""
    from distlm.inference.engine.scheduler import PREFILL_EVERY
    from distlm.runtime.device import DeviceBackend

    tok = hf_reference.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS * 3]
    lengths = [3, 12, 5, 9, 6] * 3
    static = DeviceBackend(torch.device("cpu"), decode_graphs=True)
    sched = _scheduler(tiny_models[1], lanes=4, hw=static)
    assert sched.separate
    picks: list[tuple[int, str]] = []  # (prefills ready, what the micro-batch held)
    pick = sched._pick

    def watched():
        ready = sum(not q.tokens for q in sched.ready)
        batch = pick()
        picks.append((ready, "decode" if all(q.tokens for q in batch) else "prefill"))
        assert all(bool(q.tokens) == (picks[-1][1] == "decode") for q in batch)  # never mixed
        return batch

    sched._pick = watched
    seqs = _run(sched, ids, [SamplingParams(n) for n in lengths])
    for p, n, s in zip(PROMPTS * 3, lengths, seqs):
        assert s.tokens == hf_reference(p, n)
    kinds = [k for _, k in picks]
    assert "decode" in kinds and kinds.count("prefill") < len(ids)  # prefills went together
    waited = 0  # decode micro-batches in a row while a prefill was ready
    for ready, kind in picks:
        waited = waited + 1 if kind == "decode" and ready else 0
        assert waited <= PREFILL_EVERY
    assert sched.model.graphs is not None and sched.model.graphs.blocks()


# ----------------------------------------------------------------------------- MPI


def write_config(
    path: Path, *, serve: dict | None = None, runtime: dict | None = None, **over
) -> Path:
    """A resolved config as the workflow writes it: `over` in `inference`, `serve` in `serve`,
    `runtime` in `runtime`; the serve stage's document when `serve` is given, else the inference
    stage's."""
    from distlm.dag.config import validate_config
    from distlm.dag.stages import stage_config
    from distlm.settings.stage_configs import write_stage_config

    stage = "inference" if serve is None else "serve"
    cfg = validate_config({"runtime": runtime or {}, "inference": over, "serve": serve or {}})
    write_stage_config(stage, stage_config(cfg, stage), path)
    return path


def mpiexec(
    n: int, module: str, *args, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("stages,lanes", [(1, 2), (2, 1), (3, 4)])
def test_mpi_pipeline_greedy_equals_generate(tiny_models, hf_reference, tmp_path, stages, lanes):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = write_config(
        tmp_path / "cfg.json", stages=stages, lanes=lanes, max_new_tokens=10, timeout_s=60
    )
    gen, timing = tmp_path / "out" / "generations.jsonl", tmp_path / "out" / "timing.json"
    proc = mpiexec(
        stages,
        INFER,
        "--config",
        cfg,
        "--model",
        tiny_models[stages],
        "--prompts",
        prompts,
        "--generations",
        gen,
        "--timing",
        timing,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in gen.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == PROMPTS
    for r in recs:
        assert r["token_ids"] == hf_reference(r["prompt"], 10), r["prompt"]
        assert r["tokens"] == 10 and r["finish_reason"] == "length"
        assert r["text"] == hf_reference.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
    t = json.loads(timing.read_text())
    assert (
        t["stages"] == stages and t["prompts"] == len(PROMPTS) and t["tokens"] == 10 * len(PROMPTS)
    )
    assert [s["stage"] for s in t["per_stage"]] == list(range(stages))
    assert all(s["compute_s"] > 0 and s["items"] == 10 * len(PROMPTS) for s in t["per_stage"])
    assert len(t["per_prompt"]) == len(PROMPTS) and all(p["ttft_s"] > 0 for p in t["per_prompt"])
    assert [h["layers"] for h in t["hosts"]][-1][1] == N_LAYER
    assert "[rank 0]" in proc.stderr and f"[rank {stages - 1}]" in proc.stderr


@pytest.mark.parametrize("reader", ["prompt", "slow"])
def test_mpi_bad_shard_ends_every_rank_with_an_error(tiny_models, tmp_path, reader):
    """A stage whose shard fails its sha256 aborts the job (every rank ends), and its error
    reaches mpiexec's output. `slow`: the rank's proxy is stopped while the error is written (a
    loaded node, tests/harness/slow_reader): the rank waits until the proxy has read it before
    MPI_Abort, which would otherwise end the job with the error still in the pipe (an exit code
    and no output: seen once in CI)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models[2], bad)
    shard = bad / "shards" / "stage-01.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    prompts = tmp_path / "p.txt"
    prompts.write_text("A class\n")
    cfg = write_config(tmp_path / "cfg.json", stages=2, timeout_s=30)
    proc = mpiexec(
        2,
        INFER,
        "--config",
        cfg,
        "--model",
        bad,
        "--prompts",
        prompts,
        "--generations",
        tmp_path / "g.jsonl",
        "--timing",
        tmp_path / "t.json",
        timeout=180,
        env=None if reader == "prompt" else slow_reader_env(),
    )
    assert proc.returncode != 0
    assert (
        "stage-01.safetensors: sha256" in proc.stderr
        and "does not match the manifest" in proc.stderr
    )
    assert not (tmp_path / "g.jsonl").exists()


# ----------------------------------------------------------------------------- workflow


def test_inference_stage_in_workflow(workflow_run):
    import yaml

    cfg = yaml.safe_load((ROOT / "tests" / "configs" / "tiny.yaml").read_text())["inference"]
    out = workflow_run / "results" / "inference"
    prompts = read_prompts(ROOT / "config" / "prompts.txt")  # resolved against the repository root
    recs = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in recs] == prompts
    for r in recs:
        assert 1 <= r["tokens"] <= cfg["max_new_tokens"] and r["finish_reason"] in (
            "length",
            "stop",
        )
        assert r["tokens"] == len(r["token_ids"]) and isinstance(r["text"], str)
    t = json.loads((out / "timing.json").read_text())
    assert t["stages"] == cfg["stages"] == len(t["per_stage"]) == len(t["hosts"])
    assert t["model"].endswith("results/pipeline/trained")
    assert t["tokens"] == sum(r["tokens"] for r in recs) and t["tokens_per_s"] > 0
    log = (workflow_run / "logs" / "inference" / "infer.log").read_text()
    assert f"[rank {cfg['stages'] - 1}]" in log


def test_generate_batch_records_truncation_and_config_errors(tiny_models, hf_reference):
    from distlm.inference.engine.batch import generate_batch
    from distlm.inference.engine.bootstrap import Pipeline

    model = load_stage(tiny_models[1], 0, world=1)
    topo, stats = Topology.single(backend=MPI_RING), StageStats(0)
    tok = hf_reference.tokenizer
    pipe = Pipeline(topo, model, None, stats, tokenizer=tok, context=64, eos_token_id=None)
    pipe.scheduler = Scheduler(
        model, None, topo, lanes=2, eos_token_id=None, context=64, timeout_s=10, stats=stats
    )
    long = "word " * 80
    recs, timing = generate_batch(pipe, ["A class", long], icfg(max_new_tokens=6))
    assert (
        recs[0]["token_ids"] == hf_reference("A class", 6)
        and recs[0]["prompt_truncated_tokens"] == 0
    )
    assert recs[1]["prompt_tokens"] == 58 and recs[1]["prompt_truncated_tokens"] > 0
    assert timing.tokens == 12 and timing.micro_batch_size == 2 and len(timing.per_prompt) == 2
    with pytest.raises(
        DistlmError, match="prompts: prompt 2: prompt: .* exceed the model's context of 64"
    ):
        generate_batch(pipe, ["A class", long], icfg(max_new_tokens=6, prompt_overflow="reject"))
    with pytest.raises(
        DistlmError, match="config inference.max_new_tokens: 64 is beyond the model's context"
    ):
        generate_batch(pipe, ["A class"], icfg(max_new_tokens=64))


def test_the_batch_stages_seeds_wrap_as_a_requests_choices_do(tiny_models, hf_reference):
    """inference.seed at its largest: prompt i samples with the i-th seed after it, wrapped into
    0..MAX_SEED (settings.derived_seed, the rule a request's choices follow), so prompt 2 samples
    as seed 0 does, and no prompt is refused."""
    from distlm.inference.engine.batch import generate_batch
    from distlm.inference.engine.bootstrap import Pipeline
    from distlm.settings import MAX_SEED, derived_seed

    assert derived_seed(MAX_SEED, 1) == 0 and derived_seed(7, 2) == 9
    model = load_stage(tiny_models[1], 0, world=1)
    topo, stats = Topology.single(backend=MPI_RING), StageStats(0)
    pipe = Pipeline(
        topo, model, None, stats, tokenizer=hf_reference.tokenizer, context=64, eos_token_id=None
    )
    pipe.scheduler = Scheduler(
        model, None, topo, lanes=2, eos_token_id=None, context=64, timeout_s=10, stats=stats
    )
    sample = {"max_new_tokens": 8, "temperature": 1.0}
    recs, _ = generate_batch(pipe, ["A class", "The river"], icfg(seed=MAX_SEED, **sample))
    (alone,), _ = generate_batch(pipe, ["The river"], icfg(seed=0, **sample))
    assert recs[1]["token_ids"] == alone["token_ids"]
