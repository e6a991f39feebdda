"""Conversations as training examples: a record's `messages` (OpenAI's shape: role and content)
checked, rendered by the model's own chat template, and each token marked a target or not. The
targets are the assistant's turns alone: their content and the end-of-turn token that closes
each (so the model learns to stop); the template's markers, the system and user turns are not.

    example = render_chat(tokenizer, messages, where="corpus.jsonl: record 17")
    example.ids        # the conversation's token ids, as apply_chat_template renders it
    example.targets    # one bool a token: an assistant's token (its content or end of turn)

The targets are told apart by token ids, never by searching the text: each assistant turn's
tokens are those its rendering adds to the rendering of the turns before it with the assistant's
turn opened (`add_generation_prompt`), up to and with its end-of-turn token (the tokenizer's
eos). A template whose rendering of the turns before is not a prefix of the conversation's (one
that renders a turn differently once later turns follow it) is refused, naming the record: its
targets cannot be told by ids. A model made from scratch (model.source init) gets CHATML, so the
served chat route renders what training saw.

Examples are packed whole into blocks (`pack_examples`, best-fit decreasing); the model runs a
packed block with positions from 0 and attention within each example (distlm.family.packing).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlm import DistlmError

ROLES = ("system", "user", "assistant")

# ChatML (the template of SmolLM2-Instruct and of Qwen's models, without their default system
# prompts): each turn "<|im_start|>role\ncontent<|im_end|>\n"; its end-of-turn token <|im_end|>.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class ChatExample:
    """A rendered conversation: its token ids and which of them are targets."""

    ids: list[int]
    targets: list[bool]

    @property
    def n_targets(self) -> int:
        return sum(self.targets)


def check_messages(record, where: str) -> list[dict[str, str]]:
    """A record's messages: a non-empty list of {role, content}, role system, user or assistant,
    content a non-empty string, at least one assistant turn. The error names `where` (the file
    and the record) and the field."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DistlmError(f"{where}: messages: expected a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DistlmError(f"{where}: {field}: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DistlmError(f"{where}: {field}.role: {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise DistlmError(f"{where}: {field}.content: expected a non-empty string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DistlmError(f"{where}: messages: no assistant turn (nothing to learn from)")
    return out


def render_chat(tokenizer, messages: list[dict[str, str]], *, where: str) -> ChatExample:
    """`messages` (checked) rendered by the tokenizer's chat template, with its targets."""
    eot = tokenizer.eos_token_id
    if not getattr(tokenizer, "chat_template", None) or eot is None:
        raise DistlmError(f"{where}: the tokenizer has no chat template or no end-of-turn token")

    def ids(turns, opened: bool = False) -> list[int]:
        got = tokenizer.apply_chat_template(
            turns, add_generation_prompt=opened, tokenize=True, return_dict=True
        )
        return list(got["input_ids"])

    full = ids(messages)
    targets = [False] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        opened, through = ids(messages[:k], opened=True), ids(messages[: k + 1])
        if through[: len(opened)] != opened or full[: len(through)] != through:
            raise DistlmError(
                f"{where}: messages[{k}]: the chat template renders the turns before it "
                "differently once it follows them, so its tokens cannot be told by id"
            )
        turn = through[len(opened) :]
        if eot not in turn:
            raise DistlmError(
                f"{where}: messages[{k}]: the chat template closes the assistant's turn without "
                f"the end-of-turn token (id {eot})"
            )
        end = len(opened) + len(turn) - turn[::-1].index(eot)  # through its last end of turn
        targets[len(opened) : end] = [True] * (end - len(opened))
    return ChatExample(ids=full, targets=targets)


# ----------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class Packed:
    """Examples packed into rows of `block` positions: `rows[r]` the indices of the examples of
    row r, in order; `lengths[i]` example i's length as packed (truncated ones cut to a block);
    `dropped` and `truncated` the indices of the examples longer than a block, by policy."""

    block: int
    rows: list[list[int]]
    lengths: list[int]
    dropped: list[int]
    truncated: list[int]

    @property
    def efficiency(self) -> float:
        """The share of the rows' positions that hold an example's token."""
        used = sum(self.lengths[i] for row in self.rows for i in row)
        return used / (len(self.rows) * self.block) if self.rows else 1.0


def pack_examples(lengths: list[int], block: int, *, too_long: str = "drop") -> Packed:
    """Whole examples packed into rows of `block` positions, best-fit decreasing (TRL's packing):
    the longest first, each into the row whose free space it fills best, a new row when none has
    room. The result is a pure function of the lengths (ties keep the examples' order), so a
    resumed run packs as the first did. An example longer than a block is dropped or cut to one
    (`too_long`: "drop", "truncate"), and counted."""
    import bisect

    if too_long not in ("drop", "truncate"):
        raise DistlmError(f"too_long: {too_long!r} is not one of drop, truncate")
    packed_len = list(lengths)
    dropped, truncated = [], []
    for i, n in enumerate(lengths):
        if n > block:
            if too_long == "drop":
                dropped.append(i)
            else:
                truncated.append(i)
                packed_len[i] = block
    gone = set(dropped)
    order = sorted((i for i in range(len(lengths)) if i not in gone), key=lambda i: -packed_len[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i in order:
        n = packed_len[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            room, r = block - n, len(rows) - 1
        else:
            room, r = free.pop(at)
            rows[r].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, r))
    return Packed(block, rows, packed_len, dropped, truncated)
