"""GPT-OSS's answers in OpenAI's harmony format, read into a chat message as they stream.

A harmony answer is a run of messages, each a header and a body: ``<|channel|>analysis<|message|>`` its
thinking ``<|end|>``, ``<|start|>assistant<|channel|>final<|message|>`` the answer (ended by ``<|return|>``,
an end-of-turn token the text never shows), or a tool call, ``<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>`` its arguments (ended by ``<|call|>``, the other end-of-turn token). The
recipient may come before the channel too (``<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>``, as the chat template writes calls back). The markers are special tokens, so such a chat's
text is decoded with them kept (``keeps_special_tokens``), and ``HarmonyReader`` takes them out again:

- the analysis channel's bodies go to ``reasoning_content`` (as vLLM's openai_gptoss reasoning parser);
- the final channel's, and a commentary one without a recipient (a preamble shown to the user), to ``content``;
- a body addressed to ``functions.NAME`` of the request's tools, whose text is a JSON object, is a tool call
  (finish_reason "tool_calls"); any other (a built-in tool's, an unknown function's, arguments that are not an
  object: a call cut short by ``max_tokens``) stays content with its header, so nothing the model wrote is lost;
- text that is not a harmony message (a model that strays from the format) is content too.

On by default where the chat template writes ``<|channel|>`` (``detect``), or with ``--reasoning-parser
openai_gptoss`` or ``--tool-call-parser openai`` (vLLM's names). Output held to a schema (structured output,
tool_choice "required" or a named function) is not read as harmony: its text is the JSON.
"""

from __future__ import annotations

import re

from frontends.text import partial_suffix
from frontends.tools import Segment, ToolRequest, detect_format, json_values, new_call

CHANNEL, MESSAGE, START, END = "<|channel|>", "<|message|>", "<|start|>", "<|end|>"
_OPENS = (CHANNEL, START)  # what a header begins with
_ENDS = (END, "<|call|>", "<|return|>", START)  # what ends a body (<|start|>: a header missing its <|end|>)
_HEADER_LIMIT = 512  # characters of a header without <|message|>: past that it is taken for text
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def _next_open(text: str, end: int | None = None) -> int:
    """Where in ``text`` (past its first character) a message may begin: the first <|channel|> or <|start|> before
    ``end``; else ``end``, or with None the text's end less a marker's first characters (they may grow into one)."""
    starts = [i for i in (text.find(m, 1) for m in _OPENS) if i > 0 and (end is None or i < end)]
    if starts:
        return min(starts)
    return end if end is not None else len(text) - max(partial_suffix(text, m) for m in _OPENS)


def detect(chat_template: str | None) -> bool:
    """Whether a chat template is harmony's (GPT-OSS's): the call format it teaches is "openai"."""
    return detect_format(chat_template) == "openai"


class HarmonyReader:
    """One choice's harmony text as segments ("reasoning", text), ("text", content), ("call", a tool-call
    delta), in the order written: ``feed`` each piece of text, then ``finish``. ``calls`` holds the calls read;
    ``tools``: the request's (None: no call is read, every body addressed to a tool stays content)."""

    mode = "harmony"

    def __init__(self, tools: ToolRequest | None, prompt_tail: str = "") -> None:
        """``prompt_tail``: the prompt's last characters, special tokens kept: where it ends in a header
        (``...<|channel|>analysis<|message|>``, a template that opens the answer's first message), the answer
        begins in that message's body."""
        self.tools = tools if tools is not None and tools.mode == "auto" else None
        self.calls: list[dict] = []
        self._held = ""
        self._header: str | None = ""  # the message header read so far; None: inside a body
        self._channel, self._recipient = "", None
        self._raw = ""  # a call's header as written: content, with its body, if the call is not taken
        self._args = ""  # a call's body, read whole before it is let out
        if prompt_tail.endswith(MESSAGE):  # (the header from its <|start|>: the recipient may come first)
            at = prompt_tail.rfind(START) if START in prompt_tail else prompt_tail.rfind(CHANNEL)
            if at >= 0:
                self._read_header([], prompt_tail[at:])
                self._raw = ""  # (the prompt's: not the answer's to give back)

    @property
    def thinking(self) -> bool:
        """Inside the body of an analysis message (its reasoning)."""
        return self._header is None and self._recipient is None and self._channel == "analysis"

    def feed(self, text: str) -> list[Segment]:
        self._held += text
        out: list[Segment] = []
        while self._held:
            if self._header is not None:
                if not self._read_header(out):
                    break
            elif not self._read_body(out):
                break
        return out

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        held, self._held = self._held, ""
        if self._header is None:
            self._body_text(held, out)
            self._end_body(out)
        elif self._header + held:
            out.append(("text", self._header + held))  # a header cut short: what it wrote stays
        self._header = ""
        return out

    def _read_header(self, out: list[Segment], text: str | None = None) -> bool:
        """Take a header up to <|message|>, or text that is none; False while it needs more. ``text``: this
        instead of what was held (the prompt's tail)."""
        text, self._header, self._held = self._header + self._held if text is None else text, "", ""
        if not text.startswith(_OPENS):
            if any(m.startswith(text) for m in _OPENS):  # a marker's first characters: wait
                self._header = text
                return False
            cut = _next_open(text)  # not harmony: content, up to where a message may begin
            out.append(("text", text[:cut]))
            self._held = text[cut:]
            return True
        at = text.find(MESSAGE)
        if at > _HEADER_LIMIT or at < 0 and len(text) > _HEADER_LIMIT:
            # no header ends so late: text, up to where a message may begin (as a stream that grew past the limit
            # before its <|message|> came would have let it out)
            cut = _next_open(text, at if at >= 0 else None)
            out.append(("text", text[:cut]))
            self._held = text[cut:]
            return True
        if at < 0:
            self._header = text
            return False
        header, self._held = text[:at], text[at + len(MESSAGE):]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self._channel, self._recipient = (channel[1] if channel else ""), (recipient[1] if recipient else None)
        self._header, self._args, self._raw = None, "", header + MESSAGE
        return True

    def _read_body(self, out: list[Segment]) -> bool:
        """Stream body text up to its end marker; False while it needs more."""
        ends = [(i, m) for m in _ENDS if (i := self._held.find(m)) >= 0]
        if not ends:
            keep = max(partial_suffix(self._held, m) for m in _ENDS)
            self._body_text(self._held[:len(self._held) - keep], out)
            self._held = self._held[len(self._held) - keep:]
            return False
        at, marker = min(ends)
        self._body_text(self._held[:at], out)
        self._held = self._held[at + (0 if marker == START else len(marker)):]
        self._end_body(out)
        self._header = ""
        return True

    def _body_text(self, text: str, out: list[Segment]) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._args += text  # a call: whole, at its end
        elif self._channel == "analysis":
            out.append(("reasoning", text))
        else:  # final, a preamble in commentary, or a channel the format does not name
            out.append(("text", text))

    def _end_body(self, out: list[Segment]) -> None:
        if self._recipient is None:
            return
        name = self._recipient.removeprefix("functions.")
        values = json_values(self._args)
        known = self.tools is not None and self._recipient.startswith("functions.") and name in self.tools.schemas
        allowed = known and (self.tools.parallel or not self.calls)
        if allowed and values is not None and len(values) == 1 and isinstance(values[0][0], dict):
            call = new_call(name, self._args.strip())
            self.calls.append(call)
            out.append(("call", {"index": len(self.calls) - 1, **call, "function": dict(call["function"])}))
        elif self._raw + self._args:  # no call taken: what the model wrote, its header too
            out.append(("text", self._raw + self._args))
        self._recipient, self._args, self._raw = None, "", ""

