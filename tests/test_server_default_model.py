"""``tokenmill serve`` with no ``--model``: the bundled SmolLM2-135M-Instruct answers.

Then the engine is killed: in-flight and new requests get 503 instead of
hanging, ``/health`` says 503, and the launcher exits non-zero (last test: it
ends the module's server).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the Server helper, whatever the import mode
from test_server_e2e import Server, http_status, openai_client, pid_alive, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def server(default_gguf):
    s = Server()
    yield s
    s.close()


def test_default_model_knows_the_capital_of_france(server):
    assert server.banner.startswith("tokenmill serving SmolLM2-135M-Instruct")
    r = openai_client(server).chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content


def test_a_text_model_refuses_images(server):
    import openai

    url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    with pytest.raises(openai.BadRequestError, match="does not read images") as e:
        openai_client(server).chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}])
    assert e.value.body["param"] == "messages"


def test_a_model_without_fim_tokens_refuses_infill(server):
    """llama.cpp's /infill needs the model's fill-in-the-middle tokens: SmolLM2 has none (501, llama.cpp's words)."""
    import json
    import urllib.error
    import urllib.request

    import openai

    req = urllib.request.Request(server.url + "/infill", json.dumps({"input_prefix": "a", "input_suffix": "b"}).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 501 and json.loads(e.value.read()) == {"error": {
        "code": 501, "type": "not_supported_error", "message": "Infill is not supported by this model: prefix "
        "token is missing. suffix token is missing. middle token is missing. "}}
    # and OpenAI's suffix, the same fill in the middle: a 400 that says why
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="a", suffix="b", max_tokens=1)
    assert e.value.body["param"] == "suffix" and "fill-in-the-middle tokens" in e.value.body["message"]
    r = openai_client(server).completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="a", suffix="", max_tokens=1)
    assert r.choices[0].finish_reason  # ("": no gap, a plain completion, as code clients send it at a file's end)


def test_anthropic_messages_api(server):
    """Anthropic's SDK against the real model: a system prompt, the answer, its usage and stop reason, and
    output held to a schema (``output_config``)."""
    import json

    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    m = client.messages.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=24, extra_body={"temperature": 0},
                               system="You are a helpful assistant.",
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in m.content[0].text and m.stop_reason == "end_turn" and 0 < m.usage.output_tokens < 24
    with client.messages.stream(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=24, extra_body={"temperature": 0},
                                system="You are a helpful assistant.",
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
        assert "".join(s.text_stream) == m.content[0].text
    m = client.messages.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=60, extra_body={"temperature": 0},
                               output_config={"format": {"type": "json_schema", "schema": CAPITAL}},
                               messages=[{"role": "user", "content": "What is the capital of France? In JSON."}])
    assert list(json.loads(m.content[0].text)) == ["country", "capital"] and m.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as e:  # the engine's refusal, named as this API names it
        client.messages.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               output_config={"format": {"type": "json_schema", "schema": {"type": "integer", "minimum": 1}}})
    assert e.value.body["error"]["param"] == "output_config" and "minimum" in e.value.body["error"]["message"]


def test_a_refusal_is_named_by_each_apis_own_field(server):
    """The engine's refusal of a schema names the field it came in (Ollama's ``format``, TGI's ``grammar``), and
    Anthropic's count_tokens refuses the tools a call would (tool_choice "auto": SmolLM2's template shows none)."""
    import json
    import urllib.request

    import anthropic

    def post(path, body):
        rq = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(rq, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    bogus = {"type": "object", "properties": {"a": {"type": "bogus"}}}
    status, body = post("/api/chat", {"model": "SmolLM2-135M-Instruct.Q4_1", "format": bogus, "stream": False,
                                      "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"].startswith("format: 'type' must be one of"), body
    status, body = post("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": bogus}}})
    assert status == 422 and body["error"].startswith("Input validation error: grammar: 'type'"), body
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    ask = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Weather in Paris?"}])
    for call in (client.messages.count_tokens, functools.partial(client.messages.create, max_tokens=5)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call(**ask, tools=[tool])
        assert e.value.body["error"]["message"].startswith("tool_choice 'auto' needs a tool-call format")
    assert client.messages.count_tokens(**ask, tools=[tool], tool_choice={"type": "any"}).input_tokens > 0


CAPITAL = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
           "required": ["country", "capital"]}


def test_response_format_holds_the_answer_to_a_schema(server):
    import json

    from openai import BadRequestError

    client = openai_client(server)
    ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL}})
    answer = json.loads(r.choices[0].message.content)
    assert list(answer) == ["country", "capital"] and "Paris" in answer["capital"]
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=60,
                                            temperature=0, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    for extra in ({"guided_choice": ["Berlin", "London", "Paris"]},  # vLLM's fields
                  {"structured_outputs": {"choice": ["Berlin", "London", "Paris"]}}):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=10,
                                           messages=[{"role": "user", "content": "What is the capital of France? "
                                                                                 "Answer with one word."}],
                                           extra_body=extra)
        assert r.choices[0].message.content == "Paris" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="The capital of France, in JSON:",
                                  max_tokens=40, temperature=0, extra_body={"json_schema": CAPITAL})  # llama.cpp's
    assert list(json.loads(r.choices[0].text)) == ["country", "capital"]
    for bad, word in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                      "pattern": "(?=a)"}}}, "lookarounds"),
                      ({"type": "yaml"}, "yaml")):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=5,
                                           response_format=bad, stream=True)
        assert e.value.body["param"] == "response_format" and word in e.value.body["message"]


def test_vllm_sampling_extras(server):
    """bad_words keeps a word out of the answer, include_stop_str_in_output keeps the stop string in it,
    allowed_token_ids holds the answer to a few tokens."""
    from openai import BadRequestError

    client = openai_client(server)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=24,
                                           temperature=0).choices[0].message.content
    assert "Paris" in plain
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=24,
                                       temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].message.content
    for include, want in ((True, plain[:plain.index("Paris") + 5]), (False, plain[:plain.index("Paris")])):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=24,
                                           temperature=0, stop=["Paris"],
                                           extra_body={"include_stop_str_in_output": include})
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    yes_no = server_token_ids(server, [" Yes", " No"])
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Is Paris in France? Answer:",
                                  max_tokens=3, temperature=1.0, seed=3, extra_body={"allowed_token_ids": yes_no})
    assert r.choices[0].text.replace(" Yes", "").replace(" No", "") == ""
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="x", max_tokens=3,
                                  extra_body={"allowed_token_ids": [10**9]})
    assert e.value.body["param"] == "allowed_token_ids"


def server_token_ids(server, texts: list[str]) -> list[int]:
    import json
    import urllib.request

    ids = []
    for t in texts:
        req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"prompt": t, "add_special_tokens": False})
                                     .encode(), headers={"content-type": "application/json"})
        with urllib.request.urlopen(req) as r:
            (tid,) = json.loads(r.read())["tokens"]
            ids.append(tid)
    return ids


def test_a_regex_or_a_gbnf_grammar_holds_the_answer(server):
    """vLLM's ``structured_outputs`` regex and grammar (and ``guided_regex``), llama.cpp's ``grammar`` field;
    a grammar the engine cannot run is a 400 naming the field it came in."""
    import re

    from openai import BadRequestError

    client = openai_client(server)
    ask = [{"role": "user", "content": "When did the Berlin Wall fall? Give the date as YYYY-MM-DD."}]
    date = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    for extra in ({"structured_outputs": {"regex": date}}, {"guided_regex": date}):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=20,
                                           temperature=0, extra_body=extra)
        assert re.fullmatch(date, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    cities = 'root ::= city ("." | "!")?\ncity ::= "Paris" | "London" | "Berlin"  # one of three\n'
    ask = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    for extra in ({"grammar": cities}, {"structured_outputs": {"grammar": cities}}):
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=10,
                                                temperature=0, stream=True, extra_body=extra)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).rstrip(".!") == "Paris"
    for extra, param in (({"grammar": 'root ::= root "a" | "b"'}, "grammar"),
                         ({"structured_outputs": {"grammar": 'root ::= x'}}, "structured_outputs"),
                         ({"guided_regex": "(?<=a)b"}, "guided_regex")):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, max_tokens=5,
                                           extra_body=extra)
        assert e.value.body["param"] == param, e.value.body
        assert any(w in e.value.body["message"] for w in ("left recursive", "not defined", "lookarounds"))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}


def test_tool_calls_held_to_the_tools(server):
    """SmolLM2's template shows no tools, so "auto" has no format to read (400); "required" and a named
    function hold the output to calls of the given tools, which come back as tool_calls."""
    import json

    from openai import BadRequestError

    client = openai_client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, tools=[WEATHER])
    assert e.value.body["param"] == "tool_choice" and "--chat-template" in e.value.body["message"]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, tools=[WEATHER],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=ask, tools=[WEATHER], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather"  # the arguments stream as they come
    assert list(json.loads("".join(d.function.arguments for d in deltas))) == ["city"]
    counted = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}
    with pytest.raises(BadRequestError) as e:  # the engine's refusal, named by the field the schema came from
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask, tools=[counted],
                                       tool_choice="required")
    assert e.value.body["param"] == "tools" and "minimum" in e.value.body["message"]
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=ask,
                                       extra_body={"guided_json": counted["function"]["parameters"]})
    assert e.value.body["param"] == "guided_json" and e.value.body["message"].startswith("guided_json: ")


def test_responses_api(server):
    import json

    client = openai_client(server)
    r = client.responses.create(model="SmolLM2-135M-Instruct.Q4_1", input="What is the capital of France?",
                                max_output_tokens=24, temperature=0)
    assert "Paris" in r.output_text and r.status == "completed"
    weather = {"type": "function", **WEATHER["function"]}
    with client.responses.stream(model="SmolLM2-135M-Instruct.Q4_1", input="What is the weather in Paris?",
                                 tools=[weather], tool_choice="required", temperature=0) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and "Paris" in json.loads(call.arguments)["city"]


def test_engine_death_gives_503_and_nonzero_exit(server):
    from openai import APIError

    engine = server.pids("tokenmill-engine")[-1]
    client = openai_client(server)
    outcome: dict = {}

    def long_stream():  # in flight when the engine dies: must end, not hang
        try:
            stream = client.completions.create(model=client.models.list().data[0].id, prompt="Count: 1, 2,",
                                               max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                outcome.setdefault("first", True)
            outcome["ended"] = "normally"
        except APIError as e:
            outcome["ended"] = f"error: {e}"

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    wait_for(lambda: outcome.get("first"), 60, "the stream to start")
    os.kill(engine, signal.SIGKILL)
    seen = wait_for(lambda: http_status(server.url + "/health", timeout=2) == 503, 5,
                    "/health to answer 503", interval=0.01)
    assert seen
    t.join(15)
    assert not t.is_alive(), "the in-flight request hangs"
    assert outcome["ended"].startswith("error"), outcome  # an SSE error event, not a silent end
    rc = server.proc.wait(60)
    assert rc != 0
    time.sleep(0.2)
    assert not any(pid_alive(pid) for pid in server.pids("tokenmill-frontend-0"))
    assert not os.path.exists(server.runtime_dir)
