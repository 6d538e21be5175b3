"""GPT-OSS's harmony answers (``frontends.harmony``): thinking, answer and tool calls read out of the
messages however the text is split into stream pieces; and a real frontend process (on the fake engine,
which answers with the prompt's own tokens, so the model "writes" what the test puts in the message) whose
tokenizer holds harmony's markers as special tokens, answering the official ``openai`` client plain and
streamed, and the Responses and Messages APIs."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest

from frontends import harmony
from frontends.harmony import HarmonyReader
from frontends.tools import detect_format, parse_tools
from tests.test_frontend_openai import post
from tests.test_tool_calls import TOOLS, splits
from tools.fake_engine import KEY, MODEL, fake_stack

# what matters here of GPT-OSS's template: harmony's markers (it is detected by them); the prompt as it is
TEMPLATE = "{#- <|start|>assistant<|channel|>final<|message|> #}{{ messages[-1]['content'] }}"
THINK = "<|channel|>analysis<|message|>The user asks the weather. Call it.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."


def read(text_pieces: list[str], tools=None) -> tuple[str, str, list[dict], HarmonyReader]:
    """(reasoning, content, call deltas, the reader) of pieces fed in turn, then finished."""
    reader = HarmonyReader(tools)
    segments = [s for p in text_pieces for s in reader.feed(p)] + reader.finish()
    return ("".join(v for k, v in segments if k == "reasoning"), "".join(v for k, v in segments if k == "text"),
            [v for k, v in segments if k == "call"], reader)


def auto(**extra):
    return parse_tools({"tools": TOOLS, **extra}, "openai")


def test_detected_from_the_template():
    assert harmony.detect(TEMPLATE) and detect_format(TEMPLATE) == "openai"
    assert not harmony.detect("{{ messages[-1]['content'] }}<think>")


@pytest.mark.parametrize("text,reasoning,content", [
    (THINK + FINAL, "The user asks the weather. Call it.", "It is sunny in Paris."),
    (FINAL, "", "It is sunny in Paris."),
    # a preamble (commentary without a recipient) is shown to the user; a message without a channel is content
    ("<|channel|>commentary<|message|>Let me look.<|end|>" + FINAL, "", "Let me look.It is sunny in Paris."),
    ("<|start|>assistant<|message|>Hi.", "", "Hi."),
    # thinking cut short by max_tokens: all of it is thinking
    ("<|channel|>analysis<|message|>Still thinking", "Still thinking", ""),
    # not harmony (a model straying from the format): content, nothing lost; markers inside text likewise
    ("Just words.", "", "Just words."),
    ("Words <|channel|> and more", "", "Words <|channel|> and more"),
    ("<|channel|>analysis but no message", "", "<|channel|>analysis but no message"),
    # <|start|> with no <|end|> before it still starts the next message
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b"),
    # a partial marker at the end is text
    ("<|channel|>final<|message|>ends with <|en", "", "ends with <|en"),
    # a header too long to be one is text, whether it comes whole or in pieces; a message may begin after it
    ("<|channel|>final" + " x" * 300 + "<|message|>body", "", "<|channel|>final" + " x" * 300 + "<|message|>body"),
    ("<|channel|>" + "x" * 600 + "<|channel|>final<|message|>Hello", "", "<|channel|>" + "x" * 600 + "Hello"),
])
def test_thinking_and_answer_in_any_pieces(text, reasoning, content):
    for pieces in splits(text):
        got = read(pieces)
        assert got[:3] == (reasoning, content, []), pieces


def test_an_answer_whose_first_header_ends_the_prompt_begins_in_that_message():
    assert read_after("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>",
                      "Hmm.<|end|>" + FINAL) == ("Hmm.", "It is sunny in Paris.")
    assert read_after("<|start|>assistant<|channel|>final<|message|>", "Sunny.") == ("", "Sunny.")
    assert read_after("<|start|>assistant", "<|channel|>final<|message|>Sunny.") == ("", "Sunny.")
    # a call's header, its recipient first (as the template writes calls back): its arguments make the call
    reader = HarmonyReader(auto(), "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>")
    segments = reader.feed('{"city": "Quito"}') + reader.finish()
    assert [v["function"]["name"] for k, v in segments if k == "call"] == ["get_weather"]


def read_after(tail: str, text: str) -> tuple[str, str]:
    reader = HarmonyReader(None, tail)
    segments = reader.feed(text) + reader.finish()
    return "".join(v for k, v in segments if k == "reasoning"), "".join(v for k, v in segments if k == "text")


def test_a_call_of_a_requested_tool_is_read_after_its_thinking():
    for pieces in splits(THINK + CALL):
        reasoning, content, calls, reader = read(pieces, auto())
        assert reasoning == "The user asks the weather. Call it." and content == ""
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, "get_weather", {"city": "Paris"})]
        assert reader.calls[0]["id"].startswith("call_") and reader.calls[0]["type"] == "function"


def test_calls_in_either_header_order_several_and_one_when_not_parallel():
    other = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'
             '<|call|>')
    text = CALL + "<|call|>" + other
    _, content, calls, _ = read([text], auto())
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    _, content, calls, _ = read([text], auto(parallel_tool_calls=False))
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and content == other.removesuffix("<|call|>")


@pytest.mark.parametrize("text,tools", [
    (CALL, None),  # no tools asked: nothing is a call
    (CALL.replace("get_weather", "launch"), "auto"),  # not a tool of the request's
    (CALL.replace("functions.get_weather", "browser.search"), "auto"),  # a built-in tool's
    (CALL[:-3], "auto"),  # arguments cut short by max_tokens
    (CALL.replace('{"city": "Paris"}', '["Paris"]'), "auto"),  # arguments that are no object
    (CALL, "none"),  # tool_choice none
])
def test_what_is_no_call_stays_content_with_its_header(text, tools):
    req = {"auto": auto(), "none": auto(tool_choice="none"), None: None}[tools]
    for pieces in splits(text):
        _, content, calls, _ = read(pieces, req)
        assert calls == [] and content == text, pieces
    # cut short at its header's end, or within it: the header
    header = CALL.partition("<|message|>")[0]
    assert read([header + "<|message|>"], auto())[1:3] == (header + "<|message|>", [])
    assert read([header[:40]], auto())[1:3] == (header[:40], [])


# ---------------------------------------------------------------------------- a real frontend process

MARKERS = {"<repo_name>": "<|start|>", "<reponame>": "<|channel|>", "<file_sep>": "<|message|>",
           "<filename>": "<|end|>", "<gh_stars>": "<|return|>", "<issue_start>": "<|call|>",
           "<issue_comment>": "<|constrain|>"}


@pytest.fixture(scope="module")
def harmony_tokenizer_dir(tmp_path_factory, smollm_tokenizer_dir):
    """SmolLM2's tokenizer with seven of its special tokens renamed harmony's markers (special tokens in
    GPT-OSS's vocabulary too): <|return|> is id 7, <|call|> id 8."""
    out = str(tmp_path_factory.mktemp("harmony_tokenizer"))
    for name in os.listdir(smollm_tokenizer_dir):
        shutil.copy(os.path.join(smollm_tokenizer_dir, name), out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(out, name)
        with open(path) as f:
            text = f.read()
        for old, new in MARKERS.items():
            assert name != "tokenizer.json" or text.count(json.dumps(old)) == 2  # (added token, vocabulary)
            text = text.replace(json.dumps(old), json.dumps(new))
        with open(path, "w") as f:
            f.write(text)
    return out


@pytest.fixture(scope="module")
def port(tmp_path_factory, harmony_tokenizer_dir):
    with fake_stack(str(tmp_path_factory.mktemp("eng")), harmony_tokenizer_dir, chat_template=TEMPLATE) as stack:
        yield stack[1]


def chat(port, content, stream=False, **kw):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=200, stream=stream,
                                          extra_body={"stop_token_ids": [7, 8]} | kw.pop("extra_body", {}), **kw)


def test_served_thinking_and_answer_plain_and_streamed(port):
    r = chat(port, THINK + FINAL + "<|return|>")
    msg = r.choices[0].message
    assert msg.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert msg.model_extra["reasoning_content"] == "The user asks the weather. Call it."
    chunks = list(chat(port, THINK + FINAL + "<|return|>", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "It is sunny in Paris."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user asks the weather. Call it."
    assert not any("<|" in (d.content or "") for d in deltas)
    hidden = chat(port, THINK + FINAL + "<|return|>", extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "It is sunny in Paris." and "reasoning_content" not in (hidden.model_extra or {})


def test_served_tool_call_plain_and_streamed(port):
    r = chat(port, THINK + CALL + "<|call|>", tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(chat(port, THINK + CALL + "<|call|>", stream=True, tools=TOOLS))
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_served_responses_and_messages_read_harmony_too(port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    r = client.responses.create(model=MODEL, input=THINK + FINAL + "<|return|>", max_output_tokens=100,
                                extra_body={"stop_token_ids": [7, 8]})
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == "It is sunny in Paris."
    r = post(port, "/v1/messages", {"model": MODEL, "max_tokens": 100, "stop_token_ids": [7, 8],
                                    "messages": [{"role": "user", "content": THINK + FINAL + "<|return|>"}]})
    blocks = r.json()["content"]
    assert r.status_code == 200 and [b["type"] for b in blocks] == ["thinking", "text"], r.json()
    assert blocks[0]["thinking"] == "The user asks the weather. Call it." and blocks[1]["text"] == "It is sunny in Paris."


def test_served_completions_and_held_output_are_not_read(port):
    """/v1/completions is raw text (special tokens skipped, as vLLM's); output held to a schema is the JSON."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=MODEL, prompt=FINAL + "<|return|>", max_tokens=50,
                                  extra_body={"stop_token_ids": [7, 8]})
    assert r.choices[0].text == "assistantfinalIt is sunny in Paris."
    held = chat(port, FINAL + "<|return|>", response_format={"type": "json_object"}).choices[0].message
    assert held.content == "assistantfinalIt is sunny in Paris." and "reasoning_content" not in (held.model_extra or {})


def test_an_earlier_answers_thinking_goes_back_to_the_template():
    """GPT-OSS's template writes an earlier call's thinking back from ``thinking`` (Qwen3's from
    ``reasoning_content``): a client sends it as ``reasoning_content`` (or ``reasoning``), as it got it."""
    from frontends.openai_params import parse_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = parse_messages({"messages": [{"role": "user", "content": "Weather?"},
                                        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                                         "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                                        {"role": "assistant", "content": "Sunny.", "reasoning": "Say it."}]})
    assert (msgs[1]["thinking"], msgs[1]["reasoning_content"], msgs[3]["thinking"]) == ("Look it up.", "Look it up.",
                                                                                        "Say it.")
    assert "thinking" not in msgs[0] and "thinking" not in msgs[2]


def test_websocket_deltas_are_the_raw_text_and_done_the_message(port):
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/stream", additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "chat", "id": "t", "messages": [{"role": "user", "content": THINK + CALL + "<|call|>"}],
                            "tools": TOOLS, "max_tokens": 200, "stop_token_ids": [7, 8]}))
        text = ""
        while (msg := json.loads(ws.recv()))["type"] == "delta":
            text += msg["text"]
    assert text == THINK + CALL and msg["type"] == "done" and msg["finish_reason"] == "tool_calls"
    assert msg["message"]["reasoning_content"] == "The user asks the weather. Call it."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["message"]["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
