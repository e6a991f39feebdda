"""Conversations as training examples (distlm.data.conversations): the targets are exactly the assistant's
content and end-of-turn tokens, told by token ids and checked against the rendered text; a bad
record is refused naming the file, the record and the field; a template whose turns cannot be
told by ids is refused."""

from __future__ import annotations

import pytest

from distlm import DistlmError
from distlm.data import load_embedded, train_tokenizer
from distlm.data.conversations import CHATML, IM_END, IM_START, check_messages, render_chat

WHERE = "corpus.jsonl: record 3"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A BPE of the embedded corpus with ChatML's tokens and template: an init model's."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer([t for _, t in load_embedded()][:40], 1024, 2, folder)
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.eos_token = IM_END
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


CONVERSATION = [
    {"role": "system", "content": "You answer about history."},
    {"role": "user", "content": "Who built the aqueduct?"},
    {"role": "assistant", "content": "The Romans built it, over many years."},
    {"role": "user", "content": "When?"},
    {"role": "assistant", "content": "In the first century."},
]


def spans(targets: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, t in enumerate([*targets, False]):
        if t and start is None:
            start = i
        elif not t and start is not None:
            out.append((start, i))
            start = None
    return out


def test_the_targets_are_the_assistants_content_and_end_of_turn(chatml):
    messages = check_messages({"messages": CONVERSATION}, WHERE)
    ex = render_chat(chatml, messages, where=WHERE)
    text = chatml.apply_chat_template(CONVERSATION, tokenize=False)
    assert chatml.decode(ex.ids) == text  # the ids are the template's rendering
    assert ex.ids == list(chatml.apply_chat_template(CONVERSATION, return_dict=True)["input_ids"])
    got = [chatml.decode(ex.ids[a:b]) for a, b in spans(ex.targets)]
    want = [m["content"] + IM_END for m in CONVERSATION if m["role"] == "assistant"]
    assert got == want
    assert ex.ids[spans(ex.targets)[0][1] - 1] == chatml.eos_token_id  # the stop is learned
    untargeted = "".join(chatml.decode([i]) for i, t in zip(ex.ids, ex.targets) if not t)
    assert "Romans" not in untargeted and "history" in untargeted


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, "messages: expected a non-empty list"),
        ({"messages": []}, "messages: expected a non-empty list"),
        ({"messages": ["hi"]}, r"messages\[0\]: expected an object"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            r"messages\[0\].role: 'robot' is not one of system, user, assistant",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
            r"messages\[1\].content: expected a non-empty string",
        ),
        ({"messages": [{"role": "user", "content": "q"}]}, "messages: no assistant turn"),
    ],
)
def test_a_bad_record_is_named_with_its_field(record, message):
    with pytest.raises(DistlmError, match=f"^{WHERE}: {message}"):
        check_messages(record, WHERE)


def test_a_template_that_renders_a_turn_differently_later_is_refused(chatml):
    """A template that marks the last turn: an assistant turn's tokens depend on what follows."""
    tok = chatml
    saved = tok.chat_template
    tok.chat_template = CHATML.replace(
        "message['content'] + '<|im_end|>\\n'",
        "message['content'] + ('!' if loop.last else '') + '<|im_end|>\\n'",
    )
    try:
        with pytest.raises(DistlmError, match=r"record 3: messages\[2\]: the chat template"):
            render_chat(tok, CONVERSATION, where=WHERE)
    finally:
        tok.chat_template = saved


def test_packing_fills_the_rows_and_counts_what_is_too_long():
    import random

    from distlm.data.conversations import pack_examples

    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(5.0, 0.8)) + 8 for _ in range(2000)]  # 8 .. ~2,000
    lengths[5] = 5000
    for too_long in ("drop", "truncate"):
        p = pack_examples(lengths, 1024, too_long=too_long)
        placed = sorted(i for row in p.rows for i in row)
        assert placed == sorted(set(range(len(lengths))) - set(p.dropped))  # each once
        assert all(sum(p.lengths[i] for i in row) <= 1024 for row in p.rows)
        assert p.efficiency >= 0.95
        assert p == pack_examples(lengths, 1024, too_long=too_long)  # a pure function
    long = [i for i, n in enumerate(lengths) if n > 1024]
    assert pack_examples(lengths, 1024).dropped == long
    cut = pack_examples(lengths, 1024, too_long="truncate")
    assert cut.truncated == long and all(cut.lengths[i] == 1024 for i in long)
    with pytest.raises(DistlmError, match="too_long: 'cut' is not one of drop, truncate"):
        pack_examples(lengths, 1024, too_long="cut")
