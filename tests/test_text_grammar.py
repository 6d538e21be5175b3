"""Raw-text structured output: GBNF grammars (llama.cpp's) and regular expressions (vLLM's ``regex``)
compiled or refused by name, their byte automata, masks equal to feeding every token by hand, random
walks under the mask that end in text the grammar (or Python's ``re``) accepts, and the engine holding
a model to them."""

from __future__ import annotations

import ast
import json
import random
import re

import numpy as np
import pytest

from engine.json_schema import SchemaError
from engine.structured import TokenVocab
from engine.text_grammar import GbnfGrammar, RegexGrammar, compile_gbnf
from tests.test_structured_output import G  # a grammar's masks with its own calls at hand
from tests.test_tool_calls import stack  # noqa: F401 - the fixture

EOS = 0
PIECES = [None] + [bytes([b]) for b in range(256)] + [p.encode() for p in (
    "12", "345", "+(", ")*", "((", "))", '{"', '":', '": ', '", "', '"}', "true", "null", "\\n", "é", "日本",
    "ab", "abc", "-0", "2026-", "-12-", "yes", "no", " yes", "\n", "  ")]
TINY = TokenVocab(PIECES, len(PIECES) + 3, [EOS])

# llama.cpp's grammars/json.gbnf, as it ships (a newline inside parentheses, comments, {m,n})
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
'''
ARITH = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor ("*" factor)*
factor ::= [1-9] [0-9]{0,3} | "0" | "(" expr ")"
'''


def gbnf(text: str, vocab=TINY) -> G:
    return G(GbnfGrammar(*compile_gbnf(text)), vocab)


def accepts(g: G, text: str) -> bool:
    s = g.feed(g.start, text.encode())
    return s >= 0 and g.accepting(s)


@pytest.mark.parametrize("grammar, good, bad", [
    (ARITH, ["1+2*3", "(1-20)*(3)", "((7))", "0", "9999"], ["1+", "(1", "01", "10000", "", " 1", "1 "]),
    (JSON_GBNF, ['{"a": 1}', '{"a": [1, -2.5e3, {"b": "é\\n\\u00e9"}], "c": true}', '{}\n  ', '{"日本": null}'],
     ['{"a" 1}', "[]", '{"a": 01}', '{"a": "\x01"}', '{"a": 1}  \n']),
    ('root ::= "a"{2} "b"{1,3} "c"{2,} "d"?', ["aabcc", "aabbbccccd"], ["abcc", "aabbbbcc", "aabc"]),
    ('root ::= [^a-z\\]]+ # no lower case\n', ["ABC]".replace("]", ""), "日本", "Z9 \n"], ["aB", "]", "é" * 0]),
    ('root ::= ( "x" | ) "\\x41\\u00e9\\U0001F600" [\\-+]', ["Aé😀-", "xAé😀+"], ["Aé😀*", "Aé😀"]),
    ('root ::= line+\nline ::= [a-c]* "\\n"', ["\n", "ab\nc\n"], ["ab", "d\n"]),
    ('root ::= . .', ["ab", "日本", "\n\t"], ["a", "abc"]),
    ('root ::= ("a"? | "b")* "."', [".", "abba."], ["abc."]),  # a repetition of what may be nothing
    ('root ::= x* "!"\nx ::= "a"? "b"?', ["!", "abba!"], ["c!"]),
    ('root ::= ("a"? "b"?){20} "."', [".", "ab" * 19 + "b.", "b" * 20 + "."], ["ab" * 20 + "a."]),
])
def test_gbnf_accepts_its_language_and_nothing_else(grammar, good, bad):
    g = gbnf(grammar)
    for text in good:
        assert accepts(g, text), text
    for text in bad:
        assert not accepts(g, text), text


@pytest.mark.parametrize("grammar, words", [
    ('root ::= root "a" | "b"', "rule 'root' is left recursive"),
    ('root ::= x? y\ny ::= "c" | root "d"\nx ::= "e"', "rule 'root' is left recursive"),  # (through x?)
    ('root ::= x', "rule 'x' is used but not defined"),
    ('a ::= "x"', "no 'root' rule"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root ::= "(" root ")"', "rule 'root' can never finish"),
    ('root ::= [z-a]', "backwards"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\uD800"', "is not a character"),
    ('root ::= ("a"', "not closed"),
    ('root ::= "a"{3,2}', "counts are"),
    ('root ::= "a"{1001}', "counts are"),
    ("root ::= " + '"a"{1000} ' * 21, "too large"),
    ('root ::= "a" ; "b"', "unexpected '; \"b\"'"),
    ('root "a"', "expected 'name ::='"),
    ("", "a grammar must be GBNF text"),
])
def test_what_gbnf_cannot_run_is_refused_by_name(grammar, words):
    with pytest.raises(SchemaError, match=re.escape(words)):
        gbnf(grammar)


def test_alternatives_that_begin_alike_share_a_stack_so_a_long_enum_keeps_every_member():
    import itertools

    words = [f"item{i}" for i in range(100)] + ["".join(w) for w in itertools.product("abcdefghij", "klmnop",
                                                                                       "qrstu", "vwxyz")]
    g = gbnf("root ::= " + " | ".join(f'"{w}"' for w in words))
    assert all(accepts(g, w) for w in words)
    assert len(g.grammar.stacks(g.feed(g.start, b"item"))) <= 11  # one per next character, not one per word
    sku = gbnf('root ::= "SKU-" (' + " | ".join(f'"{i:04d}"' for i in range(0, 3000, 7)) + ")")
    assert all(accepts(sku, f"SKU-{i:04d}") for i in range(0, 3000, 7)) and not accepts(sku, "SKU-0001")


def test_compiling_is_linear_in_the_grammar():
    """Rules defined top-down, thousands of them: fixpoint passes would settle one rule a pass."""
    import time

    n = 4000
    chain = "root ::= r0\n" + "".join(f"r{i} ::= \"a\" r{i + 1} | \"b\"\n" for i in range(n)) + f'r{n} ::= "x"'
    start = time.perf_counter()
    g = gbnf(chain)
    assert time.perf_counter() - start < 2.0
    assert accepts(g, "aab") and accepts(g, "a" * n + "x") and not accepts(g, "ax")


def test_a_grammar_that_must_nest_too_deep_is_refused_and_a_kept_stack_can_always_end():
    deep = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} "b"\n' for i in range(300)) + 'r300 ::= "c"'
    with pytest.raises(SchemaError, match="nests deeper than 256 levels on every way to finish"):
        gbnf(deep)
    with pytest.raises(SchemaError, match="parentheses deeper than 100"):
        gbnf("root ::= " + "(" * 150 + '"a"' + ")" * 150)
    # may nest deep, need not: past the depth an open '(' is no longer offered, and every state can end
    g = gbnf('root ::= "(" root ")" | "x"')
    state = g.start
    for _ in range(300):
        info = g.info(state)
        assert info.mask(TINY.size).any() and (info.accepting or info.mask(TINY.size)[1:].any())
        nxt = g.feed(state, b"(")
        if nxt < 0:
            break
        state = nxt
    assert g.feed(state, b"x" + b")" * 255) >= 0


def test_nesting_past_the_depth_kept_narrows_the_output_and_right_recursion_runs_flat():
    g = gbnf('root ::= "(" root ")" | "x"')
    assert accepts(g, "(" * 100 + "x" + ")" * 100)
    assert g.feed(g.start, b"(" * 400) < 0  # (dropped past MAX_DEPTH: the text can still end)
    flat = gbnf('root ::= "a" root | ""')
    states = {flat.feed(flat.start, b"a" * n) for n in range(1, 50)}
    assert len(states) == 1  # one state however long: the stack does not grow


@pytest.mark.parametrize("source, good, bad", [
    (r"\d{4}-\d{2}-\d{2}", ["2026-12-02"], ["2026-12-2", "x2026-12-02", "2026-12-02 "]),
    (r"^(yes|no)$", ["yes", "no"], ["yess", " no", ""]),
    (r"[a-zé]+( [a-zé]+)*", ["é", "ab cd"], ["ab  cd", "AB", "ab "]),
    (r"(日本|x){2}\.?", ["日本x", "xx."], ["日", "x"]),
])
def test_a_regex_must_match_the_whole_text(source, good, bad):
    g = G(RegexGrammar(source), TINY)
    for text in good:
        assert accepts(g, text) and re.fullmatch(source, text), text
    for text in bad:
        assert not accepts(g, text) and not re.fullmatch(source, text), text


def test_a_bad_regex_is_refused_by_name():
    for source, words in ((r"(?=a)b", "lookarounds"), ("a(", "without its ')'"), ("[a", "without its ']'")):
        with pytest.raises(SchemaError, match=re.escape(words)) as e:
            RegexGrammar(source)
        assert "'regex'" in str(e.value)


def brute_force_mask(g: G, state: int) -> np.ndarray:
    mask = np.zeros(TINY.size, dtype=bool)
    for i, p in enumerate(PIECES):
        if p:
            mask[i] = g.feed(state, p) >= 0
    if g.accepting(state) or not mask.any():
        mask[EOS] = True
    return mask


@pytest.mark.parametrize("g, text", [
    (lambda: gbnf(JSON_GBNF), '{"a": [1, "日本"], "b": {"c": null}}'),
    (lambda: gbnf(ARITH), "(12+345)*6-0"),
    (lambda: G(RegexGrammar(r"\d{4}-\d{2}-\d{2}( é+)?"), TINY), "2026-12-02 éé"),
])
def test_masks_equal_feeding_every_token(g, text):
    g, data = g(), text.encode()
    for i in range(len(data) + 1):
        state = g.feed(g.start, data[:i])
        if state < 0:  # (inside a character: its first bytes alone are no text)
            continue
        assert (g.info(state).mask(TINY.size) == brute_force_mask(g, state)).all(), data[:i]


def walk(g: G, rng: random.Random, limit: int = 200) -> bytes | None:
    state, out = g.start, b""
    for _ in range(limit):
        g.clock.spent = 0.0  # (a token a step, as the engine's: the step's time for new masks starts afresh)
        info = g.info(state)
        allowed = np.flatnonzero(info.mask(TINY.size))
        token = int(rng.choice(allowed))
        if token == EOS:
            return out if info.accepting else None
        out += PIECES[token]
        state = g.feed(state, PIECES[token])
        assert state >= 0
    return None


def test_random_walks_under_the_mask_end_in_text_of_the_grammar():
    rng = random.Random(0)
    arith, regex, json_g = gbnf(ARITH), G(RegexGrammar(r"[a-c]{1,5}(-\d)?|é日本"), TINY), gbnf(JSON_GBNF)
    ended = 0
    for _ in range(100):
        text = walk(arith, rng)
        if text is not None:
            ended += 1
            tree = ast.parse(text.decode(), mode="eval")
            assert all(isinstance(n, ast.Expression | ast.BinOp | ast.Constant | ast.operator) for n in ast.walk(tree))
        text = walk(regex, rng)
        if text is not None:
            assert re.fullmatch(r"[a-c]{1,5}(-\d)?|é日本", text.decode())
        text = walk(json_g, rng, 60)
        if text is not None:
            assert isinstance(json.loads(text), dict)
    assert ended > 25


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from engine import LLM

    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=512, max_num_seqs=8)


def test_the_engine_holds_a_model_to_a_regex_and_a_grammar(llm, monkeypatch):
    import engine.structured
    from engine import SamplingParams

    # (not a test of the time budgets, below: a loaded machine, the suite in two workers, once took past 0.5 s for
    # one of ARITH's new masks, and the request ended "error")
    monkeypatch.setattr(engine.structured, "MASK_SECONDS", 30.0)
    monkeypatch.setattr(engine.structured, "STEP_SECONDS", 60.0)

    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    date = r"\d{4}-(0[1-9]|1[0-2])-\d{2}"
    maybe = 'root ::= "yes" | "no" | "maybe, " root'
    ended = 0
    for params, check in (
        (dict(regex=date), lambda t: re.fullmatch(date, t)),
        (dict(grammar=ARITH), lambda t: ast.parse(t, mode="eval")),
        (dict(grammar=maybe), lambda t: re.fullmatch(r"(maybe, )*(yes|no)", t)),
    ):
        auto = RegexGrammar(params["regex"]) if "regex" in params else GbnfGrammar(*compile_gbnf(params["grammar"]))
        for temperature in (0.0, 1.0):
            outs = llm.generate(prompts, SamplingParams(max_tokens=60, temperature=temperature, seed=3, **params))
            for o in outs:
                assert o.finish_reason in ("stop", "length")
                if o.finish_reason == "stop":
                    ended += 1
                    assert check(o.text), (params, o.text)
                else:  # (a random model nests sums deep): what it wrote so far is still the grammar's
                    assert auto.feed(auto.start, o.text.encode()) >= 0, o.text
    assert ended >= 12
    greedy = SamplingParams(max_tokens=30, temperature=0.0, regex=date)
    together = llm.generate(prompts, greedy)
    assert [o.token_ids for o in together][1:2] == [o.token_ids for o in llm.generate(prompts[1:2], greedy)]


def test_a_bad_grammar_is_a_400_and_only_one_kind_is_given(llm):
    from engine import SamplingParams
    from engine.engine import RequestError
    from engine.protocol import SamplingParamError

    with pytest.raises(RequestError) as e:
        llm.engine.add_request("bad", [1, 2], SamplingParams(grammar='root ::= root "a" | "b"'))
    assert e.value.status == 400 and e.value.param == "response_format" and "left recursive" in e.value.message
    assert "bad" not in llm.engine.requests
    with pytest.raises(SamplingParamError, match="give one of regex and grammar"):
        SamplingParams(regex="a", grammar='root ::= "a"')
    with pytest.raises(SamplingParamError, match="regex must be a non-empty string"):
        SamplingParams(regex="")


def test_a_grammar_too_costly_to_follow_ends_its_request_and_is_refused_after(llm, monkeypatch):
    """A regex whose automaton keeps hundreds of NFA states open makes every new mask slow and its state sets
    large: past the engine's bounds the request ends with finish_reason "error" (the reason in stop_reason),
    the grammar is refused from then on, and the other requests of the batch go on."""
    import engine.regex
    import engine.structured
    from engine import SamplingParams
    from engine.engine import RequestError

    monkeypatch.setattr(engine.regex, "MAX_HELD", 3000)
    costly = SamplingParams(max_tokens=40, temperature=1.0, seed=1, regex=r"(.*[a-m].{30}|.*[n-z].{30}|.*\d.{30})*")
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out, other = llm.generate([[1, 2, 3], [4, 5]], [costly, plain])
    assert out.finish_reason == "error" and "keeps too many states open" in out.stop_reason
    assert other.finish_reason == "length" and len(other.token_ids) == 8
    (failed,) = [t for t in llm.engine.grammars._cache.values() if t.failed]  # kept as a refusal only:
    assert failed.grammar is None and not failed._info  # its automaton, and what it learned, dropped
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("again", [1, 2], costly)
    assert e.value.status == 400 and "keeps too many states open" in e.value.message
    monkeypatch.setattr(engine.structured, "MASK_SECONDS", 0.0)  # every new mask is over its time
    slow = SamplingParams(max_tokens=20, temperature=0.0, regex=r"[a-z]+ [0-9]+")
    out = llm.generate([[1, 2, 3]], slow)[0]
    assert out.finish_reason == "error" and "takes too long" in out.stop_reason


def test_a_mask_too_costly_after_the_first_token_ends_its_request_with_error_not_stop(llm, monkeypatch):
    """The next state's mask is most often made as the engine checks whether the output is complete: a grammar
    that fails there ends its request with finish_reason "error", its output so far inside the grammar (it
    was read as complete before: "stop", with a value cut short)."""
    import engine.structured
    from engine import SamplingParams
    from engine.json_schema import GrammarTooCostly

    made = []
    allowed = engine.structured.TokenGrammar._allowed

    def second_fails(self, state, row):
        made.append(state)
        if len(made) > 1:
            raise GrammarTooCostly("the output's grammar takes too long to follow (a test's)")
        return allowed(self, state, row)
    monkeypatch.setattr(engine.structured.TokenGrammar, "_allowed", second_fails)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, temperature=0.0, regex=r"[a-z]+ [0-9]+;"))[0]
    assert out.finish_reason == "error" and out.stop_reason.endswith("(a test's)")
    assert len(out.token_ids) == 1 and re.fullmatch(r"[a-z]+( [0-9]*)?", out.text), out.text  # (no ";" yet)


def test_a_steps_new_masks_share_its_time(llm, monkeypatch):
    """Each new mask may take MASK_SECONDS, but a step's together STEP_SECONDS: past it, MASK_FLOOR_SECONDS
    each. Two requests whose every new mask takes 0.3 s (by a clock of the test's) and two whose masks cost
    nothing: the first step makes four costly masks (each costly request's first and next state's), the fourth
    past the budget, so its request ends with finish_reason "error" (GRAMMARS_BUSY: a frontend's 503); the other
    costly one goes on, a mask a step, and the cheap ones and a plain request beside them are untouched. The
    grammar cut short is not refused: alone, it runs."""
    import time as real_time
    import types

    import engine.grammar
    import engine.structured
    import engine.text_grammar
    from engine import SamplingParams
    from engine.protocol import GRAMMARS_BUSY

    assert (engine.structured.STEP_SECONDS, engine.structured.MASK_FLOOR_SECONDS) == (1.0, 0.1)
    clock = engine.structured.MaskClock()
    assert clock.allowance() == engine.structured.MASK_SECONDS
    clock.spent = 0.65
    assert clock.allowance() == pytest.approx(0.35)
    clock.spent = 0.95
    assert clock.allowance() == 0.1

    skew = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: real_time.perf_counter() + skew[0])
    monkeypatch.setattr(engine.grammar, "time", fake)
    monkeypatch.setattr(engine.structured, "time", fake)
    init, allowed = engine.text_grammar.RegexGrammar.__init__, engine.structured.TokenGrammar._allowed

    def kept(self, source):
        init(self, source)
        self.costly = source.endswith("!")
    monkeypatch.setattr(engine.text_grammar.RegexGrammar, "__init__", kept)

    def slow(self, state, row):
        skew[0] += 0.3 * self.grammar.costly
        return allowed(self, state, row)
    monkeypatch.setattr(engine.structured.TokenGrammar, "_allowed", slow)
    regexes = [r"[a-z]+ [0-9]+!", r"[a-z]+-[0-9]+!", r"[a-z]+_[0-9]+%", r"[a-z]+=[0-9]+%"]  # (four grammars)
    outs = llm.generate([[1, 2, 3]] * 5, [SamplingParams(max_tokens=6, temperature=0.0, regex=r) for r in regexes]
                        + [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert outs[1].finish_reason == "error" and outs[1].stop_reason == GRAMMARS_BUSY
    assert [o.finish_reason for o in (outs[0], *outs[2:])] == ["length"] * 4
    again = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, regex=regexes[1]))[0]
    assert again.finish_reason == "length"  # (not refused: it was the step's budget, not the grammar)


def test_served_a_grammar_the_engine_gives_up_on_is_a_400_naming_its_field(stack):  # noqa: F811 - the fixture
    import openai

    from engine.protocol import GRAMMARS_BUSY
    from tools.fake_engine import KEY, MODEL

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack[1]}/v1", api_key=KEY, max_retries=0)
    engine = stack[0]
    engine.fail_after = 2  # (the fake engine then ends a request with structured output as the real one gives up)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two three"}],
                                           extra_body={"guided_regex": "[a-z ]+"})
        assert e.value.body["param"] == "guided_regex"
        assert e.value.body["message"] == "guided_regex: its grammar cost too much"
        engine.fail_reason = GRAMMARS_BUSY  # (other requests' grammars took the step's time: to be retried)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two three"}],
                                           extra_body={"guided_regex": "[a-z ]+"})
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["message"] == f"guided_regex: {GRAMMARS_BUSY}"
        engine.fail_reason = "its grammar cost too much"
        with pytest.raises(openai.InternalServerError):  # (out of memory: no reason given)
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two three"}])
    finally:
        engine.fail_after = None
