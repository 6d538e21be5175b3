"""Anthropic's ``POST /v1/messages`` (``frontends.anthropic``): bodies turned into chats, and a real frontend
process (the fake engine of ``test_tool_calls``, which answers with the prompt's own tokens) answering the
official ``anthropic`` client's ``messages.create``, its ``messages.stream`` helper (which rebuilds the
Message from the events and checks their order) and ``messages.count_tokens``; the key sent as Anthropic's
``x-api-key``. The real engine behind it: ``test_server_default_model``."""

from __future__ import annotations

import json

import anthropic
import pytest

from frontends.anthropic import error, renamed, to_chat
from frontends.errors import ApiError
from tests.test_tool_calls import ANSWER, THOUGHT, TOOLS, stack  # noqa: F401 - fixtures
from tools.fake_engine import KEY, MODEL

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": TOOLS[0]["function"]["parameters"]}
STOP = {"stop_token_ids": [2]}  # <|im_end|>: where the fake engine's answers end


@pytest.fixture
def client(stack):  # noqa: F811 - the fixture
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{stack[1]}", api_key=KEY, max_retries=0)


def deep(n: int) -> dict:
    x: dict = {}
    for _ in range(n):
        x = {"a": x}
    return x


def shape(block) -> tuple:
    return (block.type, block.name, block.input) if block.type == "tool_use" else (block.type, getattr(
        block, "text", None) or getattr(block, "thinking", None))


def test_bodies_become_chats():
    chat = to_chat({"model": "m", "system": [{"type": "text", "text": "Be brief."}], "max_tokens": 9,
                    "stop_sequences": ["END"], "temperature": 0, "top_k": 5, "tools": [WEATHER],
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"},
                    "messages": [{"role": "user", "content": "Weather in Oslo and Bergen?"},
                                 {"role": "assistant", "content": [
                                     {"type": "thinking", "thinking": "two calls", "signature": "x"},
                                     {"type": "text", "text": "Checking."},
                                     {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                                     {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Bergen"}}]},
                                 {"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "Rain"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "no station"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "t2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Rain"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no station"},
        {"role": "user", "content": "And tomorrow?"}]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_k"]) == (9, ["END"], 0, 5)
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": WEATHER[
        "description"], "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    held = to_chat({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive"},
                    "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert held["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {
        "type": "object"}}} and held["chat_template_kwargs"] == {"enable_thinking": True}
    assert to_chat({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                    "tool_choice": {"type": "tool", "name": "get_weather"}})["tool_choice"] == {
        "type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),  # required, as Anthropic's
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b",
                                                                   "input": {}}]}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}}, "thinking"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": {
        "type": "regex"}}}, "output_config"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "output_format": []}, "output_format"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "u"}]}, "mcp_servers"),
    ({"max_tokens": 5, "system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"},
      "chat_template_kwargs": 3}, "chat_template_kwargs"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "b", "input": deep(300)}]}]}, "messages"),  # (past orjson's depth)
    # (review: each passed, the tools as none, the switch as off, the budget unread)
    *(({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": bad}, "tools")
      for bad in ({}, 0, "", False, {"name": "f"})),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, "tool_choice"),
    *(({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "thinking": {"type": "enabled", "budget_tokens": bad}}, "thinking") for bad in (-5, 0, "1024", True, 1.5)),
])
def test_what_this_server_cannot_do_is_a_400(body, param):
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_tool_result_answers_a_tool_use_of_the_turn_before():
    """As Anthropic's API (review Z: one without its tool_use was taken, a template then shows an answer to no call)."""
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
    for messages in ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
                     [{"role": "user", "content": "x"}, use,
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "r"}]}],
                     [{"role": "user", "content": "x"}, use, {"role": "user", "content": "y"},
                      {"role": "assistant", "content": "z"},  # (t1's, two turns back)
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}]):
        with pytest.raises(ApiError, match=r"messages\[\d\]\.content\[0\]: unexpected tool_use_id") as e:
            to_chat({"max_tokens": 5, "messages": messages})
        assert (e.value.status, e.value.param) == (400, "messages")
    # consecutive messages of one role are one turn, as Anthropic combines them (review AD)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}
    for messages in ([{"role": "user", "content": "x"}, use, {"role": "assistant", "content": "waiting"}, result],
                     [{"role": "user", "content": "x"}, use, {"role": "user", "content": "wait"}, result]):
        assert to_chat({"max_tokens": 5, "messages": messages})["messages"][-1]["tool_call_id"] == "t1"


def test_a_text_block_without_its_text_is_named_so():
    """(It fell through to "blocks of type 'text' are not supported", the list after it naming text: review.)"""
    for text in (None, 5):
        block = {"type": "text"} if text is None else {"type": "text", "text": text}
        with pytest.raises(ApiError) as e:
            to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": [block]}]})
        assert e.value.message == "messages[0].content[0]: a text block needs its text, a string"


def test_a_tool_is_checked_in_this_apis_words():
    """A tool's input_schema must be an object's (a tool_use's input is an object: one of an integer came back
    as ``"input": 1234567890``, which this server then refused when the client sent it back)."""
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    for tool, words in (({"name": "pick", "input_schema": {"type": "integer"}}, "tools[0].input_schema must be a "
                         "JSON schema of type 'object'"), ({"name": "a b", "input_schema": {}}, "tools[0].name")):
        with pytest.raises(ApiError) as e:
            to_chat({**body, "tools": [tool]})
        assert (e.value.status, e.value.param) == (400, "tools") and e.value.message.startswith(words)



def test_refusals_take_this_apis_names_and_types():
    e = renamed(ApiError(400, "a named function cannot be combined with response_format", param="response_format"))
    assert (e.param, e.message) == ("output_config", "{'type': 'tool', 'name': ...} cannot be combined with "
                                                     "output_config")
    assert error(ApiError(408, "the request's timeout passed"))["type"] == "timeout_error"  # (the SDK's type)


def test_served_text_thinking_and_a_call(client):
    text = THOUGHT.replace("Hello! <think> stays.", ANSWER)  # thinks, says a word, calls
    m = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], extra_body=STOP,
                               messages=[{"role": "user", "content": text}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == "\nThe user greets me.\n" and m.content[1].text == "Checking."
    call = m.content[2]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == {"city": "Paris", "unit": "celsius"}
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER], extra_body=STOP,
                                messages=[{"role": "user", "content": text}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [shape(b) for b in final.content] == [shape(b) for b in m.content] and final.stop_reason == "tool_use"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta") \
        == "Checking."
    assert final.usage.output_tokens == m.usage.output_tokens


def test_served_follow_up_stop_sequence_and_cut_short(client):
    m = client.messages.create(model=MODEL, max_tokens=200, system="ignored by this template", tools=[WEATHER],
                               extra_body=STOP, messages=[
                                   {"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": [
                                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                        "input": {"city": "Paris"}}]},
                                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                 "content": "Sunny, 21 C<|im_end|>"}]}])
    assert [shape(b) for b in m.content] == [("text", "Sunny, 21 C")] and m.stop_reason == "end_turn"
    m = client.messages.create(model=MODEL, max_tokens=50, stop_sequences=["four"],
                               messages=[{"role": "user", "content": "one two three four five six"}])
    assert m.content[0].text == "one two three " and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "four")
    m = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "one two three four"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    with client.messages.stream(model=MODEL, max_tokens=3,
                                messages=[{"role": "user", "content": "one two three four"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == m.content[0].text


def test_served_prefill_is_continued(client):
    """A last assistant message is the start of the answer (the template's end of its turn cut off)."""
    m = client.messages.create(model=MODEL, max_tokens=50, extra_body=STOP, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "one two<|im_end|>"}])
    counted = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "one two<|im_end|>"}]).input_tokens
    assert m.usage.input_tokens == counted


def test_served_chat_continues_a_final_message_as_vllm_does(stack):  # noqa: F811
    import openai

    chat = openai.OpenAI(base_url=f"http://127.0.0.1:{stack[1]}/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "one two"}]
    r = chat.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                     extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content == "one two"  # (the fake engine says its prompt again)
    # vLLM's echo: the answer begins with the message it goes on with (an assistant's), plain and streamed
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    r = chat.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=extra)
    assert r.choices[0].message.content == "one twoone two"
    chunks = list(chat.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one twoone two"
    assert chunks[0].choices[0].delta.content == "one two"  # (with the role, first)
    r = chat.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=1, extra_body={"echo": True})
    assert r.choices[0].message.content == "x"  # (a user's last message: nothing echoed)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False,
                                                     "messages": msgs[:1]}):
        with pytest.raises(openai.BadRequestError) as e:
            chat.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs, extra_body=extra)
        assert e.value.body["param"] == "continue_final_message"


def test_served_named_tool_streams_its_input(client):
    for answer in ('{"city": "Rome"}<|im_end|>', '\n  {"city": "Rome"}<|im_end|>'):  # (the SDK parses each delta)
        with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER], extra_body=STOP,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": answer}]) as stream:
            events = list(stream)
            final = stream.get_final_message()
        pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert json.loads("".join(pieces)) == {"city": "Rome"} and not pieces[0][0].isspace()
        (call,) = final.content
        assert call.type == "tool_use" and call.input == {"city": "Rome"} and final.stop_reason == "tool_use"
    m = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], extra_body=STOP,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": '{"city": "Rome"}<|im_end|>'}])
    assert m.stop_reason == "tool_use" and m.content[0].input == {"city": "Rome"}


def test_served_count_tokens_and_keys(client, stack):  # noqa: F811
    body = dict(model=MODEL, messages=[{"role": "user", "content": "one two three"}])
    counted = client.messages.count_tokens(**body).input_tokens
    m = client.messages.create(max_tokens=2, **body)
    assert counted == m.usage.input_tokens > 0
    bad = anthropic.Anthropic(base_url=f"http://127.0.0.1:{stack[1]}", api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(max_tokens=2, **body)
    import urllib.request

    both = urllib.request.Request(f"http://127.0.0.1:{stack[1]}/v1/messages", data=json.dumps(
        {**body, "max_tokens": 2}).encode(), headers={"content-type": "application/json", "x-api-key": KEY,
                                                      "authorization": "Bearer other"})  # (either may be the key)
    with urllib.request.urlopen(both) as r:
        assert json.loads(r.read())["usage"]["output_tokens"] == 2
    with_tools = client.messages.count_tokens(**body, tools=[WEATHER]).input_tokens
    assert with_tools >= counted


def test_served_bad_bodies_get_400(client):
    for kw, param in (({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
                      ({"stop_sequences": ["x"] * 100}, "stop_sequences"),
                      ({"extra_body": {"temperature": "hot"}}, "temperature"),
                      ({"max_tokens": 20000}, "max_tokens")):  # (past the context: the chat's field named as here)
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                      **kw})
        assert e.value.body["error"]["param"] == param, e.value.body
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:  # (Anthropic's shape on these routes, as vLLM answers)
        client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in e.value.body["error"]["message"]


def test_served_failure_mid_stream_ends_with_an_error_event(stack, client):  # noqa: F811
    engine = stack[0]
    engine.fail_after, engine.step_delay = 8, 0.01  # a few steps stream, then the engine fails the request
    try:
        with pytest.raises(anthropic.APIStatusError) as e, client.messages.stream(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "one two three four five six"}]) as s:
            list(s)
    finally:
        engine.fail_after, engine.step_delay = None, 0.0
    assert "error" in str(e.value).lower()


@pytest.mark.parametrize("extra,param", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format"),
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_a_prefill_held_to_a_format_is_refused(extra, param):
    """The format (or the forced call) would hold only what follows the prefill: '{"a":' + '{"a": 1}' is no JSON."""
    body = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '{"a":'}]}
    with pytest.raises(ApiError, match="prefilled") as e:
        to_chat({**body, **extra})
    assert e.value.status == 400 and e.value.param == param
    assert to_chat({**body, "tools": [WEATHER]})["continue_final_message"]  # (tools the model may call: fine)
