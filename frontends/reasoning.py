"""Reasoning models' thinking, split from their answer.

Qwen3, QwQ, DeepSeek-R1 and its distills think in ``<think>...</think>`` before they answer.
``ThinkSplitter`` sends that text to the message's ``reasoning_content`` (the field DeepSeek's API,
llama.cpp's server and vLLM fill) and the rest to ``content``, as the text streams. A choice is
thinking from its first token when its prompt ends in an open ``<think>`` (DeepSeek-R1's template
opens it) or when its text begins with ``<think>`` (Qwen3's way; with ``enable_thinking`` false its
template closes an empty one in the prompt, and the answer is all content); ``</think>`` ends it.
Thinking never closed (cut by ``max_tokens``) is all reasoning. On with ``--reasoning-parser``, by
default wherever the chat template knows ``</think>``; a request sets ``include_reasoning`` false
to drop the thinking, and output held to a schema (structured output, tool calls held to the
tools) has none to split.
"""

from __future__ import annotations

from frontends.text import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def detect(chat_template: str | None) -> bool:
    """Whether a chat template is a thinking model's."""
    return bool(chat_template) and CLOSE in chat_template


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the answer inside ``<think>``."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThinkSplitter:
    """One choice's text as (reasoning, content): ``feed`` each piece, then ``finish``."""

    def __init__(self, thinking: bool) -> None:
        self.state = "think" if thinking else "start"  # start: not yet known; then think, gap (after it), answer
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "answer":
            return "", text
        self._held += text
        reasoning = ""
        if self.state == "start":
            lead = self._held.lstrip()
            if lead.startswith(OPEN):
                self._held, self.state = lead[len(OPEN):], "think"
            elif OPEN.startswith(lead):
                return "", ""  # whitespace, or the tag's first characters: not yet known
            else:
                self.state = "answer"
                text, self._held = self._held, ""
                return "", text
        if self.state == "think":
            end = self._held.find(CLOSE)
            if end < 0:
                keep = partial_suffix(self._held, CLOSE)
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning, self._held, self.state = self._held[:end], self._held[end + len(CLOSE):], "gap"
        content = self._held.lstrip()  # the blank lines between thinking and the answer
        if content:
            self.state, self._held = "answer", ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.state == "think":
            return held, ""
        return "", held if self.state == "start" else ""
