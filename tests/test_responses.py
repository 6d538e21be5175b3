"""``POST /v1/responses`` (``frontends.responses``): bodies turned into chats, and a real frontend
process (the fake engine of ``test_tool_calls``, which answers with the prompt's own tokens)
answering the official ``openai`` client's ``responses.create`` and its ``responses.stream``
helper, which rebuilds the Response from the events and checks their order. The real engine
behind it: ``test_server_default_model``."""

from __future__ import annotations

import contextlib
import json
import re

import openai
import pytest

from frontends.errors import ApiError
from frontends.responses import _echoed, to_chat
from tests.test_tool_calls import ANSWER, THOUGHT, TOOLS, client, nested, stack  # noqa: F401 - fixtures
from tools.fake_engine import MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": TOOLS[0]["function"]["parameters"]}
STOP = {"stop_token_ids": [2]}  # <|im_end|>: where the fake engine's answers end


def shape(item) -> tuple:
    """An output item without its ids (new in each response)."""
    if item.type == "function_call":
        return item.type, item.status, item.name, item.arguments
    return item.type, item.status, [(c.type, c.text) for c in item.content]


def test_bodies_become_chats():
    chat = to_chat({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
                    "input": [{"role": "user", "content": "Weather in Oslo?"},
                              {"type": "reasoning", "id": "rs_1", "summary": []},
                              {"type": "function_call", "call_id": "c1", "name": "get_weather",
                               "arguments": '{"city": "Oslo"}'},
                              {"type": "function_call", "call_id": "c2", "name": "get_weather",
                               "arguments": '{"city": "Bergen"}'},
                              {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
                              {"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "now?"}]}],
                    "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [  # parallel calls: one assistant turn
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Rain"}, {"role": "user", "content": "And now?"}]
    assert chat["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                         "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert (chat["max_tokens"], chat["temperature"], chat["model"]) == (9, 0, "m")
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    assert "tools" not in to_chat({"input": "hi", "tools": [], "tool_choice": "auto"})  # [] is no tools
    # a Response's own output sent back: the words and the call it wrote are one assistant turn
    turn = to_chat({"input": [{"role": "user", "content": "?"},
                              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
                              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})["messages"][1]
    assert turn == {"role": "assistant", "content": "On it.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_logprobs_are_asked_for_by_include():
    """``include: ["message.output_text.logprobs"]`` asks for them, ``top_logprobs`` says how many alternatives
    (alone it asks for none, as in vLLM); what else ``include`` may name is accepted."""
    asked = to_chat({"input": "hi", "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
                     "top_logprobs": 3})
    assert (asked["logprobs"], asked["top_logprobs"]) == (True, 3)
    whole = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2.0}  # (as the chat takes it)
    assert to_chat(whole)["top_logprobs"] == 2 and type(to_chat(whole)["top_logprobs"]) is int
    assert type(_echoed(whole)["top_logprobs"]) is int  # (the Response repeats it as the integer it was taken for)
    assert to_chat({"input": "hi", "include": ["message.output_text.logprobs"]})["top_logprobs"] == 0
    for body in ({"input": "hi", "top_logprobs": 5}, {"input": "hi", "include": ["reasoning.encrypted_content"]}):
        assert "logprobs" not in to_chat(body) and "top_logprobs" not in to_chat(body)
    assert "n" not in to_chat({"input": "hi", "n": 1})  # (one answer asked for: what a Response is; wrappers send it)


def test_stored_items_take_openai_s_shape():
    from frontends.responses import stored_items

    (item,) = stored_items([{"role": "assistant", "status": None, "junk": 1, "content": [
        {"type": "output_text", "text": "a", "x": 2}, {"type": "refusal", "refusal": "no"}]}])
    assert item["id"].startswith("msg_") and {k: v for k, v in item.items() if k != "id"} == {
        "type": "message", "role": "assistant", "status": "completed",  # (null: review)
        "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}]}
    # an assistant's refusal part (OpenAI's, sent back) is read as its words (review: "only text parts")
    assert to_chat({"input": [item]})["messages"][0]["content"] == "ano"


def test_a_function_without_parameters():
    chat = to_chat({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": None}]})
    assert chat["tools"] == [{"type": "function", "function": {"name": "f"}}]  # (null: none, as OpenAI's types allow)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),  # (no such call: AA)
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "d", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": {"x": 1}, "schema": {}}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),  # (review: chat's shape was named)
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),  # (no name: review AA)
    ({"input": "hi", "text": {"format": {"type": "json_schema", "json_schema": {"schema": {}}}}}, "text"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{"}]}, "input"),  # (input[1], not a chat's words)
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]}}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {  # (the chat's shape: review AA)
        "type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"input": "hi", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "hi", "include": ["message.output_text.logprob"]}, "include"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": True}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": 2.5}, "top_logprobs"),
    ({"input": [{"type": "reasoning", "content": [1]}]}, "input"),  # (review: a 500 when it was stored)
    ({"input": [{"role": "user", "content": "x", "id": ""}]}, "input"),  # (review: kept, and never deleted)
    ({"input": [{"role": "user", "content": "x", "id": 5}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input"),
    ({"input": "hi", "n": 2}, "n"),  # (the chat's and completions' own fields: one Response is one answer)
    ({"input": "hi", "n": True}, "n"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens"),
    ({"input": "hi", "logprobs": True}, "logprobs"),
])
def test_what_this_server_cannot_do_is_a_400(body, param):
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert not any(w in e.value.message for w in ("function.", "None", "tool_calls", "messages[",  # (this API's words)
                                                   "'json_schema': {"))


def test_a_text_part_whose_text_is_no_string_is_named_so():
    with pytest.raises(ApiError, match=r"input\[0\]\.content: input_text's 'text' must be a string"):
        to_chat({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]})


def test_served_text_thinking_and_a_call(client):  # noqa: F811 - the fixture
    text = THOUGHT.replace("Hello! <think> stays.", ANSWER)  # thinks, says a word, calls
    r = client.responses.create(model=MODEL, input=text, tools=[WEATHER], max_output_tokens=200, extra_body=STOP)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "\nThe user greets me.\n" and r.output_text == "Checking."
    call = r.output[2]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens  # (the thinking's batches)
    with client.responses.stream(model=MODEL, input=text, tools=[WEATHER], max_output_tokens=200,
                                 extra_body=STOP) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.content for i in added if i.type != "function_call"] == [[], []]  # parts come in their own events
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [shape(o) for o in final.output] == [shape(o) for o in r.output]
    assert 0 < final.usage.output_tokens_details.reasoning_tokens <= final.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Checking."


def test_served_logprobs_are_those_of_the_texts_tokens(client):  # noqa: F811
    """Each output_text carries its own tokens' logprobs (not the thinking's, nor the token that ends the
    answer), whole and streamed alike, the deltas' adding up to the part's."""
    kw = dict(model=MODEL, input="one two three<|im_end|>", extra_body=STOP)
    r = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    lps = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in lps) == r.output_text == "one two three" and r.top_logprobs == 2
    assert all(lp.logprob <= 0 and lp.bytes == list(lp.token.encode()) and len(lp.top_logprobs) == 2 for lp in lps)
    with client.responses.stream(include=["message.output_text.logprobs"], top_logprobs=2, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in done.logprobs] == [
        (lp.token, lp.logprob) for lp in lps] and final.output[0].content[0].logprobs == lps
    # thinks first (</think> in several tokens, the answer in one batch): the thinking's tokens have none here
    r = client.responses.create(include=["message.output_text.logprobs"], **{**kw, "input": THOUGHT + "<|im_end|>"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert "".join(lp.token for lp in r.output[1].content[0].logprobs) == "\n\n" + r.output_text  # (after </think>)
    assert client.responses.create(top_logprobs=2, **kw).output[0].content[0].logprobs == []  # (not included)


def test_refusals_name_the_input_item_a_message_came_from(client):  # noqa: F811
    """The chat's refusals that name a message name its input item: the instructions are the chat's first message,
    and a function_call joins the assistant turn before it (review: ``input[2]`` named for item 1)."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    for body, where in (({"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"},
                                                                 {"role": "bogus", "content": "x"}]}, "input[1].role"),
                        ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "On it."}, call,
                                    {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
                                    {"role": "bogus", "content": "x"}]}, "input[4].role")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, tools=[WEATHER], **body)
        assert e.value.body["param"] == "input" and e.value.body["message"].startswith(where + " must be one of")


def test_served_follow_up_and_cut_short(client):  # noqa: F811
    r = client.responses.create(model=MODEL, instructions="ignored by this template", max_output_tokens=200,
                                extra_body=STOP, tools=[WEATHER], input=[
                                    {"role": "user", "content": "Weather in Paris?"},
                                    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                     "arguments": '{"city": "Paris"}'},
                                    {"type": "function_call_output", "call_id": "call_1",
                                     "output": "Sunny, 21 C<|im_end|>"}])
    assert r.output_text == "Sunny, 21 C" and r.status == "completed"
    r = client.responses.create(model=MODEL, input="one two three four five six", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    assert r.usage.output_tokens_details.reasoning_tokens == 0  # (no thinking)
    assert (r.max_output_tokens, r.temperature, r.top_p) == (3, 1.0, 1.0)  # what it sampled with, not nulls
    with client.responses.stream(model=MODEL, input="one two three four five six", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


def test_served_required_calls_cut_short(client):  # noqa: F811
    """tool_choice "required" cut by max_output_tokens: the calls so far, the last one incomplete (as a named
    one cut short), not the array as text."""
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    r = client.responses.create(model=MODEL, input=text, tools=[WEATHER], tool_choice="required",
                                max_output_tokens=32, extra_body=STOP)
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [
        ("function_call", "completed"), ("function_call", "incomplete")]
    assert json.loads(r.output[0].arguments) == {"city": "Rome"} and r.output[1].arguments.startswith('{"city')


def test_served_named_function_streams_its_arguments(client):  # noqa: F811
    with client.responses.stream(model=MODEL, input='{"city": "Rome"}<|im_end|>', tools=[WEATHER], extra_body=STOP,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]  # the item opens, then its arguments grow with each batch of tokens
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(pieces)) == {"city": "Rome"}
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Rome"}


def test_served_bad_bodies_get_400(client):  # noqa: F811
    for kw, param in (({"previous_response_id": "resp_x"}, "previous_response_id"),
                      ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools"),
                      ({"extra_body": {"temperature": "hot"}}, "temperature")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", **kw)
        assert e.value.body["param"] == param


def test_a_server_that_stores_nothing_says_so(client):  # noqa: F811
    """Without a store (--responses-store-mib 0): nothing is kept, a previous_response_id gets OpenAI's code for one
    that is gone (review: clients that read it send the whole conversation then), and reads are 404s that say why."""
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).store is False
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", conversation="conv_1")
    assert e.value.body["param"] == "conversation"
    for call in (lambda: client.responses.retrieve("resp_1"), lambda: client.responses.delete("resp_1"),
                 lambda: client.conversations.retrieve("conv_1")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "this server stores none: --responses-store-mib 0" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.create()
    assert "this server stores none (--responses-store-mib 0)" in e.value.body["message"]


def test_served_items_keep_the_order_they_were_written_in(client):  # noqa: F811
    """Words, a call, words, a call: the same items in the same order, whole or streamed."""
    text = ('A <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> then B '
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n end.<|im_end|>')
    r = client.responses.create(model=MODEL, input=text, tools=[WEATHER, {**WEATHER, "name": "get_time"}],
                                extra_body=STOP)
    want = [("message", "completed", [("output_text", "A ")]),
            ("function_call", "completed", "get_weather", '{"city": "Oslo"}'),
            ("message", "completed", [("output_text", " then B ")]),
            ("function_call", "completed", "get_time", '{"zone": "CET"}'),
            ("message", "completed", [("output_text", "\n end.")])]
    assert [shape(o) for o in r.output] == want
    with client.responses.stream(model=MODEL, input=text, tools=[WEATHER, {**WEATHER, "name": "get_time"}],
                                 extra_body=STOP) as stream:
        final = stream.get_final_response()
    assert [shape(o) for o in final.output] == want


def test_served_thinking_dropped_and_echoed_fields(client):  # noqa: F811
    text = THOUGHT + "<|im_end|>"
    for stream in (False, True):
        kw = dict(model=MODEL, input=text, metadata={"run": "7"}, user="u1", extra_body={**STOP, "include_reasoning": False})
        if stream:
            with client.responses.stream(**kw) as s:
                r = s.get_final_response()
        else:
            r = client.responses.create(**kw)
        assert [o.type for o in r.output] == ["message"] and r.output_text == "Hello! <think> stays."
        assert (r.metadata, r.user, r.store) == ({"run": "7"}, "u1", False)
        assert r.usage.input_tokens_details.cache_write_tokens == 0


def test_served_failure_mid_stream_ends_with_response_failed(stack, client):  # noqa: F811
    engine = stack[0]
    engine.fail_after, engine.step_delay = 8, 0.01  # a few steps stream, then the engine fails the request
    try:
        with client.responses.create(model=MODEL, input="one two three four five six seven eight",
                                     max_output_tokens=50, stream=True) as events:
            got = list(events)
    finally:
        engine.fail_after, engine.step_delay = None, 0.0
    assert [e.type for e in got[-2:]] == ["error", "response.failed"]
    assert got[-1].response.status == "failed" and got[-1].response.error.message == got[-2].message
    assert got[-1].response.error.code == "server_error"  # (one of OpenAI's codes)
    (item,) = got[-1].response.output  # what was streamed is in it, closed: incomplete
    assert item.status == "incomplete" and item.content[0].text
    added = [e.item.id for e in got if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in got if e.type == "response.output_item.done"] == [item.id]


@pytest.mark.parametrize("kw,param", [
    ({"max_output_tokens": 100000}, "max_output_tokens"),  # (more than the context holds)
    ({"max_output_tokens": 3, "min_tokens": 10}, "min_tokens"),
    ({"metadata": {"a": nested(300)}}, "metadata"),
    ({"metadata": [1, 2]}, "metadata"),
    ({"text": "abc"}, "text"),
    ({"user": 5}, "user"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
])
def test_served_echoed_and_renamed_fields_are_400s_named_as_this_api_names_them(client, kw, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", extra_body=kw)
    assert e.value.body["param"] == param
    assert not any(w in e.value.body["message"] for w in ("max_tokens", "max_completion_tokens", "response_format"))


def test_served_refusals_quote_the_clients_names_as_they_came(client):  # noqa: F811
    """A refusal renamed into this API's words leaves what it quotes alone: a tool may be called max_tokens."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", tools=[{**WEATHER, "name": "max_tokens"}],
                                tool_choice={"type": "function", "name": "response_format"})
    assert e.value.body["param"] == "tool_choice" and "'response_format'" in e.value.body["message"]


@pytest.mark.parametrize("opens", [False, True])
@pytest.mark.parametrize("end_token, want", [(True, 4), (False, 5)])
def test_reasoning_tokens_count_the_thinking_up_to_its_end_token(end_token, want, opens):
    """usage.output_tokens_details.reasoning_tokens: the tokens of the batches that carried the thinking, the one
    that ends it up to the token that ends ``</think>``, one token (Qwen3's, DeepSeek-R1's) or several (here
    across two batches); the same whole and streamed. The text's logprobs are those of the tokens after. With
    ``opens``, the output opens the thinking itself, ``<think>`` in three tokens that came in batches of their own
    (review: those before the batch that showed the thinking went uncounted, so the count moved with the batching)."""
    from types import SimpleNamespace as NS

    from frontends import reasoning
    from frontends.openai_api import _Answer
    from frontends.responses import ResponsesFormat
    from frontends.text import TextCodec

    texts = {1: "a", 2: " b", 3: "c", 4: "</", 5: "think>", 7: "</think>", 8: "\n\n", 9: "Done", 10: ".",
             11: "<", 12: "think", 13: ">"}
    names = {0: "<unk>", 7: "</think>"} if end_token else {0: "<unk>"}

    class Tokenizer:  # (a vocabulary where </think> is one token, or is none)
        def __len__(self):
            return 14

        def get_vocab(self):
            return {v: k for k, v in names.items()}

        def convert_tokens_to_ids(self, text):
            return self.get_vocab().get(text, 0)

        def convert_ids_to_tokens(self, i):
            return names.get(i, "<unk>")

        def decode(self, ids, skip_special_tokens=True):
            return "".join(texts[i] for i in ids)
    codec = TextCodec(Tokenizer())

    def fmt():
        chat = NS(answers=[_Answer(reasoning.ThinkSplitter(not opens), None, True)], codec=codec, logprobs=True,
                  collect=lambda updates: None, delta_logprobs=lambda up: [{"token": t} for t in up.token_ids])
        gen = NS(api_id="resp_1", params=NS(temperature=1.0, top_p=1.0, max_tokens=50),
                 choices=[NS(finish_reason="stop", index=0)],
                 usage=lambda: {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10})
        return ResponsesFormat("m", {"input": "x"}, gen, chat)

    def batch(ids, finished=False):
        return NS(text="".join(texts[i] for i in ids), token_ids=ids, finished=finished, choice=NS(
            index=0, include_stop=False, finish_reason="stop", stop_reason=None, eos_ids=frozenset()))
    ends = [[3, 7, 8, 9]] if end_token else [[3, 4], [5, 8, 9]]  # (</ think> across two batches)
    batches = [*(map(batch, [[11], [12], [13, 1, 2]]) if opens else [batch([1, 2])]), *map(batch, ends),
               batch([10], True)]
    want += 3 if opens else 0
    whole = fmt()
    whole.collect(batches)
    r = whole.response()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"] and r["output"][1]["content"][0]["text"] == (
        "Done.")
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == want
    assert [lp["token"] for lp in r["output"][1]["content"][0]["logprobs"]] == [8, 9, 10]
    streamed = fmt()
    events = streamed.chunk(batches).decode()
    assert f'"output_tokens_details":{{"reasoning_tokens":{want}}}' in events.split("response.completed")[-1]


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(tmp_path, smollm_tokenizer_dir):
    """``truncation: "auto"``: a conversation past the context (512 tokens here) loses its oldest turns, the fewest
    that make it fit with the output asked for (as the server caps it: 100 tokens here); the instructions, the
    system and developer messages wherever they stand, and the last turn stay; no call is parted from its result.
    "disabled" (the default) is a 400, as is a last turn that cannot fit alone, and a bad truncation is named
    first. The fake engine answers with the prompt's own tokens, so the answer shows what the model was shown."""
    from tests.test_tool_calls import SMOLLM2_TEMPLATE
    from tools.fake_engine import KEY, fake_stack

    def turn(k: int) -> list[dict]:
        return [{"role": "user", "content": f"Question {k}: " + "lorem ipsum " * 20},
                {"type": "function_call", "call_id": f"c{k}", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"c{k}", "output": f"Answer {k}."},
                {"role": "assistant", "content": f"Done {k}."}]
    items = [item for k in range(8) for item in turn(k)] + [{"role": "user", "content": "Last one?"}]
    body = {"model": MODEL, "instructions": "Be brief.", "input": items, "tools": [WEATHER], "tool_choice": "none",
            "max_output_tokens": 400}  # (capped to 100; no stop token: the answer is the prompt's first 100 tokens)
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, chat_template=SMOLLM2_TEMPLATE, max_tokens_cap=100) as (
            engine, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        for truncation in (None, "disabled"):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(**body, **({"truncation": truncation} if truncation else {}))
            assert "maximum context length is 512 tokens" in e.value.body["message"]
        # the fewest oldest turns whose dropping makes it fit, found by sending the shorter conversations
        fits = []
        for k in range(9):
            try:
                fits.append(client.responses.create(**{**body, "input": items[4 * k:]}))
            except openai.BadRequestError:
                assert not fits  # (fewer turns never fit worse)
        first = 9 - len(fits)
        assert 0 < first < 8
        r = client.responses.create(**body, truncation="auto")
        assert r.truncation == "auto" and r.usage.input_tokens + 100 <= 512 and r.usage.output_tokens == 100
        assert r.usage.input_tokens == fits[0].usage.input_tokens and r.output_text == fits[0].output_text
        assert r.output_text.startswith(f"system\nBe brief.\nuser\nQuestion {first}:")  # (the prompt's first tokens)
        with pytest.raises(openai.BadRequestError) as e:  # the last turn alone is too long
            client.responses.create(**{**body, "input": [*items[:8], {"role": "user", "content": "word " * 600}]},
                                    truncation="auto")
        assert "truncation 'auto' found no cut that fits" in e.value.body["message"] and e.value.body["param"] == "input"
        r = client.responses.create(**{**body, "input": items[-5:]}, truncation="auto")  # fits: nothing dropped
        assert "Question 7:" in r.output_text
        # a developer's rule among the turns dropped stays, in its place (review: it went with its turn)
        rule = {"role": "developer", "content": "RULE: answer in French."}
        r = client.responses.create(**{**body, "input": [*items[:4], rule, *items[4:]]}, truncation="auto")
        assert r.output_text.startswith("system\nBe brief.\nsystem\nRULE: answer in French.\nuser\nQuestion ")
        assert r.usage.input_tokens + 100 <= 512 and "Question 0:" not in r.output_text
        # a cut between a call and its output would part them: none is made (review: the output stayed alone)
        parted = [items[0], items[1], {"role": "user", "content": "Hurry up."},
                  {**items[2], "output": "word " * 500}]
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**{**body, "input": parted}, truncation="auto")
        with pytest.raises(openai.BadRequestError) as e:  # (not the context's 400: review)
            client.responses.create(**body, truncation="AUTO")
        assert e.value.body["param"] == "truncation"


def test_oldest_turns_dropped_are_the_fewest_whole_turns_that_fit():
    """``oldest_turns_dropped`` against every cut tried: the fewest turns dropped for what is kept to fit (a size
    budget here), rules kept wherever they stand, no tool result parted from its call (the nearest before it of
    its id: review, an id used twice), the last turn kept; over random conversations."""
    import asyncio
    import random

    from frontends.responses import oldest_turns_dropped

    def u(n):
        return {"role": "user", "content": "u" * n}
    rng = random.Random(0)
    for _ in range(300):
        msgs = [{"role": "system", "content": "s"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 12)):
            msgs.append(u(rng.randint(1, 9)))
            if rng.random() < 0.3:
                msgs.append({"role": "developer", "content": "d"})
            if rng.random() < 0.5:
                cid = rng.choice(["x", "y"])  # (ids used again)
                msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function"}]})
                if rng.random() < 0.5:
                    msgs.append(u(rng.randint(1, 3)))  # (a user's words between a call and its result)
                msgs.append({"role": "tool", "tool_call_id": cid, "content": "r" * rng.randint(1, 5)})
        budget = rng.randint(3, 60)

        def size(ms):
            return sum(len(m["content"] or "") + 1 for m in ms)

        async def fits(ms, budget=budget):
            return size(ms) <= budget
        kept = asyncio.run(oldest_turns_dropped(msgs, fits))
        rules = [m["role"] in ("system", "developer") for m in msgs]
        want = None  # the brute force: every user message past a non-rule, no result parted, the first that fits
        for start in range(1, len(msgs)):
            keep = [k for k in range(len(msgs)) if k >= start or rules[k]]
            parted = any(msgs[k].get("tool_call_id") is not None and msgs[k]["tool_call_id"] not in {
                c["id"] for j in range(start, k) for c in msgs[j].get("tool_calls") or ()} for k in range(start, len(msgs)))
            if msgs[start]["role"] != "user" or all(rules[:start]) or parted:
                continue
            if size([msgs[k] for k in keep]) <= budget:
                want = keep
                break
        assert kept == want, (msgs, budget)


# every message shown, and its calls; one <|im_end|> at the end, where the fake engine's answer (the prompt again)
# stops: each answer is the conversation the model was shown. (<tool_call>: the hermes format is read)
SHOWN_TEMPLATE = ("{%- if tools %}{# answers <tool_call>{...}</tool_call> #}{%- endif %}{%- for m in messages %}{{ m.role }}: {{ m.content or '' }}"
                  "{%- for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments }}]"
                  "{%- endfor %}{{ '\\n' }}{% endfor %}<|im_end|>")
OTHER_KEY = "sk-other-key"


@contextlib.contextmanager
def stored_stack(where, tokenizer_dir: str, step_delay: float = 0.0):
    """Two frontends on their own ports (as a server's share one) over one fake engine (``step_delay``) and one
    store file, with two API keys. Yields (the engine, [a client of frontend A and of B under the first key, and of A
    under the other], the store file, the ports)."""
    from tools.fake_engine import KEY, FakeEngine, free_port, start_frontend, stop_frontend

    engine = FakeEngine(f"ipc://{where}/engine.sock", step_delay=step_delay)
    engine.start()
    procs, store = [], str(where / "responses.sqlite")
    try:
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            procs.append(start_frontend(engine.address, tokenizer_dir, port, api_keys=(KEY, OTHER_KEY),
                                        frontend_id=f"fe-{i}", chat_template=SHOWN_TEMPLATE, responses_store=store))
        yield engine, [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=k, max_retries=0)
                       for p, k in ((ports[0], KEY), (ports[1], KEY), (ports[0], OTHER_KEY))], store, ports
        assert [stop_frontend(p) for p in procs] == [0, 0]
    except BaseException:
        for p in procs:
            stop_frontend(p)
        raise
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def kept(tmp_path_factory, smollm_tokenizer_dir):
    """``stored_stack``'s clients."""
    with stored_stack(tmp_path_factory.mktemp("kept"), smollm_tokenizer_dir) as (_, clients, _, _):
        yield clients


def test_previous_response_id_continues_a_stored_conversation(kept):
    """``previous_response_id`` is the conversation so far sent whole: each earlier turn's input, then its output
    items (calls included), without the earlier instructions (OpenAI's rule); on another frontend than the one that
    answered it, plain and streamed (stored before the stream says it is done: continued at once)."""
    a, b, _ = kept
    kw = dict(model=MODEL, extra_body=STOP, tools=[WEATHER])
    first = [{"role": "user", "content": 'Q1 <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                         '</tool_call>'}]
    r1 = a.responses.create(input=first, instructions="Be brief.", **kw)
    assert r1.store and r1.previous_response_id is None
    assert [o.type for o in r1.output] == ["message", "function_call"]  # (the prompt again: its call is read)
    result = [{"type": "function_call_output", "call_id": r1.output[1].call_id, "output": "Sunny"}]
    r2 = b.responses.create(previous_response_id=r1.id, input=result, **kw)
    whole = [*first, *[o.model_dump() for o in r1.output], *result]  # what a stateless client sends
    assert r2.output_text == a.responses.create(input=whole, store=False, **kw).output_text
    assert r1.output_text.startswith("system: Be brief.\n") and r2.output_text.startswith("user: Q1")  # (not carried)
    assert "[call get_weather" in r2.output_text and r2.output_text.endswith("tool: Sunny\n")
    assert r2.previous_response_id == r1.id
    with b.responses.stream(previous_response_id=r2.id, input="Q3", **kw) as stream:
        r3 = stream.get_final_response()
    whole += [*[o.model_dump() for o in r2.output], {"role": "user", "content": "Q3"}]
    assert r3.output_text == a.responses.create(input=whole, store=False, **kw).output_text
    with pytest.raises(openai.BadRequestError) as e:  # (two of one input's own, with nothing before: review)
        a.responses.create(input=[{"role": "user", "content": "a", "id": "msg_x"},
                                  {"role": "user", "content": "b", "id": "msg_x"}], **kw)
    assert e.value.body["message"].startswith("Duplicate item found with id msg_x.")
    with pytest.raises(openai.BadRequestError) as e:  # (an earlier output sent again: OpenAI's 400; review)
        a.responses.create(previous_response_id=r3.id, input=[r2.output[0].model_dump()], **kw)
    assert e.value.body["message"] == f"Duplicate item found with id {r2.output[0].id}. Remove duplicate items from " \
        "your input and try again."
    r4 = a.responses.create(previous_response_id=r3.id, input="Q4", **kw)  # (the stream's: stored before it ended)
    whole += [*[o.model_dump() for o in r3.output], {"role": "user", "content": "Q4"}]
    assert r4.usage.input_tokens == a.responses.create(input=whole, store=False, **kw).usage.input_tokens


def test_stored_responses_are_retrieved_listed_and_deleted(kept):
    """GET, its input_items (OpenAI's paging) and DELETE, from any frontend, under the key that made them alone."""
    a, b, other = kept
    given = [{"role": "user", "content": f"item {k}"} for k in range(5)]
    given[1] = {**given[1], "junk": "x" * 1000}  # (review: kept and said back as sent)
    r = a.responses.create(model=MODEL, input=given, extra_body=STOP)
    assert re.fullmatch(r"resp_[0-9a-f]{32}", r.id)  # (review: a counter, which anyone could count on)
    got = b.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = b.responses.input_items.list(r.id, order="asc")
    assert [i.model_dump(exclude={"id"}, exclude_none=True) for i in items.data] == [  # (OpenAI's shape: review)
        {"type": "message", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": f"item {k}"}]}
        for k in range(5)]
    assert len({i.id for i in items.data}) == 5 and all(i.id.startswith("msg_") for i in items.data)
    page = a.responses.input_items.list(r.id, limit=2)  # newest first, by default
    assert [i.id for i in page.data] == [i.id for i in items.data[::-1][:2]] and page.has_more
    rest = a.responses.input_items.list(r.id, limit=5, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[::-1][2:]] and not rest.has_more
    assert [i.id for i in a.responses.input_items.list(r.id, limit=2)] == [i.id for i in items.data[::-1]]  # (paged)
    for query, param in (({"limit": "²"}, "limit"), ({"limit": "0"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_nope"}, "after")):  # ("²": review, a 500)
        with pytest.raises(openai.BadRequestError) as e:
            a.responses.input_items.list(r.id, extra_query=query)
        assert e.value.body["param"] == param
    for query in ({"stream": "true"}, {"stream": "garbage"}):
        with pytest.raises(openai.BadRequestError) as e:
            a.responses.retrieve(r.id, extra_query=query)
        assert e.value.body["param"] == "stream"
    text = b.responses.retrieve(a.responses.create(model=MODEL, input="plain", extra_body=STOP).id)
    assert text.output_text == "user: plain\n"
    # another key sees none of them, continues none, deletes none
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"
    b.responses.delete(r.id)
    for call in (lambda: a.responses.retrieve(r.id), lambda: a.responses.delete(r.id),
                 lambda: b.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{r.id}' not found."


def test_what_is_not_stored_is_not_continued(kept):
    """``store: false`` keeps nothing; an unknown id, or a conversation whose earlier Response was deleted, is
    OpenAI's 400 (``previous_response_not_found``: clients that read it send the whole conversation instead)."""
    a, b, _ = kept
    r = a.responses.create(model=MODEL, input="not kept", store=False, extra_body=STOP)
    assert r.store is False
    for rid in (r.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            b.responses.create(model=MODEL, input="x", previous_response_id=rid)
        assert e.value.body == {"message": f"Previous response with id '{rid}' not found.",
                                "type": "invalid_request_error", "param": "previous_response_id",
                                "code": "previous_response_not_found"}
    r1 = a.responses.create(model=MODEL, input="one", extra_body=STOP)
    r2 = a.responses.create(model=MODEL, input="two", previous_response_id=r1.id, extra_body=STOP)
    a.responses.delete(r1.id)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=MODEL, input="three", previous_response_id=r2.id)
    assert e.value.body["code"] == "previous_response_not_found" and "no longer stored" in e.value.body["message"]
    for kw, param in (({"previous_response_id": 5}, "previous_response_id"),
                      ({"previous_response_id": ""}, "previous_response_id"),
                      ({"store": "yes"}, "store")):
        with pytest.raises(openai.BadRequestError) as e:
            a.responses.create(model=MODEL, input="x", extra_body=kw)
        assert e.value.body["param"] == param


def test_an_output_is_checked_against_its_call_only_where_the_input_is_the_whole_conversation(kept):
    """A function_call_output that answers no call is a 400 in a stateless input (review AA), but a stored history
    may have lost the call, and a conversation's items come a few at a time: not checked there (review AD: a
    call and its output added in two batches were refused, a deleted call broke every later turn)."""
    a, _, _ = kept
    kw = dict(model=MODEL, extra_body=STOP)
    call = {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c9", "output": "Rain"}
    with pytest.raises(openai.BadRequestError, match="no function_call found"):
        a.responses.create(input=[{"role": "user", "content": "Q"}, output], store=False, **kw)
    conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "Q"}])
    (stored_call,) = a.conversations.items.create(conv.id, items=[call]).data
    a.conversations.items.create(conv.id, items=[output])  # (its call is stored already)
    a.conversations.items.delete(stored_call.id, conversation_id=conv.id)
    r = a.responses.create(conversation=conv.id, input="next", **kw)  # (the output's call gone: still a turn)
    assert r.output_text.endswith("tool: Rain\nuser: next\n")
    r = a.responses.create(input="Q", **kw)  # (stored; a call cut short would be left out of the history)
    r = a.responses.create(previous_response_id=r.id, input=[{**output, "call_id": "cut_short"}], **kw)
    assert r.output_text.startswith("user: Q\nassistant: ") and r.output_text.endswith("tool: Rain\n")


def test_a_conversation_holds_its_turns_and_grows_with_each_response(kept):
    """OpenAI's Conversations API: a Response given a ``conversation`` is that conversation's items and then its
    input (answered as the whole sent in ``input`` is), and adds its input and output to them, on either frontend,
    plain and streamed, with ``store: false`` too; items are listed, added, read and deleted; the conversation is
    read, updated and deleted; all under the key that made it."""
    a, b, other = kept
    kw = dict(model=MODEL, extra_body=STOP)
    conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "Q0"}], metadata={"k": "v"})
    assert conv.id.startswith("conv_") and conv.metadata == {"k": "v"}
    r1 = b.responses.create(conversation=conv.id, input="Q1", **kw)
    assert r1.conversation.id == conv.id and r1.output_text == "user: Q0\nuser: Q1\n"
    with a.responses.stream(conversation={"id": conv.id}, input="Q2", **kw) as stream:
        r2 = stream.get_final_response()
    whole = [{"role": "user", "content": "Q0"}, {"role": "user", "content": "Q1"},
             *[o.model_dump() for o in r1.output], {"role": "user", "content": "Q2"}]
    assert r2.output_text == a.responses.create(input=whole, store=False, **kw).output_text
    r3 = b.responses.create(conversation=conv.id, input="Q3", store=False, **kw)  # (not kept: its turn is)
    items = list(a.conversations.items.list(conv.id, order="asc", limit=3))  # (paged: 3 a page)
    texts = [(i.role, i.content[0].text) for i in items]
    assert texts == [("user", "Q0"), ("user", "Q1"), ("assistant", r1.output_text), ("user", "Q2"),
                     ("assistant", r2.output_text), ("user", "Q3"), ("assistant", r3.output_text)]
    assert len({i.id for i in items}) == 7 and items[2].id == r1.output[0].id
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r3.id)
    added = b.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Q4"}])
    (new,) = added.data
    assert a.conversations.items.retrieve(new.id, conversation_id=conv.id).content[0].text == "Q4"
    r5 = a.responses.create(conversation=conv.id, input="Q5", **kw)
    assert r5.output_text.endswith("user: Q4\nuser: Q5\n")
    assert b.conversations.items.delete(new.id, conversation_id=conv.id).id == conv.id
    assert "Q4" not in a.responses.create(conversation=conv.id, input="Q6", store=False, **kw).output_text
    # an item sent again (an earlier output, with its id) is OpenAI's 400, not the same turn shown twice (review)
    for call in (lambda: a.responses.create(conversation=conv.id, input=[r1.output[0].model_dump()], **kw),
                 lambda: b.conversations.items.create(conv.id, items=[r1.output[0].model_dump()]),
                 lambda: b.conversations.items.create(conv.id, items=[{**added.data[0].model_dump(), "id": "dup"}] * 2)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["message"].startswith("Duplicate item found with id ")
    assert b.conversations.update(conv.id, metadata={"k": "w"}).metadata == {"k": "w"}
    assert a.conversations.retrieve(conv.id).metadata == {"k": "w"}
    # another key sees, grows and deletes none of it
    for call in (lambda: other.conversations.retrieve(conv.id), lambda: other.conversations.items.list(conv.id),
                 lambda: other.conversations.delete(conv.id), lambda: other.responses.create(
                     conversation=conv.id, input="x", **kw)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:  # (its earlier turns are in it: one or the other)
        a.responses.create(conversation=conv.id, previous_response_id=r1.id, input="x", **kw)
    assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as e:  # (its turn alone would be read: not the conversation before it)
        a.responses.create(previous_response_id=r1.id, input="x", **kw)
    assert e.value.body["code"] == "previous_response_not_found" and "continue that conversation" in e.value.body[
        "message"]
    assert a.conversations.delete(conv.id).deleted
    for call in (lambda: b.conversations.retrieve(conv.id), lambda: b.conversations.items.list(conv.id),
                 lambda: b.responses.create(conversation=conv.id, input="x", **kw)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Conversation with id '{conv.id}' not found."
    assert b.responses.retrieve(r1.id).output_text == r1.output_text  # (its Responses stay)


@pytest.mark.parametrize("body,param", [
    ({"items": "hi"}, "items"),
    ({"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
    ({"items": [{"type": "web_search_call"}]}, "items"),
    ({"items": [5]}, "items"),
    ({"items": {}}, "items"),
    ({"items": [{"type": "message", "role": "user", "content": "x", "id": ""}]}, "items"),
    ({"items": [{"type": "message", "role": "bogus", "content": "x"}]}, "items"),  # (review: every turn after a 400)
    ({"items": [{"type": "message", "content": "x"}]}, "items"),
    ({"items": [{"type": "message", "role": "user", "content": "x", "status": "weird"}]}, "items"),
    ({"items": [{"type": "message", "role": "assistant", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "items"),
    ({"items": [{"type": "reasoning", "content": [1]}]}, "items"),  # (review: a 500)
    ({"metadata": {"k": 5}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_bad_conversations_are_400s(kept, body, param):
    a = kept[0]
    with pytest.raises(openai.BadRequestError) as e:
        a.conversations.create(extra_body=body)
    assert e.value.body["param"] == param
    conv = a.conversations.create()
    if "items" in body:
        with pytest.raises(openai.BadRequestError) as e:
            a.conversations.items.create(conv.id, items=body["items"])
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        a.conversations.items.retrieve("msg_nope", conversation_id=conv.id)
    import httpx

    auth = {"Authorization": f"Bearer {a.api_key}"}
    for path in ("", "/items"):  # (HEAD: a GET's head; review: a 405)
        assert httpx.head(f"{a.base_url}conversations/{conv.id}{path}", headers=auth).status_code == 200
    r = httpx.post(f"{a.base_url}conversations/{conv.id}/items/msg_1", headers=auth, json={})
    assert r.status_code == 405 and r.headers["allow"] == "GET, DELETE, HEAD"
    for method in ("PUT", "PATCH"):  # (the same, whatever the method: review AA saw PUT allowed POST here)
        r = httpx.request(method, f"{a.base_url}conversations/{conv.id}/items/msg_1", headers=auth, json={})
        assert r.status_code == 405 and r.headers["allow"] == "GET, DELETE, HEAD"
        r = httpx.request(method, f"{a.base_url}responses/resp_1", headers=auth, json={})
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, DELETE"
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.create(model=MODEL, input="x", conversation={"name": conv.id})
    assert e.value.body["param"] == "conversation"
