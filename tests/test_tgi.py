"""TGI's own API (``frontends.tgi``): ``/generate``, ``/generate_stream``, ``POST /``, ``/info``, and ``/tokenize`` and
``/invocations`` with ``inputs``, against ``tokenmill serve`` on the tiny llama (``tiny_server``), with
``huggingface_hub``'s ``InferenceClient`` as TGI's users call it and over raw HTTP. Greedy text equals
``/v1/completions``' for the same prompt; details, streams, seeds, best_of, grammars and refusals are TGI's."""

from __future__ import annotations

import json
import re
import socket
from types import SimpleNamespace

import pytest

from frontends.errors import ApiError
from frontends.tgi import MAX_BEST_OF, Params, error_body, error_status, grammar
from tests.conftest import TINY_KEY, http_call

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf(tiny_server):
    """huggingface_hub's client of the server's root, as a TGI endpoint is called."""
    from huggingface_hub import InferenceClient

    return InferenceClient(model=tiny_server.url, token=TINY_KEY)


def call(server, path: str, body: dict | None = None, key: str | None = TINY_KEY):
    return http_call(server.port, path, body, key)


def post(server, path: str, body: dict, want: int = 200):
    status, raw, _ = call(server, path, body)
    assert status == want, raw
    return json.loads(raw)


def events(raw: bytes) -> list[dict]:
    text = raw.decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    assert all(ev.startswith("data:{") for ev in text.split("\n\n") if ev)  # (TGI's: no space)
    return [json.loads(ev[len("data:"):]) for ev in text.split("\n\n") if ev]


def greedy(server, prompt: str, max_tokens: int) -> str:
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r["choices"][0]["text"]


# ---------------------------------------------------------------------------- units


@pytest.mark.parametrize("params, message", [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"best_of": MAX_BEST_OF + 1, "do_sample": True}, f"`best_of` must be > 0 and <= {MAX_BEST_OF}"),
    ({"best_of": 0}, f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: 0"),
    ({"top_n_tokens": 21}, "`top_n_tokens` must be >= 0 and <= 20. Given: 21"),
    ({"stop": ["a"] * 65}, "`stop` supports up to 64 stop sequences. Given: 65"),
    ({"watermark": True}, "`watermark` is not supported"),
    ({"temperature": "hot"}, "'temperature' must be of type"),
    ({"grammar": {"type": "regex", "value": 3}}, "grammar is not valid"),
    ({"grammar": {"type": "lark", "value": "x"}}, "grammar type 'lark' is not supported"),
])
def test_parameters_are_checked_as_tgi_checks_them(params, message):
    with pytest.raises(ApiError) as e:
        Params({"inputs": "x", "parameters": params}, stream=False)
    assert message in e.value.message
    assert error_status(e.value) == 422
    assert error_body(e.value) == {"error": "Input validation error: " + e.value.message, "error_type": "validation"}


def test_stream_only_refusals_and_inputs():
    with pytest.raises(ApiError, match="`best_of` != 1 is not supported when streaming tokens"):
        Params({"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}}, stream=True)
    with pytest.raises(ApiError, match="`decoder_input_details` == true is not supported when streaming"):
        Params({"inputs": "x", "parameters": {"decoder_input_details": True}}, stream=True)
    with pytest.raises(ApiError, match="`inputs` cannot be empty"):
        Params({"inputs": ""}, stream=False)
    with pytest.raises(ApiError, match="`inputs` must be a string"):
        Params({"inputs": [1, 2]}, stream=False)
    with pytest.raises(ApiError, match="`parameters` must be an object"):
        Params({"inputs": "x", "parameters": None}, stream=False)


def test_sampling_is_tgis_rule():
    def sampling(**p) -> bool:
        return Params({"inputs": "x", "parameters": p}, stream=False).sampling

    assert Params({"inputs": "x"}, stream=False).sampling  # no parameters at all: TGI's do_sample true
    assert not sampling()
    assert not sampling(temperature=1.0)  # (no warper: greedy, as TGI's server)
    assert sampling(temperature=0.7) and sampling(top_k=5) and sampling(top_p=0.9) and sampling(typical_p=0.9)
    assert sampling(do_sample=True)
    body = Params({"inputs": "x", "parameters": {}}, stream=False).completion_body([1, 2], 4, {})
    assert body["temperature"] == 0.0 and "seed" not in body and "logprobs" not in body
    body = Params({"inputs": "x", "parameters": {"do_sample": True}}, stream=True).completion_body([1], 4, {})
    assert body["temperature"] == 1.0 and 0 <= body["seed"] < 2**63 and body["logprobs"] == 0
    assert body["include_stop_str_in_output"] and body["top_p"] == 1.0 and body["repetition_penalty"] == 1.0


def test_grammars_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert grammar({"type": "json", "value": schema}) == {"json": schema}
    assert grammar({"type": "json_object", "value": json.dumps(schema)}) == {"json": schema}
    assert grammar({"type": "json_schema", "value": {"name": "x", "schema": schema}}) == {"json": schema}
    assert grammar({"type": "regex", "value": "[ab]+"}) == {"regex": "[ab]+"}
    assert grammar(None) is None
    for bad in ({"type": "json", "value": "{"}, {"type": "json", "value": 3}, {"type": "json"}, "json"):
        with pytest.raises(ApiError):
            grammar(bad)


def test_error_shapes():
    assert error_body(ApiError(429, "busy")) == {"error": "busy", "error_type": "overloaded"}
    assert error_body(ApiError(503, "Engine unavailable"))["error_type"] == "generation"  # (huggingface_hub's
    # GenerationError, as TGI's for a failure while generating)
    assert error_status(ApiError(500, "boom")) == 424
    assert error_body(ApiError(500, "boom"))["error_type"] == "generation"
    assert error_status(ApiError(401, "key")) == 401


def test_a_stream_that_ends_without_a_token_ends_with_an_error_event(smollm_tokenizer_dir):
    """A choice whose deadline passed between tokens: no made-up token event (TGI never sends one), TGI's
    incomplete_generation error instead."""
    from transformers import AutoTokenizer

    from frontends.generation import Update
    from frontends.text import TextCodec
    from frontends.tgi import GenerateFormat, TgiApi

    tgi = TgiApi(SimpleNamespace(codec=TextCodec(AutoTokenizer.from_pretrained(smollm_tokenizer_dir))))
    choice = SimpleNamespace(index=0, prompt_ids=[1, 2], finish_reason="timeout", stop_reason=None, num_tokens=3,
                             num_prompt_tokens=2)
    fmt = GenerateFormat(tgi, SimpleNamespace(choices=[choice]), Params({"inputs": "x", "parameters": {
        "details": True}}, stream=True), "", listed=False)
    up = Update(choice)
    up.finished = True
    (event,) = events(fmt.chunk([up]))
    assert event["error_type"] == "incomplete_generation" and "after 3 tokens" in event["error"]

    # the deadline ending the request in the same update as a token: that token, then the same error event
    # (not a normal last event, which would pass the cut off as max_new_tokens reached)
    choice.num_tokens = 4
    up = Update(choice)
    up.token_ids, up.text, up.finished = [42], "x", True
    token, end = events(fmt.chunk([up]))
    assert token["token"]["id"] == 42 and token["generated_text"] is None and token["details"] is None
    assert end["error_type"] == "incomplete_generation" and "(timeout) after 4 tokens" in end["error"]
    # whole: the text so far, and "timeout" for its finish, never "length"
    assert fmt._sequence(choice)["finish_reason"] == "timeout"


# ---------------------------------------------------------------------------- served


def test_huggingface_hub_client_greedy_whole_and_streamed(tiny_server, hf):
    want = greedy(tiny_server, PROMPT, 8)
    # POST /: the full text unless return_full_text is false (TGI's default for a text-generation model)
    assert hf.text_generation(PROMPT, max_new_tokens=8) == PROMPT + want
    assert hf.text_generation(PROMPT, max_new_tokens=8, return_full_text=False) == want
    out = hf.text_generation(PROMPT, max_new_tokens=8, return_full_text=False, details=True)
    d = out.details
    assert out.generated_text == want and d.finish_reason == "length" and d.generated_tokens == 8
    assert d.seed is None and len(d.tokens) == 8 and "".join(t.text for t in d.tokens) == want
    assert all(t.logprob <= 0 and not t.special for t in d.tokens)
    pieces = list(hf.text_generation(PROMPT, max_new_tokens=8, return_full_text=False, stream=True))
    assert "".join(pieces) == want
    streamed = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [s.token.id for s in streamed] == [t.id for t in d.tokens]
    assert all(s.generated_text is None and s.details is None for s in streamed[:-1])
    assert streamed[-1].generated_text == PROMPT + want and streamed[-1].details.finish_reason == "length"
    assert streamed[-1].details.generated_tokens == 8


def test_generate_details_and_stream_events(tiny_server):
    want = greedy(tiny_server, PROMPT, 6)
    r = post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})
    assert r == {"generated_text": want}  # (no details unless asked; /generate: the new text only)
    status, raw, headers = call(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "details": True, "decoder_input_details": True, "top_n_tokens": 3}})
    assert status == 200 and headers["x-generated-tokens"] == "6"
    d = json.loads(raw)["details"]
    n_prompt = int(headers["x-prompt-tokens"])
    assert len(d["prefill"]) == n_prompt and d["prefill"][0]["logprob"] is None
    assert all(p["logprob"] <= 0 for p in d["prefill"][1:])
    assert len(d["top_tokens"]) == 6 and all(len(t) == 3 for t in d["top_tokens"])
    for tok, tops in zip(d["tokens"], d["top_tokens"], strict=True):  # greedy: the token is the top one
        assert tops[0]["id"] == tok["id"] and tops[0]["logprob"] == pytest.approx(tok["logprob"], abs=1e-5)
    status, raw, _ = call(tiny_server, "/generate_stream", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "top_n_tokens": 2}})
    evs = events(raw)
    assert [e["index"] for e in evs] == [1, 2, 3, 4, 5, 6]
    assert [e["token"]["id"] for e in evs] == [t["id"] for t in d["tokens"]]
    assert all(len(e["top_tokens"]) == 2 for e in evs)
    assert evs[-1]["generated_text"] == want and evs[-1]["details"] is None  # (details not asked for)


def test_seeds_are_reported_and_repeat(tiny_server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "do_sample": True, "details": True,
                                              "return_full_text": False}}
    first = post(tiny_server, "/generate", body)
    seed = first["details"]["seed"]
    assert isinstance(seed, int)
    again = post(tiny_server, "/generate", {**body, "parameters": {**body["parameters"], "seed": seed}})
    assert again["generated_text"] == first["generated_text"] and again["details"]["seed"] == seed


def test_best_of_answers_the_highest_mean_logprob(tiny_server):
    r = post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "best_of": 3, "temperature": 1.5, "details": True}})
    d = r["details"]
    assert len(d["best_of_sequences"]) == 2

    def mean(tokens):
        return sum(t["logprob"] for t in tokens) / len(tokens)
    assert all(mean(d["tokens"]) >= mean(s["tokens"]) for s in d["best_of_sequences"])
    assert all(isinstance(s["seed"], int) and s["seed"] != d["seed"] for s in d["best_of_sequences"])
    assert "".join(t["text"] for t in d["tokens"] if not t["special"]) == r["generated_text"]


def test_stop_sequences_stay_and_grammars_hold(tiny_server):
    text = greedy(tiny_server, PROMPT, 12)
    stop = text[3:6]
    r = post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "stop": [stop], "details": True}})
    assert r["generated_text"].endswith(stop) and r["generated_text"] == text[:text.index(stop) + len(stop)]
    assert r["details"]["finish_reason"] == "stop_sequence"
    # a stop sequence that ends inside a token: the text cut there, the last token's text as the text was cut
    tokens = post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
                  )["details"]["tokens"]
    k = next(k for k in range(1, 11) if len(tokens[k + 1]["text"]) > 2)  # (its stop ends inside token k + 1)
    stop = tokens[k]["text"] + tokens[k + 1]["text"][:2]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "stop": [stop], "details": True}}
    r = post(tiny_server, "/generate", body)
    assert r["generated_text"].endswith(stop) and "".join(t["text"] for t in r["details"]["tokens"]) == r[
        "generated_text"]
    evs = events(call(tiny_server, "/generate_stream", body)[1])
    assert "".join(e["token"]["text"] for e in evs) == evs[-1]["generated_text"] == r["generated_text"]
    # a special token before it (its name is a token's text, not the text's)
    r = post(tiny_server, "/generate", {"inputs": "Hello world", "parameters": {
        "max_new_tokens": 30, "do_sample": True, "seed": 18, "temperature": 1.5, "ignore_eos": True, "stop": ["rac"],
        "details": True}})
    texts = [t["text"] for t in r["details"]["tokens"] if not t["special"]]
    assert any(t["special"] for t in r["details"]["tokens"][:-1])
    assert "".join(texts) == r["generated_text"] and r["generated_text"].endswith("rac")
    r = post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "grammar": {"type": "regex", "value": "(yes|no)"}, "details": True}})
    assert r["generated_text"] in ("yes", "no") and r["details"]["finish_reason"] == "eos_token"


def test_refusals_are_tgis(tiny_server, hf):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError, match="`top_p` must be > 0.0 and < 1.0"):
        hf.text_generation(PROMPT, max_new_tokens=4, top_p=1.0)
    status, raw, _ = call(tiny_server, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 999}})
    assert status == 422
    body = json.loads(raw)
    assert body["error_type"] == "validation"
    assert re.search(r"`inputs` tokens \+ `max_new_tokens` must be <= 256\. Given: \d+ `inputs` tokens and 999",
                     body["error"])
    status, raw, _ = call(tiny_server, "/generate", {"inputs": PROMPT}, key=None)
    assert status == 401 and json.loads(raw)["error_type"] == "authentication"
    status, raw, _ = call(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert status == 422 and "adapter_id 'nope' is not loaded" in json.loads(raw)["error"]
    r = post(tiny_server, "/generate", {"inputs": "x " * 400, "parameters": {"max_new_tokens": 2, "truncate": 20,
                                                                          "decoder_input_details": True}})
    assert len(r["details"]["prefill"]) == 20  # (the last 20 tokens kept)
    r = post(tiny_server, "/generate", {"inputs": "x " * 60000, "parameters": {"max_new_tokens": 2, "truncate": 20}})
    assert isinstance(r["generated_text"], str)  # (longer than the context could hold, as text: cut, not refused)
    assert post(tiny_server, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "tiny", "max_new_tokens": 2}})
    for path in ("/invocations", "/tokenize"):  # refused from the head whatever the body: OpenAI's shape (vLLM's)
        for body in ({"inputs": PROMPT}, {"prompt": PROMPT}):
            status, raw, _ = call(tiny_server, path, body, key=None)
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10) as s:  # (the body never comes)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100000\r\n\r\n".encode())
            assert s.recv(65536).startswith(b"HTTP/1.1 401 ")


def test_info_tokenize_and_invocations(tiny_server):
    status, raw, _ = call(tiny_server, "/info")
    info = json.loads(raw)
    assert status == 200 and info["model_id"] == "tiny" and info["max_total_tokens"] == 256
    assert info["max_input_tokens"] == 255 and info["max_best_of"] == MAX_BEST_OF
    toks = post(tiny_server, "/tokenize", {"inputs": PROMPT})
    ids = post(tiny_server, "/tokenize", {"prompt": PROMPT})["tokens"]  # (vLLM's, still)
    assert [t["id"] for t in toks] == ids
    assert "".join(t["text"] for t in toks) == PROMPT and toks[-1]["stop"] == len(PROMPT)
    assert all(PROMPT[t["start"]:t["stop"]] == t["text"] for t in toks)
    want = greedy(tiny_server, PROMPT, 4)
    r = post(tiny_server, "/invocations", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert r == [{"generated_text": PROMPT + want}]  # (as TGI's POST /)
    r = post(tiny_server, "/invocations", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r["choices"][0]["text"] == want  # (vLLM's, still)
    status, raw, _ = call(tiny_server, "/invocations", {"inputs": ""})
    assert status == 422 and json.loads(raw)["error_type"] == "validation"
