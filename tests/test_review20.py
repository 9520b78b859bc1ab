"""Session 20: the router tokenizes chat content sent as OpenAI parts as SGLang does."""

from __future__ import annotations

import pytest

from sglang_tiered.fleet.router import Router, messages_for_template, template_content_format

OPENAI_TEMPLATE = (
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|eot_id|>{% endfor %}"
)

MESSAGES = [
    [{"role": "user", "content": [{"type": "text", "text": "hello there"}, {"type": "text", "text": "general"}]}],
    [{"role": "system", "content": "be brief", "name": None},
     {"role": "user", "content": [{"type": "input_text", "text": "a b c"}]},
     {"role": "assistant", "content": None},
     {"role": "user", "content": "plain text"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "x"}]}],
    [{"role": "user", "content": []}],
    [{"role": "tool", "content": [{"type": "text", "text": "42"}, {"type": "text", "text": "degrees"}], "tool_call_id": "a"},
     {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
]  # fmt: skip


@pytest.mark.parametrize("template", ["tiny", OPENAI_TEMPLATE, "{{ messages | length }} vision"])
def test_content_format_and_messages_match_sglang(template, tiny_model_path):
    """Against SGLang's own detection and message processing (the generic chat path of
    serving_chat.py: null content -> "", process_content_for_template_format,
    normalize_tool_content)."""
    import copy

    from sglang.srt.entrypoints.openai.serving_chat import normalize_tool_content
    from sglang.srt.parser.jinja_template_utils import (
        detect_jinja_template_content_format,
        process_content_for_template_format,
    )
    from transformers import AutoTokenizer

    if template == "tiny":
        template = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True).chat_template
    fmt = template_content_format(template)
    assert fmt == detect_jinja_template_content_format(template)
    for msgs in MESSAGES:
        want = []
        for m in copy.deepcopy(msgs):
            if m.get("content") is None:
                m["content"] = ""
            got = process_content_for_template_format(m, fmt, [], [], [], [])
            got["content"] = normalize_tool_content(got["role"], got.get("content"))
            want.append(got)
        assert messages_for_template(msgs, fmt) == want


def test_router_chat_tokens_of_text_parts_equal_plain_text(tiny_model_path):
    """With the tiny model's string template, text parts are the text joined by spaces: the
    router's tokens equal those of the same prompt sent as one string (before: the parts' Python
    repr was tokenized, and such prompts lost their locality)."""
    from transformers import AutoTokenizer

    router = Router(["http://127.0.0.1:9"], None, load_poll_s=0, model_path="")
    router.tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "the shared system prompt"},
                                                      {"type": "text", "text": "and a question"}]}]}  # fmt: skip
    plain = {"messages": [{"role": "user", "content": "the shared system prompt and a question"}]}
    a = router.tokens_of("/v1/chat/completions", parts)
    assert a and a == router.tokens_of("/v1/chat/completions", plain)
    kw = router.tokens_of("/v1/chat/completions", {**plain, "chat_template_kwargs": {"unused": 1}})
    assert kw == a
