"""Structured output: schemas compiled or refused by name, the byte automaton, masks equal to
feeding every token by hand, random walks under the mask that always end in valid JSON, token
bytes read from tokenizer.json and GGUF alike, and the engine holding a model to a schema."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine.grammar import Grammar
from engine.json_schema import SchemaError, compile_schema
from engine.structured import GrammarMatcher, TokenGrammar, TokenVocab
from engine.token_bytes import token_bytes

EOS = 0
# a small byte-level vocabulary: every byte, and pieces of JSON a real one has
PIECES = [None] + [bytes([b]) for b in range(256)] + [p.encode() for p in (
    '{"', '":', '": ', '", "', '",', '"}', '"]', '}}', '}\n', '\n  ', '\n    ', '  ', ' "', 'name', 'age', 'true',
    'false', 'null', 'nul', '12', '345', '0.5', '-1', 'e+', 'abc', 'abc"', '\\"', '\\u00e9', 'é', '"é', '[{', '}]',
    '["', ', ', ',"', '""', '{}', '[]', ' {', '{\n', 'tr', 'ue', '"name', '"age', '"x"', '"y"', ' "name": "')]
TINY = TokenVocab(PIECES, len(PIECES) + 3, [EOS])  # (three ids past the pieces: padded logits)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age"],
}
TREE = {  # recursive, through $defs
    "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "number"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}},
    "$ref": "#/$defs/node",
}
SCHEMAS = [PERSON, TREE, {"type": "object"}, {}, {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 4},
                                                             {"type": "array", "minItems": 1, "maxItems": 2}]}]


class G(TokenGrammar):
    """A grammar's masks, with its own calls at hand."""

    start = property(lambda self: self.grammar.start)

    def feed(self, state: int, data: bytes) -> int:
        return self.grammar.feed(state, data)

    def accepting(self, state: int) -> bool:
        return self.grammar.accepting(state)


def grammar(schema, vocab=TINY) -> G:
    return G(Grammar(*compile_schema(schema)), vocab)


def accepts(schema, text: str) -> bool:
    g = grammar(schema)
    s = g.feed(g.start, text.encode())
    return s >= 0 and g.accepting(s)


@pytest.mark.parametrize("schema, good, bad", [
    (PERSON, ['{"name": "Bob", "age": 42}', ' {"name": "Bob", "age": 42}', '{\n  "name": "é",\n  "age": -0,\n  "tags": [],\n  "ok": null\n}',
              '{"name":"a\\"b\\u00e9","age":1,"ok":true}', '{"name": "12345678", "age": 0}'],
     ['{"age": 1, "name": "x"}', '{"name": "x"}', '{"name": "x", "age": 1,}', '{"name": "x", "age": 01}',
      '{"name": "123456789", "age": 1}', '{"name": "x", "age": 1.5}', '{"name": "a\nb", "age": 1}',
      '{"name": "x", "age": 1, "other": 2}', '{"name" : "x", "age": 1}', '{\n\n"name": "x", "age": 1}',
      '\n\n{"name": "x", "age": 1}', '{"name": "x", "age": 1, "tags": ["x", "y", "x", "y"]}',
      '\n{"name": "x", "age": 1}', '\t {"name": "x", "age": 1}']),  # (before the value: one space at most)
    (TREE, ['{"v": 1.5e+3, "kids": [{"v": -2}, {"v": 0, "kids": []}]}'],
     ['{"v": 1, "kids": [{"v": 1}, {"v": 2}, {"v": 3}]}', '{"kids": []}', '{"v": 1.}']),
    ({"type": "object"}, ['{}', '{"a": [1, {"b": null}], "c": "d"}'], ['[]', '{"a"}', '{"a": }']),
    ({}, ['"x"', '3', 'true', '[1, "a"]'], ['', 'tru', "'x'"]),
    ({"const": {"a": [1, 2]}}, ['{"a":[1,2]}'], ['{"a": [1, 2]}']),
    ({"type": "array", "items": {"enum": [1, 12, "a", None]}}, ['[1, 12, "a", null, 1]'], ['[2]', '[123]', '["b"]']),
    ({"enum": [1.0, 1.5, True], "type": "integer"}, ['1'], ['1.5', 'true', '1.0']),  # (1.0 is an integer: 1)
    ({"enum": [1.0, 1.5], "type": ["integer", "number"]}, ['1.0', '1.5'], ['1']),
    ({"enum": [f"option {i}" for i in range(3000)]}, ['"option 0"', '"option 2999"'], ['"option 3000"', '"option"']),
    ({"properties": {"a": {"type": "integer"}}, "additionalProperties": True},  # declared keys are not "additional"
     ['{"a": 1, "b": "x"}', '{"b": [1]}', '{}'], ['{"a": "x"}', '{"a": 1, "a": 2}', '{"b": 1, "a": 1}']),
    ({"type": "string", "maxLength": 1}, ['"\\ud83d\\ude00"', '"😀"', '"\\u00e9"'], ['"ab"', '"\\u00e9a"']),
    ({"type": "string", "minLength": 2}, ['"ab"', '"\\ud83d\\ude00a"'], ['"\\ud83d\\ude00"', '"😀"']),
    ({}, ['[\n' + ' ' * 20 + '1]', json.dumps([[[[[1]]]]], indent=4), '1' * 16, '0.' + '1' * 16 + 'e+12', '1E-99'],
     ['[\n\n1]', '[\n' + ' ' * 21 + '1]', '1' * 17, '1e123', '"\\ud83d\\ude0"']),
    ({"type": "string", "enum": ["a", 1]}, ['"a"'], ['1']),
    ({"type": "string", "pattern": "^\\d{3}-[a-zé]+$"},  # a pattern, its characters written raw or escaped
     ['"123-abc"', '"123-é"', '"123-\\u00e9"', '"\\u0031\\u0032\\u0033-a"'],
     ['"12-abc"', '"123-"', '"123-ABC"', '"123-\\u00c9"', '"123-a"x']),
    ({"pattern": "😀+"}, ['"😀"', '"\\ud83d\\ude00"', '"a😀b"'], ['"ab"', '"\\ud83d"']),  # unanchored: anywhere
    ({"pattern": 'a|\n\t"'}, ['"a"', '"\\n\\t\\""', '"x\\n\\t\\"y"'], ['"b"', '"\n\t""']),
    ({"format": "date-time"}, ['"2024-02-29T12:30:00Z"', '"2024-02-29T12:30:00.123+02:00"'],
     ['"2024-02-29 12:30"', '"2024-13-01T00:00:00Z"']),
    ({"type": "array", "items": {"format": "uuid"}}, ['["123e4567-e89b-12d3-a456-426614174000"]'], ['["123"]']),
    ({"format": "ipv4"}, ['"192.168.0.1"'], ['"256.1.1.1"', '"1.2.3"']),
    ({"format": "email"}, ['"a.b@c.org"'], ['"a@b"', '"@c.org"']),
    ({"pattern": "^a|b$"}, ['"ax"', '"xb"'], ['"xa"', '"bx"']),  # anchors belong to their alternative
    ({"pattern": "^(a[]|b)$"}, ['"b"'], ['"a', '"a"']),  # an empty class: no way through
    ({"pattern": "^😀$"}, ['"\\ud83d\\ude00"'], ['"\\ud83c']),  # (no high surrogate that cannot pair)
    ({"pattern": "^\\uD83D\\uDE00$"}, ['"😀"'], ['"\\ud83d"']),  # a pair in the pattern: one character
    ({"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     ['{"b": "x"}'], ['{"\\u0061": "x"}', '{"b\\n": "x"}']),  # no escapes in other keys: no "a" in disguise
    ({"type": "string", "maxLength": 1}, ['"\\udbff\\udfff"'], ['"\\ud800\\ud800"', '"\\ud800a"', '"\\ud800"']),
    ({"type": "string"}, ['"\\ud7ff"', '"\\ue000"', '"\\uDBFF\\uDC00"'], ['"\\udc00"', '"\\uDFFF"', '"a\\udcff"']),  # (alone)
    ({"minLength": 3}, ['"abc"'], ['"ab"', '3']),  # keywords imply their type
    ({"maxItems": 1}, ['[1]'], ['[1, 2]', '{}']),
    ({"additionalProperties": False}, ['{}'], ['{"a": 1}']),
    ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/B"}}, "B": {"$ref": "#/$defs/A"}}},
     ['[[], [[]]]'], ['[1]']),
])
def test_automaton_accepts_json_of_the_schema_and_nothing_else(schema, good, bad):
    for text in good:
        assert accepts(schema, text), text
    for text in bad:
        assert not accepts(schema, text), text


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "(?=a)b"}, "lookarounds"),
    ({"type": "string", "pattern": "(a)\\1"}, "escape"),
    ({"type": "string", "pattern": "^a$b"}, "ends"),
    ({"type": "string", "pattern": "[a-"}, "pattern"),
    ({"type": "string", "pattern": "a{3,2}"}, "repetition"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "maxLength"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"pattern": "a{²}"}, "repetition"),
    ({"pattern": "a{" + "1" * 5000 + "}"}, "repetition"),
    ({"pattern": "(" * 1000 + ")" * 1000}, "deep"),
    ({"pattern": "[^\\s\\S]"}, "matches nothing"),
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "$ref"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
    ({"type": "object", "properties": {}, "required": ["x"]}, "required"),
    ({"type": "text"}, "type"),
    ({"type": None}, "type"),  # (a null type is no type given)
    ({"type": None, "enum": [1]}, "type"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ([1, 2], "object"),
    ({"$ref": [1]}, "$ref"),
    ({"type": "string", "maxLength": 2, "anyOf": [{"type": "string"}]}, "maxLength"),
    ({"type": "object", "$ref": "#"}, "type"),
    ({"type": "integer", "const": "abc"}, "type"),
    ({"enum": [1], "minimum": 0}, "minimum"),
    ({"minLength": 1, "items": {}}, "without a 'type'"),
    ({"required": ["a"]}, "required"),
    ({"type": "string", "format": ["date"]}, "format"),  # (unhashable: a TypeError, a 500, before)
    ({"enum": [1], "type": ["string", {"x": 1}]}, "type"),
])
def test_what_the_compiler_cannot_enforce_is_refused_by_name(schema, keyword):
    with pytest.raises(SchemaError, match=keyword.replace("$", r"\$")):
        compile_schema(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no finite value
    {"anyOf": [{"$ref": "#"}, {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]},
    json.loads('{"type": "array", "minItems": 1, "items": ' * 64 + '{"type": "null"}' + '}' * 64),  # too deep
])
def test_a_schema_with_no_value_that_can_be_written_is_refused(schema):
    with pytest.raises(SchemaError, match="no value that can be written"):
        Grammar(*compile_schema(schema))


def test_recursion_stops_where_the_value_can_still_end():
    g = grammar({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}, "v": {"type": "null"}},
                                 "required": ["v"]}}, "$ref": "#/$defs/n"})
    state, depth = g.start, 0
    while (deeper := g.feed(state, b'{"c":')) >= 0:
        state, depth = deeper, depth + 1
    assert depth > 20
    assert g.accepting(g.feed(state, b'{"v":null}' + b',"v":null}' * depth))  # still finishable, and finished


def test_an_object_with_thousands_of_keys_holds_one_stack_for_them():
    keys = {f"key{i}": {} for i in range(5000)}
    g = Grammar(*compile_schema({"type": "object", "properties": keys}))
    assert len(g._states[g.feed(g.start, b'{"key')]) == 1
    assert g.accepting(g.feed(g.start, b'{"key7": 1, "key4999": {}}'))
    assert g.feed(g.start, b'{"key4999": 1, "key7": 1}') < 0  # in their order


def test_a_long_chain_of_definitions_compiles():
    defs = {f"d{i}": {"type": "object", "properties": {"k": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    g = grammar({"$ref": "#/$defs/d0", "$defs": {**defs, "d40": {"type": "integer"}}})
    assert g.accepting(g.feed(g.start, b'{"k": {}}'))


def test_thousands_of_alternatives_open_at_most_sixteen_stacks():
    g = Grammar(*compile_schema({"type": "array", "items": {"anyOf": [{"type": "array"}] * 3000}}))
    assert 1 <= len(g._states[g.feed(g.start, b"[[")]) <= 16
    assert g.accepting(g.feed(g.start, b"[[], [1]]"))


def test_annotations_are_accepted_and_type_is_inferred():
    nodes, root = compile_schema({"title": "T", "description": "d", "$schema": "x",
                                  "properties": {"a": {"default": 1, "type": "integer"}}})
    g = G(Grammar(nodes, root), TINY)
    assert g.accepting(g.feed(g.start, b'{"a": 3}'))


def brute_force_mask(g: G, state: int, pieces: list, size: int, eos: int = EOS) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    for i, p in enumerate(pieces[:size]):
        if p and len(p) <= 48:
            mask[i] = g.feed(state, p) >= 0
    if g.accepting(state) or not mask.any():
        mask[eos] = True
    return mask


def states_along(g: G, text: bytes) -> list[int]:
    return [g.feed(g.start, text[:i]) for i in range(len(text) + 1)]


@pytest.mark.parametrize("schema, text", [
    (PERSON, b'{\n  "name": "a\\"\xc3\xa9",\n  "age": -12,\n  "tags": ["x", "y"], "ok": false}'),
    (TREE, b'{"v": 0.5e-3, "kids": [{"v": 1, "kids": []}]}'),
    ({"type": "object"}, b'{"a": [1, {"b": null}], "c": "d\\u00e9"}'),
])
def test_masks_equal_feeding_every_token(schema, text):
    g = grammar(schema)
    for state in states_along(g, text):
        assert state >= 0
        got = g.info(state).mask(TINY.size)
        assert (got == brute_force_mask(g, state, PIECES, TINY.size)).all(), state
        assert not got[len(PIECES):].any()  # ids past the vocabulary: never


def test_masks_on_a_real_vocabulary(smollm_tokenizer_dir):
    pieces = token_bytes(smollm_tokenizer_dir)
    vocab = TokenVocab(pieces, 49152, [2])
    g = grammar(PERSON, vocab)
    text = b'{"name": "B\\u00e9b", "age": 42, "tags": ["x"]}'
    for state in states_along(g, text)[::6]:
        assert (g.info(state).mask(vocab.size) == brute_force_mask(g, state, pieces, vocab.size, eos=2)).all()


def test_token_bytes_from_gguf_and_tokenizer_json_agree(default_gguf, smollm_tokenizer_dir):
    from frontends.tokenizer import load_tokenizer

    a, b = token_bytes(default_gguf), token_bytes(smollm_tokenizer_dir)
    assert len(a) == len(b) == 49152
    assert a[:17] == [None] * 17 and b[:17] == [None] * 17  # special tokens have no bytes
    assert a[17:] == b[17:]
    tok = load_tokenizer(smollm_tokenizer_dir)
    for tid in random.Random(0).sample(range(17, 49152), 300):
        text = tok.decode([tid])
        if "\ufffd" not in text:  # (a token that is part of a UTF-8 character decodes to U+FFFD)
            assert b[tid] == text.encode()
    assert b[tok.encode(" {", add_special_tokens=False)[0]] == b" {"


def matches(value, schema: dict, root: dict) -> bool:
    """The test's own validator for the keywords the compiler understands."""
    if "$ref" in schema:
        return matches(value, root["$defs"][schema["$ref"].split("/")[-1]], root)
    if "anyOf" in schema:
        return any(matches(value, s, root) for s in schema["anyOf"])
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type", "object" if "properties" in schema else None)
    if t is None:
        return True
    if isinstance(t, list):
        return any(matches(value, {**schema, "type": x}, root) for x in t)
    if t == "object":
        props = schema.get("properties")
        if not isinstance(value, dict) or not all(r in value for r in schema.get("required", [])):
            return False
        return props is None or all(k in props and matches(v, props[k], root) for k, v in value.items())
    if t == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9)
                and all(matches(v, schema.get("items", {}), root) for v in value))
    if t == "string":
        return isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1e9)
    kinds = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    return isinstance(value, kinds[t]) and (t == "boolean" or not isinstance(value, bool))


@pytest.mark.parametrize("pattern", [r"^\d{3}-[a-zé]+$", r"^[^a]{2}$", 'a|\n\t"', "^.{2,3}$", r"^\w+@\w+\.com$"])
def test_random_walks_under_a_pattern_end_in_strings_it_matches(pattern):
    import re

    rng = random.Random(2)
    g = grammar({"type": "string", "pattern": pattern})
    ref = re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern, re.ASCII)  # (ECMA's $ and \w)
    for _ in range(30):
        m, out = GrammarMatcher(g), b""
        while not m.finished and len(out) < 400:
            state = m.state
            mask = m.info().mask(TINY.size)
            assert (mask == brute_force_mask(g, state, PIECES, TINY.size)).all()
            token = int(rng.choice(np.flatnonzero(mask)))
            if token == EOS:
                break
            out += PIECES[token]
            m.advance(token)
        if m.finished or token == EOS:
            assert ref.search(json.loads(out)), out


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "tree", "object", "any", "anyof"])
def test_random_walks_under_the_mask_end_in_valid_json(schema):
    rng = random.Random(1)
    g = grammar(schema)
    ended = 0
    for _ in range(40):
        m, out = GrammarMatcher(g), b""
        for _ in range(300):
            allowed = np.flatnonzero(m.info().mask(TINY.size))
            token = int(rng.choice(allowed))
            if token == EOS:
                break
            out += PIECES[token]
            m.advance(token)
            if m.finished:
                break
        else:
            continue  # (a walk may wander for long in a free-form schema: it must stay a prefix)
        ended += 1
        value = json.loads(out)
        assert matches(value, schema, schema), out
    assert ended >= 10


def test_an_accepting_number_allows_the_end_and_more_digits():
    g = grammar({"type": "integer"})
    info = g.info(g.feed(g.start, b"12"))
    mask = info.mask(TINY.size)
    assert info.accepting and not info.terminal and mask[EOS] and mask[PIECES.index(b"3")]
    assert not mask[PIECES.index(b".")]
    any_value = grammar({})
    inside = any_value.info(any_value.feed(any_value.start, b'"'))
    assert not inside.accepting and not inside.mask(TINY.size)[EOS]


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from engine import LLM

    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)


FINITE = {  # a random model must end it: every string and list is bounded
    "type": "object",
    "properties": {"flag": {"type": "boolean"}, "pick": {"enum": ["red", "green", 3]},
                   "word": {"type": "string", "maxLength": 6}, "list": {"type": "array", "maxItems": 2,
                                                                          "items": {"type": "null"}}},
    "required": ["flag", "pick", "word", "list"],
}


def test_a_random_model_is_held_to_the_schema(llm):
    from engine import SamplingParams

    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    greedy = SamplingParams(max_tokens=120, temperature=0.0, json_schema=FINITE)
    sampled = SamplingParams(max_tokens=120, temperature=1.0, seed=5, json_schema=FINITE)
    outs = llm.generate(prompts, greedy) + llm.generate(prompts, sampled)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert matches(json.loads(o.text), FINITE, FINITE), o.text
    # greedy structured output does not depend on the batch
    alone = llm.generate(prompts[1:2], greedy)[0]
    assert alone.token_ids == outs[1].token_ids
    plain = llm.generate(prompts[1:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert plain.token_ids != alone.token_ids[:8]  # (the mask changed what the model writes)


def test_asynchronous_scheduling_keeps_structured_output(tiny_llama, llm):
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=120, temperature=0.0, json_schema=FINITE)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    overlapped = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, async_scheduling="on")
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = overlapped.generate([*prompts, [3, 3]], [params, params, plain])
    want = llm.generate([*prompts, [3, 3]], [params, params, plain])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_server_with_asynchronous_scheduling_streams_json_beside_plain_text(tiny_llama, llm):
    """A real server with asynchronous scheduling (CUDA's default) on the CPU, the official client, JSON-schema
    streams and plain ones at once: each next step's forward is launched before the grammars' tokens are back,
    its sampling after. Every JSON stream is valid and is what the engine writes offline, synchronously; so is
    every plain one."""
    import asyncio

    from openai import AsyncOpenAI

    from engine import SamplingParams
    from tests.test_server_e2e import Server

    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    schema = SamplingParams(max_tokens=120, temperature=0.0, json_schema=FINITE)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = {(p, True): llm.generate([p], schema)[0].text for p in prompts}
    want |= {(p, False): llm.generate([p], plain)[0].text for p in prompts}

    async def one(client, prompt: str, json_mode: bool) -> tuple[str, bool, str, str]:
        extra = {"structured_outputs": {"json": FINITE}} if json_mode else {"ignore_eos": True}
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=120 if json_mode else 16,
                                                 temperature=0, stream=True, extra_body=extra)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return prompt, json_mode, text, finish

    async def main(url: str) -> list[tuple[str, bool, str, str]]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[one(client, p, j) for p in prompts for j in (True, False)] * 2)
        finally:
            await client.close()

    server = Server("--model", tiny_llama, "--served-model-name", "tiny", "--dtype", "float32",
                    "--async-scheduling", "on", "--max-num-seqs", "16")
    try:
        results = asyncio.run(main(server.url))
    finally:
        server.close()
    assert len(results) == 16
    for prompt, json_mode, text, finish in results:
        assert text == want[prompt, json_mode], (prompt, json_mode)
        if json_mode:
            assert finish == "stop" and matches(json.loads(text), FINITE, FINITE), text
        else:
            assert finish == "length"


def test_an_unsupported_schema_is_a_400_naming_response_format(llm):
    from engine import SamplingParams
    from engine.engine import RequestError

    with pytest.raises(RequestError) as e:
        llm.engine.add_request("bad", [1, 2], SamplingParams(json_schema={"type": "integer", "minimum": 0}))
    assert e.value.status == 400 and e.value.param == "response_format" and "minimum" in e.value.message
    assert "bad" not in llm.engine.requests


def test_grammars_are_cached_by_schema_and_a_full_one_forgets_its_states(smollm_tokenizer_dir, monkeypatch):
    import engine.structured as structured
    from engine import SamplingParams

    grammars = structured.Grammars(smollm_tokenizer_dir, 49152, [2])
    first = grammars.matcher(SamplingParams(json_schema=PERSON))
    assert grammars.matcher(SamplingParams(json_schema=PERSON)).tokens is first.tokens
    assert grammars.matcher(SamplingParams(json_schema=TREE)).tokens is not first.tokens
    vocab = first.tokens.vocab
    token_of = {vocab.token(int(t)): int(t) for t in vocab.ids}
    pieces = [b'{"', b"name", b'":', b' "', b"Bob", b'",', b' "', b"age", b'":', b" ", b"4"]
    monkeypatch.setattr(structured, "MAX_TRANSITIONS", 0)  # from now on it forgets at every call
    for piece in pieces:
        first.advance(token_of[piece])
    assert first.tokens.grammar.generation > 5
    fresh = grammar(PERSON, vocab)
    assert (first.info().mask(49152) == fresh.info(fresh.feed(fresh.start, b"".join(pieces))).mask(49152)).all()


def test_choice_is_one_of_the_strings_as_raw_text():
    from engine.json_schema import compile_choice

    g = G(Grammar(*compile_choice(["yes", "no", "yes please", "é"]), json=False), TINY)
    assert g.accepting(g.feed(g.start, b"yes")) and not g.info(g.feed(g.start, b"yes")).terminal
    assert g.info(g.feed(g.start, b"no")).terminal and g.accepting(g.feed(g.start, "é".encode()))
    assert g.feed(g.start, b'"no"') < 0 and g.feed(g.start, b"maybe") < 0 and g.feed(g.start, b" no") < 0


def test_the_engine_holds_a_model_to_a_choice(llm):
    from engine import SamplingParams

    choices = ["positive", "negative", "neutral"]
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=20, temperature=1.0, seed=3, choice=choices))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, ({"json_schema": {"type": "object"}}, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, ({"json_schema": {}}, "response_format")),
    ({"json_schema": {"type": "integer"}}, ({"json_schema": {"type": "integer"}}, "json_schema")),  # llama.cpp's
    ({"guided_json": '{"type": "integer"}'}, ({"json_schema": {"type": "integer"}}, "guided_json")),  # as a string
    ({"structured_outputs": {"json": {"type": "null"}}}, ({"json_schema": {"type": "null"}}, "structured_outputs")),
    ({"structured_outputs": {"json_object": True}}, ({"json_schema": {"type": "object"}}, "structured_outputs")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ({"choice": ["a", "b"]}, "structured_outputs")),
    ({"guided_choice": ["a"]}, ({"choice": ["a"]}, "guided_choice")),
    ({"structured_outputs": {"regex": "a+"}}, ({"regex": "a+"}, "structured_outputs")),
    ({"guided_regex": "a+"}, ({"regex": "a+"}, "guided_regex")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ({"grammar": 'root ::= "a"'}, "structured_outputs")),
    ({"guided_grammar": 'root ::= "a"'}, ({"grammar": 'root ::= "a"'}, "guided_grammar")),
    ({"grammar": 'root ::= "a"'}, ({"grammar": 'root ::= "a"'}, "grammar")),  # llama.cpp's
    ({}, ({}, "response_format")),
])
def test_the_structured_output_fields_clients_send(body, want):
    from frontends.openai_params import parse_structured

    assert parse_structured(body) == want


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {"structural_tag": "a+"}}, "structured_outputs"),
    ({"guided_regex": ["a+"]}, "guided_regex"),
    ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),  # (no name:
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 1, "schema": {}}}}, "response_format"),  # AA)
])
def test_bad_structured_output_fields_are_400s_naming_them(body, param):
    from frontends.errors import ApiError
    from frontends.openai_params import parse_structured

    with pytest.raises(ApiError) as e:
        parse_structured(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_pattern_used_often_is_compiled_once_and_patterns_together_are_bounded():
    """The engine compiles schemas on its step loop: a tools list with one pattern in 1500 places costs
    one pattern, and distinct large patterns are refused before they cost much."""
    from engine.json_schema import MAX_PATTERN_STATES, PAT

    props = {f"p{i}": {"type": "string", "pattern": "(a|b)*c{1,200}"} for i in range(1500)}
    nodes, _ = compile_schema({"type": "object", "properties": props})
    assert len({id(n[1]) for n in nodes if n and n[0] == PAT}) == 1
    props = {f"p{i}": {"type": "string", "pattern": f"(a|b)*c{{1,200}}x{i}"} for i in range(95)}
    with pytest.raises(SchemaError, match=f"more than {MAX_PATTERN_STATES} states"):
        compile_schema({"type": "object", "properties": props})


def test_the_vocabularys_splits_are_kept_for_the_byte_sets_used_last():
    """``TokenVocab.split`` keeps a whole-vocabulary split per byte set, for every grammar, those gone from the
    cache too: a client sending new grammars brings new sets, so only the last ``SPLITS_CACHE`` used are kept
    (they grew without bound, 0.5 MB each for a 49k vocabulary)."""
    from engine.structured import SPLITS_CACHE

    vocab = TokenVocab(PIECES, len(PIECES) + 3, [EOS])
    rng = np.random.default_rng(0)
    sets = [rng.random(256) < 0.5 for _ in range(SPLITS_CACHE + 10)]
    first = vocab.split(sets[0])
    for keep in sets[1:]:
        vocab.split(keep)
        assert vocab.split(sets[0]) is first  # (used again each time: kept)
    assert len(vocab._splits) == SPLITS_CACHE
    assert all((a == b).all() for a, b in zip(vocab.split(sets[1]), TokenVocab(PIECES, len(PIECES) + 3, [EOS]).split(
        sets[1]), strict=True))  # (dropped, made again)
