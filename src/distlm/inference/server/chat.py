"""A chat request's prompt: its messages checked, then rendered by the model folder's chat template
(the tokenizer's `chat_template`, through transformers' `apply_chat_template` with the generation
prompt added, as vLLM and `transformers serve` render it). The rendered token ids are the prompt.

Every error is a RequestError (400) naming the field (`messages[2].role`); a folder without a
chat template is a 400 that says how to add one, never a 500.
"""

from __future__ import annotations

from distlm.inference.prompts import RequestError
from distlm.inference.server.errors import short

_ROLES = ("system", "user", "assistant")
_MESSAGE_FIELDS = ("role", "content", "name")
_A_MESSAGE = "an object with role and content"
_A_PART = 'a text part {"type": "text", "text": "..."}'

NO_TEMPLATE = (
    "messages: this model folder has no chat template, so a conversation cannot be rendered as "
    "a prompt; add a Jinja `chat_template` to the folder's tokenizer_config.json (or a "
    "chat_template.jinja file beside it) and restart the server, or send the prompt as text to "
    "/v1/completions"
)


def _bad(where: str, what: str) -> RequestError:
    return RequestError(f"{where}: {what}", param=where)


def check_messages(messages) -> None:
    """OpenAI's messages, text only: a non-empty list of {role, content[, name]} objects, role
    system, user or assistant, content a string or a list of text parts."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty list of messages, got {short(messages)}")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected {_A_MESSAGE}, got {short(m)}")
        for k in m:
            if k not in _MESSAGE_FIELDS:
                raise _bad(
                    f"{where}.{k}" if len(k) <= 60 else where,
                    f"unknown field {short(k)} (a message has {', '.join(_MESSAGE_FIELDS)})",
                )
        if "role" not in m:
            raise _bad(f"{where}.role", "required")
        if m["role"] not in _ROLES:
            roles = ", ".join(repr(r) for r in _ROLES)
            raise _bad(f"{where}.role", f"expected one of {roles}, got {short(m['role'])}")
        if "content" not in m:
            raise _bad(f"{where}.content", "required")
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                ok = (
                    isinstance(part, dict)
                    and set(part) == {"type", "text"}
                    and part["type"] == "text"
                    and isinstance(part["text"], str)
                )
                if not ok:
                    raise _bad(f"{where}.content[{j}]", f"expected {_A_PART}, got {short(part)}")
        elif not isinstance(content, str):
            raise _bad(
                f"{where}.content",
                f"expected a string or a list of text parts, got {short(content)}",
            )
        if "name" in m and not isinstance(m["name"], str):
            raise _bad(f"{where}.name", f"expected a string, got {short(m['name'])}")


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's chat template, the assistant's
    turn opened (add_generation_prompt). A template that refuses the conversation (Jinja's
    `raise_exception`, say roles that do not alternate) is a 400 quoting it."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(NO_TEMPLATE, param="messages")
    try:
        got = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except (TemplateError, TypeError, ValueError) as e:
        raise RequestError(
            f"messages: the model's chat template refused them ({type(e).__name__}: {e})",
            param="messages",
        ) from None
    return list(got["input_ids"])
