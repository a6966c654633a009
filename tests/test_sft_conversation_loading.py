"""Conversation SFT rows, tokenised once per chat (a chunk of rows per call) and cut where each rendering ends, hold
exactly the tokens and loss mask that tokenising every rendering on its own gives (``apply_chat_template`` per prefix,
the definition): with cuts beside special tokens (the char tokenizer's template), with cuts inside plain text (a
template without special tokens), and with a template that changes earlier tokens (an error naming the row)."""

from __future__ import annotations

import json

import pytest

from backends.data import DataError
from backends.models import build_char_tokenizer
from backends.rollout.environments import MultiTurnConfig, tool_schemas
from backends.training.sft import SFTConfig, load_sft_examples
from experiments.tasks import calculator

pytestmark = pytest.mark.multiturn

#: role names as plain text: no cut falls beside a special token
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
#: the generation prompt differs from how an assistant turn starts: earlier tokens change
CHANGING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def by_renders(messages: list[dict], tok, template: str | None, tools) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, response ids, loss mask) from one apply_chat_template call per rendering."""

    def ids(msgs, gen):
        out = tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=gen, chat_template=template, tools=tools
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    tokens, mask = [], []
    for k in turns:
        for rendered, trained in ((ids(messages[:k], True), False), (ids(messages[: k + 1], False), True)):
            assert rendered[: len(tokens)] == tokens
            mask += [trained] * (len(rendered) - len(tokens))
            tokens = rendered
    p = len(ids(messages[: turns[0]], True))
    return tokens[:p], tokens[p:], mask[p:]


def write_conversations(path, count: int = 300) -> list[list[dict]]:
    rows = list(
        calculator.sft_conversations(
            [(100 + i, 300 + 2 * i) for i in range(50)], count, direct=0.2, wrong_operand=0.25, wrong_copy=0.25, seed=1
        )
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["messages"] for r in rows]


@pytest.mark.parametrize("template", ["auto", "plain"])
def test_conversations_tokenised_once_equal_every_rendering_tokenised(tmp_path, template):
    tok = build_char_tokenizer(words=calculator.TOKENIZER_WORDS)
    tools = tool_schemas(MultiTurnConfig(max_turns=3, tools=("experiments.tasks.calculator:multiply",)))
    chats = write_conversations(tmp_path / "sft.jsonl")  # 300 rows: more than one chunk of rows per tokenizer call
    text = None
    if template == "plain":
        (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
        text, template = PLAIN_TEMPLATE, str(tmp_path / "plain.jinja")
    examples = load_sft_examples(
        SFTConfig(files=(str(tmp_path / "sft.jsonl"),), messages_key="messages"),
        tok,
        chat_template=template,
        tools=tools,
    )
    assert len(examples) == len(chats)
    for example, chat in zip(examples, chats):
        prompt, response, mask = by_renders(chat, tok, text, tools)
        got = (list(example.prompt_ids), list(example.response_ids), list(example.loss_mask))
        assert got == (prompt, response, mask)
    assert sum(1 for m in chats if sum(x["role"] == "assistant" for x in m) == 2) > 100  # tool-use traces, two turns


def test_a_template_that_changes_earlier_tokens_is_an_error_naming_the_row(tmp_path):
    tok = build_char_tokenizer()
    (tmp_path / "t.jinja").write_text(CHANGING_TEMPLATE)
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    (tmp_path / "sft.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(
        DataError,
        match=r"sft\.jsonl:line 1: the chat template renders message 1's conversation "
        r"so that an earlier part changes",
    ):
        load_sft_examples(
            SFTConfig(files=(str(tmp_path / "sft.jsonl"),), messages_key="messages"),
            tok,
            chat_template=str(tmp_path / "t.jinja"),
        )
