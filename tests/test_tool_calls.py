"""Tool calling (``frontends.tools``) and thinking split off (``frontends.reasoning``): the request's
tools checked, the call formats detected from chat templates, calls and thinking read out of text
however it is split into stream pieces, and a real frontend process (on the fake engine, which
answers with the prompt's own tokens, so the model "writes" what the test puts in the message)
answering the official ``openai`` client, plain and streamed, and over the WebSocket. The real
engine holding output to tool calls: ``test_server_default_model``."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from frontends import reasoning
from frontends.errors import ApiError
from frontends.tools import CallReader, detect_format, no_format, parse_tools, shows_tools
from tests.test_frontend_openai import post
from tools.fake_engine import KEY, MODEL, fake_stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
HERMES_TEMPLATE = (  # what matters here of Qwen3's template: tools shown, thinking known, the prompt as it is
    "{%- if tools %}{# a model that answers <tool_call>{...}</tool_call> #}{%- endif %}{# and thinks: </think> #}"
    "{%- if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{%- endif %}"  # (gpt-oss's: "Reasoning: ")
    "{{ messages[-1]['content'] }}{%- if open_think is defined and open_think %}<think>\n{%- endif %}")
LLAMA3_TEMPLATE = "{%- if tools %}{# Environment: ipython; <|python_tag|> #}{%- endif %}{{ messages[-1]['content'] }}"
MISTRAL_TEMPLATE = (  # what matters here of Mistral's: tools shown in [AVAILABLE_TOOLS], calls after [TOOL_CALLS]
    "{%- if tools %}{# [AVAILABLE_TOOLS] the tools [/AVAILABLE_TOOLS]; answers [TOOL_CALLS][...] #}{%- endif %}"
    "{%- for m in messages %}{%- for c in m.tool_calls or [] %}{%- if c.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{%- endfor %}{%- endfor %}{{ messages[-1]['content'] }}")
SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                    "+ '<|im_end|>' + '\n'}}{% endfor %}")


QWEN25_TEMPLATE = (  # Qwen2.5-Instruct's, as it ships
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the "
    "user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each "
    "function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' "
    "+ messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == \"assistant\" %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = "
    "tool_call.function %}{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or "
    "(messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def nested(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def read_all(req, pieces: list[str]) -> tuple[str, list[dict], CallReader]:
    """Feed ``pieces`` to a reader, then finish: (content sent, tool-call deltas sent, the reader)."""
    reader = req.reader()
    segments = [s for p in pieces for s in reader.feed(p)] + reader.finish()
    assert reader.content == "".join(v for k, v in segments if k == "text")
    return "".join(v for k, v in segments if k == "text"), [v for k, v in segments if k == "call"], reader


def splits(text: str) -> list[list[str]]:
    """Whole, one character a piece, and three pieces at every pair of cut points 7 apart."""
    return [[text], list(text)] + [[text[:i], text[i:i + 7], text[i + 7:]] for i in range(len(text))]


def hermes(fmt="hermes", **extra):
    return parse_tools({"tools": TOOLS, **extra}, fmt)


def args_of(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


# ---------------------------------------------------------------------------- what a request may ask


@pytest.mark.parametrize("body,param,words", [
    ({"functions": [WEATHER["function"]], "tools": TOOLS}, "functions", "not both"),
    ({"function_call": "auto"}, "function_call", "needs 'functions'"),
    ({"functions": {}}, "functions", "a list of 1 to 128"),
    ({"functions": ["f"]}, "functions", "functions[0] must be {'name'"),
    ({"functions": [{"name": "a b"}]}, "functions", "functions[0].name must be 1 to 64 letters"),
    ({"functions": [{"name": "f", "parameters": {"type": "array"}}]}, "functions",
     "functions[0].parameters must be a JSON schema of type 'object'"),
    ({"functions": [{"name": "f"}, {"name": "f"}]}, "functions", "two functions are named 'f'"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call", "no function of 'functions': 'g'"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call", "'none', 'auto' or {'name'"),
])
def test_the_deprecated_functions_are_checked_as_tools_under_their_names(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_tools(body, "hermes")
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_the_deprecated_functions_are_one_call_tools():
    fns = [WEATHER["function"], TIME["function"]]
    req = parse_tools({"functions": fns}, "hermes")
    assert (req.mode, req.parallel, req.legacy, req.tools) == ("auto", False, True, TOOLS)
    named = parse_tools({"functions": fns, "function_call": {"name": "get_time"}}, None)
    assert (named.mode, named.name) == ("named", "get_time")
    assert parse_tools({"functions": fns, "function_call": "none"}, None).mode == "none"
    assert parse_tools({"function_call": "none"}, None) is None
    with pytest.raises(ApiError) as e:
        parse_tools({"functions": fns}, None)  # (as tool_choice "auto" does, named as the request named it)
    assert e.value.param == "function_call" and e.value.message.startswith(
        "function_call 'auto' (the default with functions) needs a tool-call format") and "tool_choice" not in str(e.value)
    assert not parse_tools({"tools": TOOLS}, "hermes").legacy


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": []}, "tools", "1 to 128"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]}, "tools",
     "tools[0].function.parameters must be a JSON schema of type 'object' (a call's arguments are an object), got "
     "of type 'integer'"),  # (its calls' arguments were the integer: no client could dispatch them)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "integer"}]}}}]},
     "tools", "must be a JSON schema of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/I", "$defs": {"I": {"type": "integer"}}}}}]}, "tools", "must be a JSON schema of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"items": {}}}}]}, "tools", "'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{}]}}}]}, "tools", "'object'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["x"]}}}, "tool_choice",
     "needs function.name, a string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "needs function.name"),  # (not "None": AA)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": nested(300)}}}]},
     "tools", "nests too deeply"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls", "true or false"),  # (without tools too: review)
    ({"parallel_tool_calls": 0}, "parallel_tool_calls", "true or false"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(17)], "tool_choice": "required"},
     "tools", "at most 16"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_tools(body, "hermes")
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_a_null_parallel_tool_calls_is_the_default():
    assert parse_tools({"tools": TOOLS, "parallel_tool_calls": None}, "hermes").parallel
    assert parse_tools({"parallel_tool_calls": None}, "hermes") is None


def test_a_tools_calls_are_held_to_an_object():
    """Parameters with no type are an object's (``{}`` would hold a named call to any JSON value); a local
    ``$ref`` to an object's schema (pydantic's recursive models) and alternatives of objects pass as they are."""
    def named(params):
        return parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                            "tool_choice": {"type": "function", "function": {"name": "f"}}}, "hermes").schema()
    assert named({}) == {"type": "object"}
    assert named({"properties": {"a": {"type": "string"}}}) == {"properties": {"a": {"type": "string"}}, "type": "object"}
    node = {"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}}}
    assert named(node) == node
    union = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert named(union) == union


def test_auto_needs_a_format_the_others_do_not():
    shows_none, shows_some = "{{ messages }}", "{% for t in tools %}{{ t }}{% endfor %}{{ messages }}"
    with pytest.raises(ApiError, match="--tool-call-parser") as e:  # (a template that shows tools its own way)
        parse_tools({"tools": TOOLS}, None, no_format(shows_some, "auto"))
    assert e.value.param == "tool_choice"
    with pytest.raises(ApiError, match=r"shows no tools: start the server with a template that does \(--chat-templ"):
        parse_tools({"tools": TOOLS}, None, no_format(shows_none, "auto"))  # (a parser alone would not show them)
    with pytest.raises(ApiError, match=r"reads none \(--tool-call-parser none\): use tool_choice 'required'"):
        parse_tools({"tools": TOOLS}, None, no_format(shows_some, "none"))
    assert shows_tools(shows_some) and not shows_tools(shows_none) and not shows_tools(None)
    assert parse_tools({"tools": TOOLS, "tool_choice": "required"}, None).schema()["minItems"] == 1
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, None).schema() is None
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, None)
    assert named.schema() == TIME["function"]["parameters"]
    assert parse_tools({}, None) is None and parse_tools({"tool_choice": "none"}, None) is None


def test_required_holds_the_output_to_calls_of_the_given_tools():
    schema = hermes(tool_choice="required", parallel_tool_calls=False).schema()
    assert schema["maxItems"] == 1 and [a["properties"]["name"] for a in schema["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]


def test_required_keeps_each_tools_own_definitions_and_refs():
    """A tool's ``$defs`` and ``$ref``s (pydantic's ``model_json_schema()``), ``#`` among them, read as they did at its
    own root once its parameters sit in "required"'s array of calls (review: "'$ref' '#/$defs/Unit' is not
    supported", where a named tool_choice took the same schema)."""
    from tests.test_structured_output import accepts

    unit = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"]}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
                                             "Unit": {"const": {"$ref": "#/$defs/Unit"}}}, "required": ["kids"]}
    # (review: properties named as data keywords hold schemas; one name in $defs and definitions is two)
    odd = {"type": "object", "properties": {"default": {"$ref": "#/$defs/N"}, "enum": {"$ref": "#/definitions/N"}},
           "$defs": {"N": {"type": "integer"}}, "definitions": {"N": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("temp", unit), ("tree", tree), ("time", TIME["function"]["parameters"]), ("odd", odd))]
    schema = parse_tools({"tools": tools, "tool_choice": "required"}, None).schema()
    assert set(schema["$defs"]) == {"tool0", "tool0_defs_Unit", "tool1", "tool3", "tool3_defs_N",
                                    "tool3_definitions_N"}  # (the third tool refers to nothing: as it was)
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == TIME["function"]["parameters"]
    assert schema["$defs"]["tool1"]["properties"]["Unit"] == tree["properties"]["Unit"]  # (a const is data)
    assert accepts(schema, '[{"name": "temp", "parameters": {"unit": "f"}}]')
    assert not accepts(schema, '[{"name": "temp", "parameters": {"unit": "k"}}]')
    assert accepts(schema, '[{"name": "tree", "parameters": {"kids": [{"kids": []}], "Unit":{"$ref":"#/$defs/Unit"}}}]')
    assert not accepts(schema, '[{"name": "tree", "parameters": {"kids": [{"unit": "f"}]}}]')
    assert accepts(schema, '[{"name": "odd", "parameters": {"default": 1, "enum": "x"}}]')
    assert not accepts(schema, '[{"name": "odd", "parameters": {"default": "x"}}]')
    assert parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "temp"}}},
                       None).schema() == unit


def test_formats_are_read_off_chat_templates():
    assert detect_format(HERMES_TEMPLATE) == detect_format(QWEN25_TEMPLATE) == "hermes"
    assert detect_format(MISTRAL_TEMPLATE) == "mistral"
    assert detect_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_format(SMOLLM2_TEMPLATE) is None and detect_format(None) is None


def test_templates_see_the_tools_and_the_calls_as_transformers_shows_them(tmp_path, smollm_tokenizer_dir):
    """The frontend's own template renderer (``CachedTokenizer``) and transformers print the same
    prompt for a conversation with tools, a call (its arguments an object) and the call's result."""
    from transformers import AutoTokenizer

    from frontends.openai_params import parse_messages
    from frontends.text import TextCodec
    from frontends.tokenizer import CachedTokenizer

    shutil.copytree(smollm_tokenizer_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    messages = parse_messages({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]})
    req = hermes()
    hf, cached = TextCodec(AutoTokenizer.from_pretrained(tmp_path)), TextCodec(CachedTokenizer(str(tmp_path)))
    assert cached.chat_template == hf.chat_template == QWEN25_TEMPLATE
    want = hf.apply_chat_template(messages, True, req.tools)
    assert cached.apply_chat_template(messages, True, req.tools) == want
    text = hf.decode(want, skip_special_tokens=False)
    assert json.dumps(WEATHER, ensure_ascii=False) in text  # the tools, as tojson prints them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- reading calls out of text

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
HERMES_AROUND = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> <tool_call>"}}\n'
                 '</tool_call>\n and then some words.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("pieces", splits(HERMES_TWO), ids=lambda p: str(len(p)))
def test_hermes_calls_are_read_however_the_text_is_split(pieces):
    content, deltas, reader = read_all(hermes(), pieces)
    assert content == reader.content == "Let me look.\n"
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]
    assert [args_of(d) for d in deltas] == [{"city": "Paris"}, {"zone": "CET"}]
    assert reader.calls == [{k: v for k, v in d.items() if k != "index"} for d in deltas]
    assert len({d["id"] for d in deltas}) == 2 and all(d["id"].startswith("call_") for d in deltas)


@pytest.mark.parametrize("pieces", splits(HERMES_AROUND), ids=lambda p: str(len(p)))
def test_hermes_words_after_a_call_keep_their_spaces_and_tags_in_strings_are_text(pieces):
    content, deltas, _ = read_all(hermes(), pieces)
    assert content == "\n and then some words.\n"  # only blanks between calls (or after the last) are dropped
    assert [(d["function"]["name"], args_of(d)) for d in deltas] == [
        ("get_weather", {"city": "</tool_call> <tool_call>"}), ("get_time", {})]


def test_hermes_text_that_is_no_call_stays_content():
    for text in ("No tools needed: 2 < 3 and <tool> is not a tag.", "<tool_call>\n{not json}\n</tool_call>",
                 '<tool_call>{"name": "get_weather"}</tool_call>', "Almost <tool_ca"):
        content, deltas, reader = read_all(hermes(), list(text))
        assert (content, deltas, reader.calls) == (text, [], [])


def test_only_calls_that_can_be_dispatched_are_calls():
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
                 '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',  # not a name
                 '<tool_call>{"name": "get_time", "arguments": {"zone": NaN}}</tool_call>',  # not JSON
                 '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>'):  # not an object
        assert read_all(hermes(), [text])[:2] == (text, [])


def test_arguments_are_json_any_client_reads_back():
    for text in ('<tool_call>{"name": "get_time", "arguments": {"zone": 1e400}}</tool_call>',  # overflows
                 '<tool_call>{"name": "get_time", "arguments": {"zone": "\\ud800"}}</tool_call>'):  # lone surrogate
        assert read_all(hermes(), [text])[:2] == (text, [])
    _, (call,), _ = read_all(hermes(), ['<tool_call>{"name": "get_time", "arguments": {"zone": "Z\\u00fcrich", '
                                        '"n": 123456789012345678901234567890}}</tool_call>'])
    assert args_of(call) == {"zone": "Zürich", "n": 123456789012345678901234567890}


def test_blanks_go_only_where_a_call_or_the_end_follows():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for text, content in ((f"\n\n{call}", ""),  # before the first call
                          (f"{call}\n\n{call}\n", ""),  # between calls, after the last
                          (f"{call}\n\n<tool_call>{{oops}}</tool_call>", "\n\n<tool_call>{oops}</tool_call>"),
                          ("\n\nJust words.", "\n\nJust words."), ("  ", "")):
        for pieces in ([text], list(text)):
            assert read_all(hermes(), pieces)[0] == content, (text, pieces)
    assert read_all(hermes(parallel_tool_calls=False), [f"{call}\n\n{call}"])[0] == f"\n\n{call}"


def test_a_call_with_many_closing_tags_in_its_strings_is_read_once():
    """Each </tool_call> inside a string is passed over without reading the call again from its start."""
    arg = "</tool_call>" * 3000
    text = f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{arg}"}}}}</tool_call> after'
    reader = hermes().reader()
    segments = [s for i in range(0, len(text), 5) for s in reader.feed(text[i:i + 5])] + reader.finish()
    assert [args_of(v) for k, v in segments if k == "call"] == [{"zone": arg}]
    assert "".join(v for k, v in segments if k == "text") == " after"


def test_a_malformed_call_ends_at_its_tag_and_what_follows_streams():
    reader = hermes().reader()
    assert reader.feed('Hi <tool_call>{"name": oops}</tool_call> more') == [
        ("text", "Hi "), ("text", '<tool_call>{"name": oops}</tool_call>'), ("text", " more")]


def test_hermes_a_call_the_model_left_open_is_still_read():
    content, deltas, _ = read_all(hermes(), ['<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'])
    assert content == "" and args_of(deltas[0]) == {"zone": "UTC"}


def test_hermes_without_parallel_calls_a_second_call_stays_content():
    content, deltas, _ = read_all(hermes(parallel_tool_calls=False), [HERMES_TWO])
    assert [d["function"]["name"] for d in deltas] == ["get_weather"]
    assert content.startswith("Let me look.\n") and '<tool_call>{"name": "get_time"' in content.replace("\n", "")


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    (' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"zone": "X"}}',
     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "X"})]),
    ('{"name": "get_time", "arguments": {"zone": "X"}}', [("get_time", {"zone": "X"})]),
])
def test_llama3_json_calls(text, calls):
    for pieces in ([text], list(text)):
        content, deltas, _ = read_all(hermes("llama3_json"), pieces)
        assert content == "" and [(d["function"]["name"], args_of(d)) for d in deltas] == calls


def test_without_parallel_calls_llama3_json_keeps_the_first_call_and_the_rest_as_text():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, deltas, _ = read_all(hermes("llama3_json", parallel_tool_calls=False), [text])
    assert content == '{"name": "get_time", "parameters": {}}' and [d["function"]["name"] for d in deltas] == [
        "get_weather"]


def test_llama3_json_words_stream_as_they_come_and_odd_json_stays_content():
    reader = hermes("llama3_json").reader()
    assert reader.feed("  ") == []  # not yet known
    assert reader.feed("The answer") == [("text", "  The answer")]  # words: no call
    assert reader.feed(' {"name": "x"}') == [("text", ' {"name": "x"}')]
    assert read_all(hermes("llama3_json"), ['{"name": "get_time"}'])[:2] == ('{"name": "get_time"}', [])


MISTRAL_ARRAY = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {"zone": "X"}}]'
MISTRAL_ARGS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "X"}'


@pytest.mark.parametrize("text", [MISTRAL_ARRAY, MISTRAL_ARGS, "\n" + MISTRAL_ARGS + "\n"])
def test_mistral_calls_both_ways_however_the_text_is_split(text):
    """Mistral 7B v0.3 / Nemo / Small 3: [TOOL_CALLS] and an array; later tokenizers: name[ARGS]{...} a call."""
    for pieces in splits(text):
        content, deltas, _ = read_all(hermes("mistral"), pieces)
        assert content == "" and [(d["function"]["name"], args_of(d)) for d in deltas] == [
            ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "X"})], pieces


@pytest.mark.parametrize("text,content,calls", [
    # words first (Mistral Small 3.x, Devstral, Magistral write both in one answer)
    ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "Let me check.", [("get_weather", {"city": "Oslo"})]),
    # an id in the call (mistral-common's v11 tokenizer): not part of the name
    ('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "X"}', "", [("get_time", {"zone": "X"})]),
    # [TOOL_CALLS] inside an argument's string is the string's
    ('[TOOL_CALLS]get_time[ARGS]{"zone": "a[TOOL_CALLS]b"}[TOOL_CALLS]get_time[ARGS]{"zone": "Y"}', "",
     [("get_time", {"zone": "a[TOOL_CALLS]b"}), ("get_time", {"zone": "Y"})]),
    ('[TOOL_CALLS][{"name": "get_time"}]', "", [("get_time", {})]),  # no arguments: none (vLLM's reading)
])
def test_mistral_words_before_calls_ids_in_them_and_odd_strings(text, content, calls):
    for pieces in splits(text):
        got, deltas, _ = read_all(hermes("mistral"), pieces)
        assert got == content and [(d["function"]["name"], args_of(d)) for d in deltas] == calls, pieces
        assert all(len(d["id"]) == 9 and d["id"].isalnum() for d in deltas)  # the ids Mistral's templates take


def test_mistral_words_stream_and_what_is_no_call_stays_content():
    reader = hermes("mistral").reader()
    assert reader.feed(" [TOOL") == []  # perhaps a call
    assert reader.feed("S] are") == [("text", " [TOOLS] are")]  # no: words, streamed from here on
    assert reader.feed(" fine") == [("text", " fine")]
    for odd in ('[TOOL_CALLS][{"name": "nope", "arguments": {}}]', '[TOOL_CALLS]get_time[ARGS]{"zone": "X"',
                "[TOOL_CALLS]get_time", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] and words'):
        assert read_all(hermes("mistral"), [odd])[:2] == (odd, []), odd
    assert read_all(hermes("mistral"), ["Hi.[TOOL_CALLS]x"])[:2] == ("Hi.[TOOL_CALLS]x", [])
    content, deltas, _ = read_all(hermes("mistral", parallel_tool_calls=False), [MISTRAL_ARGS])
    assert content == '[TOOL_CALLS]get_time[ARGS]{"zone": "X"}' and [d["function"]["name"] for d in deltas] == [
        "get_weather"]
    content, deltas, _ = read_all(hermes("mistral", parallel_tool_calls=False), [MISTRAL_ARRAY])
    assert json.loads(content.removeprefix("[TOOL_CALLS]")) == [{"name": "get_time", "arguments": {"zone": "X"}}]
    assert hermes("mistral").keeps_special_tokens and not hermes("mistral", tool_choice="required").keeps_special_tokens


def test_required_and_named_outputs():
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    content, deltas, reader = read_all(hermes(tool_choice="required"), list(text))
    assert content == "" and [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_time"), (1, "get_weather")]
    assert read_all(hermes(tool_choice="required"), ['[{"name": "get_ti'])[:2] == ('[{"name": "get_ti', [])  # cut short
    # cut short after a whole name, before its parameters: that call, its arguments none yet (its JSON was the
    # content: review)
    for cut in ('[{\n    "name": "get_weather"\n,"', '[{"name": "get_weather"', '[{"name": "get_weather", "param'):
        content, deltas, _ = read_all(hermes(tool_choice="required"), [cut])
        assert content == "" and [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
            ("get_weather", "")], cut
    assert read_all(hermes(tool_choice="required"), ['[{"name": "get_weather", "x": 1'])[1] == []  # (no such key)
    # cut short in a call's parameters (max_tokens): the whole calls, then that one with its arguments so far
    content, deltas, _ = read_all(hermes(tool_choice="required"), [text[:text.index("Rome") + 1]])
    assert content == "" and [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        ("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "R')]
    content, deltas, _ = read_all(hermes(tool_choice="required"), [text[:58]])  # (in the second one's name)
    assert content == "" and [d["function"]["name"] for d in deltas] == ["get_time"]
    assert read_all(hermes(tool_choice="required"), [text + " [1]"])[:2] == (text + " [1]", [])  # more than the array
    odd = '[{"name": {"a": 1}, "parameters": {}}]'  # a name that is no string (not even hashable)
    assert read_all(hermes(tool_choice="required"), [odd])[:2] == (odd, [])
    named = hermes(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, deltas, reader = read_all(named, ['{"city"', ': "Rome"}'])
    assert content == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert deltas[1] == {"index": 0, "function": {"arguments": ': "Rome"}'}}  # streamed as they come
    assert reader.calls == [{"id": deltas[0]["id"], "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    named = hermes(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, deltas, reader = read_all(named, [" ", " \n", '{"city": "Rome"}'])  # (a space the grammar let come first)
    assert deltas[0]["function"]["arguments"] == reader.calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    content, deltas, reader = read_all(hermes(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                                       ["\t"])  # (cut short before its "{": the call, as before, with no arguments)
    assert content == "" and reader.calls[0]["function"] == deltas[0]["function"] == {"name": "get_weather",
                                                                                      "arguments": ""}
    assert read_all(hermes(tool_choice="none"), [HERMES_TWO])[:2] == (HERMES_TWO, [])


# ---------------------------------------------------------------------------- a real frontend process


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir):
    """The fake engine (it answers a prompt with its own tokens) behind a frontend whose chat template
    (``--chat-template``) teaches the hermes format and renders the last message as it is."""
    with fake_stack(str(tmp_path_factory.mktemp("eng")), smollm_tokenizer_dir, chat_template=HERMES_TEMPLATE) as stack:
        yield stack


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack[1]}/v1", api_key=KEY, max_retries=0)


ANSWER = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call><|im_end|>')  # <|im_end|> (id 2): the fake engine's stop token here, as EOS would be


def ask(client, content=ANSWER, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          tools=TOOLS, max_tokens=200, extra_body={"stop_token_ids": [2]}, **kw)


def test_served_calls_come_back_as_tool_calls(client):
    r = ask(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    r = ask(client, "Just words.<|im_end|>")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Just words."
    assert not r.choices[0].message.tool_calls
    r = ask(client, tool_choice="none")  # the tools are shown, no call is read
    assert r.choices[0].message.content == ANSWER.removesuffix("<|im_end|>") and not r.choices[0].message.tool_calls


def test_served_calls_stream_as_tool_call_deltas(client):
    content, calls, finish = "", {}, None
    for chunk in ask(client, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert content == "Checking." and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_the_deprecated_functions_are_answered_as_a_function_call(client):
    """OpenAI's ``functions``: the call comes back as the message's ``function_call`` (no id, one call), plain and
    streamed, finish_reason "function_call"; a conversation carries an assistant's ``function_call`` and a
    ``function`` message's result to the template as a tool call and its result."""
    fns = [WEATHER["function"], TIME["function"]]
    two = ANSWER.replace("<|im_end|>", '<tool_call>{"name": "get_time", "arguments": {"zone": "Z"}}</tool_call><|im_end|>')
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": two}], functions=fns,
                                       max_tokens=200, extra_body={"stop_token_ids": [2]})
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls
    assert choice.message.function_call.name == "get_weather"  # (the second call stays text: one call an answer)
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.content.startswith("Checking.") and "get_time" in choice.message.content
    content, name, arguments, finish = "", "", "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ANSWER}],
                                                functions=fns, max_tokens=200, stream=True,
                                                extra_body={"stop_token_ids": [2]}):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            content += c.delta.content or ""
            if c.delta.function_call:
                name += c.delta.function_call.name or ""
                arguments += c.delta.function_call.arguments or ""
            finish = c.finish_reason or finish
    assert (content, name, finish) == ("Checking.", "get_weather", "function_call")
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ANSWER}], functions=fns,
                                       function_call="none", max_tokens=200, extra_body={"stop_token_ids": [2]})
    assert r.choices[0].message.content == ANSWER.removesuffix("<|im_end|>") and not r.choices[0].message.function_call
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"role": "function", "name": "get_weather", "content": "Sunny, 21 C<|im_end|>"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, functions=fns, max_tokens=50,
                                       extra_body={"stop_token_ids": [2]})
    assert r.choices[0].message.content == "Sunny, 21 C" and r.choices[0].finish_reason == "stop"
    for bad, words in (({**messages[1], "function_call": {"name": "get_weather", "arguments": "{oops"}},
                        "messages[1].function_call.arguments is not JSON text"),
                       ({**messages[1], "function_call": "get_weather"}, "messages[1].function_call must be"),
                       ({**messages[2], "name": None}, "messages[1].name must be a string")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[messages[0], bad], functions=fns)
        assert e.value.body["param"] == "messages" and words in e.value.body["message"], words
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, functions=fns, tools=TOOLS)
    assert e.value.body["param"] == "functions"


def test_the_deprecated_functions_refusals_name_what_the_request_sent(client, stack):
    """The second review: refusals made after the functions become tools name the functions (not the tools the
    client never sent); a function message needs the functions; an assistant message has tool_calls or a
    function_call; /tokenize shows the functions as the chat does; parallel_tool_calls is still checked."""
    fns = [WEATHER["function"]]
    hi = [{"role": "user", "content": "hi"}]
    named = {"name": "get_weather"}
    for kw, param in (({"function_call": named, "response_format": {"type": "json_object"}}, "response_format"),
                      ({"function_call": named, "n": 2, "extra_body": {"use_beam_search": True}}, "function_call"),
                      ({"parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=hi, functions=fns, max_tokens=2, **kw)
        assert e.value.body["param"] == param and "tool_choice" not in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # (both eras: named as sent, review)
        client.chat.completions.create(model=MODEL, messages=hi, functions=fns, tool_choice="required", max_tokens=2)
    assert e.value.body["message"].startswith("give 'tools' (and tool_choice) or the deprecated 'functions'")
    function_msg = {"role": "function", "name": "get_weather", "content": "Sunny"}
    with pytest.raises(openai.BadRequestError) as e:  # (without functions: a role of the chat's alone)
        client.chat.completions.create(model=MODEL, messages=[*hi, function_msg], max_tokens=2)
    assert "role must be one of system, developer, user, assistant, tool, got 'function'" in e.value.body["message"]
    both = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{bad"},
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[*hi, both], functions=fns, max_tokens=2)
    assert "tool_calls and a function_call" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # (the Responses API has no function role either)
        client.responses.create(model=MODEL, input=[{"role": "function", "name": "f", "content": "x"}])
    assert "tool, got 'function'" in e.value.body["message"]
    counted = [post(stack[1], "/tokenize", {"messages": hi, **extra}).json()["count"]
               for extra in ({"functions": fns}, {"tools": [WEATHER]})]
    assert counted[0] == counted[1]  # (the functions read as the tools: refused alike where bad)
    bad = post(stack[1], "/tokenize", {"messages": hi, "functions": [{"name": "a b"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "functions"


def test_a_conversation_carries_calls_and_their_results(client):
    """An assistant's tool_calls (arguments as JSON text) and the tool's answer go to the template."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C<|im_end|>"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=50,
                                       extra_body={"stop_token_ids": [2]})
    assert r.choices[0].message.content == "Sunny, 21 C"
    bad = [messages[0], {**messages[1], "tool_calls": [{"type": "function",
                                                        "function": {"name": "x", "arguments": "{oops"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=bad, tools=TOOLS)
    assert e.value.body["param"] == "messages" and "not JSON text" in e.value.body["message"]


def test_served_bad_tools_get_400(client):
    hi = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for kw, param in (({"tools": [WEATHER, WEATHER]}, "tools"),
                      ({"tools": TOOLS, "tool_choice": named, "extra_body": {"guided_json": {}}}, "guided_json"),
                      ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "response_format"),
                      ({"messages": [*hi, {"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages"),
                      ({"messages": [*hi, {"role": "assistant", "tool_calls": [{"id": {"x": 1}, "type": "function",
                                    "function": {"name": "f", "arguments": "{}"}}]}]}, "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, **{"messages": hi, **kw})
        assert e.value.body["param"] == param, kw
    r = client.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS, tool_choice="required", max_tokens=3,
                                       response_format={"type": "text"})  # text is no structured output
    assert r.choices[0].finish_reason == "length"
    assert ask(client).choices[0].finish_reason == "tool_calls"  # and the server goes on


def test_websocket_done_carries_the_calls(stack):
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{stack[1]}/v1/stream", additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "chat", "id": "t", "messages": [{"role": "user", "content": ANSWER}],
                            "tools": TOOLS, "max_tokens": 200, "stop_token_ids": [2]}))
        text = ""
        while (msg := json.loads(ws.recv()))["type"] == "delta":
            text += msg["text"]
    assert msg["type"] == "done" and msg["finish_reason"] == "tool_calls"
    assert text == ANSWER.removesuffix("<|im_end|>")  # the deltas are the raw text, done the message in it
    assert msg["message"]["content"] == "Checking." and [
        (c["function"]["name"], args_of(c)) for c in msg["message"]["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_served_mistral_calls_keep_special_tokens_but_not_the_one_that_ends(tmp_path_factory, smollm_tokenizer_dir):
    """A Mistral template: its chats with tools are decoded with their special tokens ([TOOL_CALLS] is
    one in Mistral's vocabulary; here <|im_start|> stands in), all but the stop token that ends the
    answer; ``skip_special_tokens`` (vLLM's field) asks the same of any call."""
    with fake_stack(str(tmp_path_factory.mktemp("eng")), smollm_tokenizer_dir,
                    chat_template=MISTRAL_TEMPLATE) as (_, port, *_rest):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = ask(client, MISTRAL_ARGS + "<|im_end|>")
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
            ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "X"})]
        (first, _) = r.choices[0].message.tool_calls  # the ids go back, as Mistral's template takes them
        history = [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "tool_calls": [first.model_dump()]},
                   {"role": "tool", "tool_call_id": first.id, "content": "sunny"},
                   {"role": "user", "content": "Thanks.<|im_end|>"}]
        r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20,
                                           extra_body={"stop_token_ids": [2]})
        assert r.choices[0].message.content == "Thanks."
        r = ask(client, "Hi<|im_start|>there<|im_end|>")
        assert r.choices[0].message.content == "Hi<|im_start|>there"  # kept; the stop token is not
        r = ask(client, "Hi<|im_start|>there<|im_end|>", tool_choice="none")
        assert r.choices[0].message.content == "Hithere"  # no call read: decoded as usual
        words = {"model": MODEL, "prompt": "Hi<|im_start|>there<|im_end|>", "max_tokens": 20,
                 "extra_body": {"stop_token_ids": [2]}}
        assert client.completions.create(**words).choices[0].text == "Hithere"
        words["extra_body"]["skip_special_tokens"] = False
        assert client.completions.create(**words).choices[0].text == "Hi<|im_start|>there"
        echoed = client.completions.create(**words, echo=True).choices[0].text  # the prompt kept alike
        assert echoed == "Hi<|im_start|>there<|im_end|>Hi<|im_start|>there"
        for careless in ("no", 0):  # a careless client's value is a 400 naming the field (null: the default)
            words["extra_body"]["skip_special_tokens"] = careless
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(**words)
            assert e.value.body["param"] == "skip_special_tokens"


# ---------------------------------------------------------------------------- thinking


def split_all(thinking: bool, pieces: list[str]) -> tuple[str, str]:
    s = reasoning.ThinkSplitter(thinking)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello! <think> stays."


@pytest.mark.parametrize("pieces", splits(THOUGHT), ids=lambda p: str(len(p)))
def test_thinking_is_split_off_however_the_text_is_split(pieces):
    assert split_all(False, pieces) == ("\nThe user greets me.\n", "Hello! <think> stays.")


@pytest.mark.parametrize("thinking,text,want", [
    (False, "Just an answer.", ("", "Just an answer.")),
    (False, "  <thi", ("", "  <thi")),  # the tag's start, then the end: content
    (False, "<think>cut by max_tokens", ("cut by max_tokens", "")),
    (True, "R1 opened it in the prompt</think>\n\nAnswer.", ("R1 opened it in the prompt", "Answer.")),
    (True, "never closed", ("never closed", "")),
    (False, "<think></think>\n\n", ("", "")),
])
def test_thinking_edges(thinking, text, want):
    assert split_all(thinking, [text]) == split_all(thinking, list(text)) == want


def test_thinking_is_known_from_templates_and_prompts():
    assert reasoning.detect(HERMES_TEMPLATE) and not reasoning.detect(SMOLLM2_TEMPLATE)
    assert reasoning.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opens_thinking("<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking false


def test_served_thinking_goes_to_reasoning_content(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": THOUGHT + "<|im_end|>"}],
                                       max_tokens=100, extra_body={"stop_token_ids": [2]})
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("\nThe user greets me.\n", "Hello! <think> stays.")
    thought, content = "", ""
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": THOUGHT + "<|im_end|>"}], max_tokens=100,
            stream=True, extra_body={"stop_token_ids": [2]}):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (thought, content) == (msg.reasoning_content, msg.content)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": THOUGHT + "<|im_end|>"}],
                                       max_tokens=100, extra_body={"stop_token_ids": [2], "include_reasoning": False})
    assert r.choices[0].message.content == msg.content and not getattr(r.choices[0].message, "reasoning_content", None)


def test_served_thinking_opened_by_the_prompt_then_a_call(client):
    """chat_template_kwargs reach the template: here it opens <think> at the end of the prompt, as
    DeepSeek-R1's does; the answer after the thinking is a tool call."""
    text = 'I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], tools=TOOLS,
                                       max_tokens=100, extra_body={"stop_token_ids": [2],
                                                                   "chat_template_kwargs": {"open_think": True}})
    choice = r.choices[0]
    assert choice.message.reasoning_content == "I need the weather." and choice.message.content is None
    assert choice.finish_reason == "tool_calls" and args_of(choice.message.tool_calls[0].model_dump()) == {"city": "Oslo"}
    for bad in ({"tools": []}, {"x": nested(300)}, {"not an identifier": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_template(client):
    """OpenAI's ``reasoning_effort`` is the chat template's variable of that name (gpt-oss's writes it in its system
    message), unless ``chat_template_kwargs`` sets it, as in vLLM; the Responses API's ``reasoning.effort`` too, and
    its ``truncation`` is written back as it came (review: both efforts were dropped, "auto" answered "disabled")."""
    def said(extra=None, **kw):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi.<|im_end|>"}],
                                              max_tokens=50, extra_body={"stop_token_ids": [2], **(extra or {})},
                                              **kw).choices[0].message.content
    assert said() == "Hi."
    assert said(reasoning_effort="high") == "[effort: high]Hi."
    assert said({"chat_template_kwargs": {"reasoning_effort": "low"}}, reasoning_effort="high") == "[effort: low]Hi."
    with pytest.raises(openai.BadRequestError) as e:
        said(reasoning_effort="max")
    assert e.value.body["param"] == "reasoning_effort"
    r = client.responses.create(model=MODEL, input="Hi.<|im_end|>", reasoning={"effort": "minimal"}, truncation="auto",
                                max_output_tokens=50, extra_body={"stop_token_ids": [2]})
    assert r.output_text == "[effort: minimal]Hi." and r.reasoning.effort == "minimal" and r.truncation == "auto"
    for bad, param in (({"reasoning": {"effort": "max"}}, "reasoning"), ({"truncation": "middle"}, "truncation")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="Hi.", max_output_tokens=5, **bad)
        assert e.value.body["param"] == param


def test_stop_strings_do_not_cut_calls_held_to_the_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": '{"city": "Rome"}<|im_end|>'}],
                                       tools=TOOLS, max_tokens=100, stop=["city"], extra_body={"stop_token_ids": [2]},
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "stop" and args_of(r.choices[0].message.tool_calls[0].model_dump()) == {
        "city": "Rome"}


def test_held_output_has_no_thinking_to_split(client):
    """Output held to a schema (here a named tool's) cannot think: nothing is taken for reasoning."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": '{"city": "Rome"}'}],
                                       tools=TOOLS, max_tokens=100, extra_body={"chat_template_kwargs": {"open_think": True}},
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not getattr(r.choices[0].message, "reasoning_content", None)


def test_a_chat_template_given_at_start_replaces_the_models(tmp_path, smollm_tokenizer_dir):
    """``--chat-template`` (a file or the text): it renders the prompts, and it is what tool formats are
    read off (here Mistral's, on a model whose own template shows no tools)."""
    from engine.cli import chat_template

    path = tmp_path / "mistral.jinja"
    path.write_text(MISTRAL_TEMPLATE)
    assert chat_template(str(path)) == chat_template(MISTRAL_TEMPLATE) == MISTRAL_TEMPLATE
    assert chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a template Jinja can read"):
        chat_template("{% for m in messages %}")
    with fake_stack(str(tmp_path), smollm_tokenizer_dir, chat_template=MISTRAL_TEMPLATE) as (_, port, *_rest):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        r = ask(client, MISTRAL_ARGS + "<|im_end|>")  # SmolLM2's template would wrap it in <|im_start|>user
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 2
