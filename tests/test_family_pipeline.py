"""Llama-family models through the pipeline: stage shards, the MPI inference stage and the server
against single-process Hugging Face models, for the shapes in tests/harness/families.py
(grouped-query attention with 1 and 2 KV heads, tied and untied embeddings, Llama 3.2's rope
scaling, Qwen2's QKV bias; 5 layers at 1, 2 and 3 stages)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import test_server
import torch
from harness.families import CASES, N_LAYER, STAGES, build_family_models
from test_inference import INFER, PROMPTS, mpiexec, write_config

from distlm.inference.engine.pipeline_stage import Item, load_stage


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """{case: its folders} (built once per session, on first use)."""
    root = tmp_path_factory.getbasetemp() / "family-models"
    cache: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in cache:
            cache[case] = build_family_models(root, case)
        return cache[case]

    return get


class Reference:
    """Single-process AutoModelForCausalLM on a case's transformers folder: greedy `generate`
    and prompt log-probabilities."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.ids = [self.tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]

    def generate(self, ids: list[int], n: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=self.tok.eos_token_id,
            eos_token_id=self.tok.eos_token_id,
        )
        return out[0, len(ids) :].tolist()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), V) log-probabilities of the token after each position."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)


_REFS: dict[str, Reference] = {}


def reference(family_models, case: str) -> Reference:
    if case not in _REFS:
        _REFS[case] = Reference(family_models(case)["hf"])
    return _REFS[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage_chain_greedy_and_prompt_logprobs_match_transformers(family_models, case):
    """In one process, every prompt packed in one micro-batch through the S stage modules in
    turn (S = 1, 2, 3): greedy tokens equal `generate`'s, and the prompt log-probabilities of
    the prefill (the last stage's `every`) equal AutoModelForCausalLM's to 1e-4."""
    ref = reference(family_models, case)
    ids, n_new = ref.ids, 10
    want = [ref.generate(i, n_new) for i in ids]
    assert sum(len(set(w)) > 3 for w in want) >= 4, "the references should vary"
    for stages in (1, 2, 3):
        folder = family_models(case)[stages]
        models = [load_stage(folder, s, world=stages) for s in range(stages)]
        assert sum(len(m.cut.layers) for m in models) == N_LAYER
        assert models[0].n_kv_head == CASES[case]["n_kv_head"]
        items = [Item(k, k, 0, len(i)) for k, i in enumerate(ids)]
        x = torch.tensor([t for i in ids for t in i])
        got: list[list[int]] = [[] for _ in ids]
        for step in range(n_new):
            h = x
            for m in models[:-1]:
                h = m(items, h)
            if step == 0:  # the prefill: every prompt position's logits too
                last, rest = models[-1](items, h, every=frozenset(range(len(ids))))
                for k, i in enumerate(ids):
                    lp = torch.log_softmax(torch.cat([rest[k], last[k : k + 1]]).float(), -1)
                    assert torch.allclose(lp, ref.logprobs(i), atol=1e-4), (case, stages, k)
            else:
                last = models[-1](items, h)
            nxt = last.argmax(-1)
            for k in range(len(ids)):
                got[k].append(int(nxt[k]))
            items = [Item(k, k, len(ids[k]) + step, 1) for k in range(len(ids))]
            x = nxt
        eos = ref.tok.eos_token_id  # generate stops after end-of-text; the chain runs on
        got = [g[: g.index(eos) + 1] if eos in g else g for g in got]
        assert got == want, (case, stages)


# Each case once and each stage count once: the stage chain above runs every case at 1, 2 and 3
# stages in one process; what the entry point adds (mpiexec ranks, lanes, admission while others
# decode) is the same code for every family (tests/test_inference.py runs it for GPT-2).
MPI_RUNS = list(zip(sorted(CASES), itertools.cycle(sorted(STAGES, reverse=True))))
MPI_RUNS[-1] = (MPI_RUNS[-1][0], 2)  # Qwen3 over two stages (the stage counts stay covered)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "stages"), MPI_RUNS)
def test_mpi_inference_stage_greedy_equals_generate(family_models, tmp_path, case, stages):
    """The inference stage's entry point (mpiexec, one rank per stage) with 3 lanes for 5
    prompts of different lengths: lanes at different positions share micro-batches, and a
    prompt is admitted while others decode."""
    ref = reference(family_models, case)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = write_config(
        tmp_path / "cfg.json", stages=stages, lanes=3, max_new_tokens=8, timeout_s=60
    )
    gen, timing = tmp_path / "generations.jsonl", tmp_path / "timing.json"
    folder = family_models(case)[stages]
    proc = mpiexec(
        stages,
        INFER,
        *("--config", cfg, "--model", folder, "--prompts", prompts),
        *("--generations", gen, "--timing", timing),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in gen.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == PROMPTS
    for r, ids in zip(recs, ref.ids):
        assert r["token_ids"] == ref.generate(ids, 8), (case, stages, r["prompt"])
    t = json.loads(timing.read_text())
    assert [h["layers"] for h in t["hosts"]][-1][1] == N_LAYER


@pytest.mark.slow
def test_server_token_id_prompts_echo_and_logprobs(family_models, tmp_path):
    """The API server and a 3-stage pipeline of a Llama model (untied, grouped-query, llama3
    rope): lm-eval's log-likelihood request (token ids, echo, logprobs) equals a single-process
    AutoModelForCausalLM to 1e-4, and greedy text equals `generate`'s."""
    case = "llama-kv2-untied-llama3"
    ref = reference(family_models, case)
    server = test_server.start_server(family_models(case)[3], 3, tmp_path, lanes=4, timeout_s=30)
    try:
        for max_tokens in (0, 1):
            status, body = server.request(
                "POST",
                "/v1/completions",
                {
                    "prompt": ref.ids[:3],
                    "echo": True,
                    "logprobs": 1,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            assert status == 200, body
            for ids, c in zip(ref.ids[:3], body["choices"]):
                lp = ref.logprobs(ids)
                want = lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
                got = c["logprobs"]
                assert len(got["tokens"]) == len(ids) + max_tokens
                assert got["token_logprobs"][0] is None
                assert got["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
                for k in range(1, len(ids)):
                    ((word, best),) = got["top_logprobs"][k].items()
                    assert word == ref.tok.decode([int(lp[k - 1].argmax())])
                    assert best == pytest.approx(float(lp[k - 1].max()), abs=1e-4)
                if max_tokens:
                    assert got["token_logprobs"][-1] == pytest.approx(float(lp[-1].max()), abs=1e-4)
        client = test_server.client(server)
        r = client.completions.create(model="s3", prompt=PROMPTS[:3], max_tokens=9, temperature=0)
        assert [ch.text for ch in r.choices] == [
            ref.tok.decode(ref.generate(i, 9), skip_special_tokens=True) for i in ref.ids[:3]
        ]
    finally:
        test_server.stop_server(server)


@pytest.mark.slow
@pytest.mark.with_slurm  # ~2.5 min: tests/run.sh runs it in the session that mostly waits on SLURM
def test_transformers_serve_and_lm_eval_on_a_llama_folder(
    family_models, tmp_path, monkeypatch, hub_offline
):
    """The distlm model folder of a Llama model loads unchanged in `transformers serve` (greedy
    text equals `generate`'s), and lm-eval's `local-completions` against a 2-stage distlm server
    of it scores the tasks in tests/lm_eval/ as lm-eval's `hf` model does on the folder; with a
    chat template in the folder's tokenizer, `local-chat-completions` (--apply_chat_template)
    gives its `hf` model's answers, document by document."""
    import json
    import shutil

    import test_ecosystem
    from test_serve_chat import TEMPLATE

    case = "llama-kv2-untied-llama3"
    ref = reference(family_models, case)
    folder = family_models(case)["model"]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    doc = test_ecosystem.transformers_serve_once(
        folder, {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}, tmp_path / "ts.log"
    )
    want = ref.tok.decode(ref.generate(ref.ids[0], 6), skip_special_tokens=True)
    assert doc["choices"][0]["text"] == want
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    s2 = tmp_path / "s2"  # the 2-stage folder, its tokenizer given a chat template
    shutil.copytree(family_models(case)[2], s2)
    config = s2 / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    server = test_server.start_server(s2, 2, tmp_path, lanes=4, timeout_s=30)
    try:
        monkeypatch.chdir(test_ecosystem.ROOT)  # the task YAMLs name their data from the root
        monkeypatch.setenv("OPENAI_API_KEY", test_server.TOKEN)
        api = test_ecosystem._evaluate(
            "local-completions",
            f"model=s2,base_url={server.base}/v1/completions,tokenizer={folder},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=64",
        )
        chat = test_ecosystem.chat_over_api("s2", server.base)
    finally:
        test_server.stop_server(server)
    hf = test_ecosystem._evaluate(
        "hf", f"pretrained={folder},device=cpu,dtype=float32,max_length=64"
    )
    hf_chat = test_ecosystem.chat_with_hf(folder, s2)
    test_ecosystem.assert_same_evaluation(api, hf)
    test_ecosystem.assert_same_chat_answers(chat, hf_chat)


@pytest.mark.slow
def test_transformers_serve_loads_a_qwen3_folder_distlm_wrote(family_models, tmp_path, hub_offline):
    """Qwen3's model folder as distlm writes it loads unchanged in `transformers serve` and in
    AutoModelForCausalLM: greedy text equals `generate`'s."""

    import test_ecosystem

    case = "qwen3-kv2-untied-hd16"
    ref = reference(family_models, case)
    folder = family_models(case)["model"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    doc = test_ecosystem.transformers_serve_once(
        folder, {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}, tmp_path / "ts.log"
    )
    want = ref.tok.decode(ref.generate(ref.ids[1], 6), skip_special_tokens=True)
    assert doc["choices"][0]["text"] == want
