"""LoRA adapters loaded and unloaded while serving (``max_loras``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
with ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``): an adapter loaded later gives the tokens of the same
adapter loaded at start (``tests/test_lora.py`` checks those against transformers), in recorded CPU graphs and
eager, on two tensor-parallel ranks; a slot is reused only once no request reads it; a name loaded again shares no
prefix-cache block with its last load; refusals say why and leave the engine serving; the server's side through
several frontends and engines, with the openai client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.engine import RequestError
from engine.lora import AdapterError, read_adapter
from tests.conftest import make_tiny_model
from tools.random_lora import make_lora

PROMPTS = [[1, 450, 4996, 17354, 1701, 432], [1, 822, 18755, 29898, 29876], [1, 3681, 338, 263]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=128)


@pytest.fixture(scope="module")
def want(lora_tiny):
    """Each prompt's greedy tokens with each adapter loaded at start, and with none."""
    model, a, b = lora_tiny
    with LLM(model, **KW, lora_modules={"a": a, "b": b}) as llm:
        return {lora: [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)]
                for lora in (None, "a", "b")}


def tokens(llm: LLM, lora, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]


@pytest.mark.parametrize("eager", [False, True], ids=["cpu-graphs", "eager"])
def test_an_adapter_loaded_while_serving_gives_the_tokens_of_one_loaded_at_start(lora_tiny, want, eager):
    """Adapters loaded into two slots: a step computes the slots up to the last one its tokens use (slot 0 alone:
    the first columns of B, read in place), mixes adapters and the model alone; a recorded graph reads weights
    loaded after it was recorded; a slot that held a larger adapter keeps none of it."""
    model, a, b = lora_tiny
    assert len({str(v) for v in want.values()}) == 3
    with LLM(model, **KW, enforce_eager=eager, max_loras=2) as llm:
        assert tokens(llm, None) == want[None]
        llm.engine.load_lora("a", a)
        mixed = llm.generate(PROMPTS * 2, GREEDY, lora_request=[None] * 3 + ["a"] * 3)
        assert [o.token_ids for o in mixed] == want[None] + want["a"]
        llm.engine.load_lora("b", b)
        assert [llm.engine.adapters[n].slot for n in "ab"] == [0, 1]
        assert tokens(llm, "b") == want["b"] and tokens(llm, "a") == want["a"]
        assert tokens(llm, ["b", None, "a"]) == [want["b"][0], want[None][1], want["a"][2]]
        llm.engine.unload_lora("a")
        llm.engine.load_lora("c", b)  # slot 0 again: a's rank-8 matrices on all seven projections cleared
        assert llm.engine.adapters["c"].slot == 0 and tokens(llm, "c") == want["b"]
        if not eager:  # (batch size, slots computed): c's steps replayed the recording a's made
            assert {(3, 0), (3, 1), (3, 2)} <= set(llm.engine.runner.graphs.replays)


def test_vllm_style_offline_lora_requests_load_their_adapter(lora_tiny, want):
    """``LLM(enable_lora=True)`` and vLLM's ``LoRARequest(name, id, path)``: loaded by the first generate, the
    adapter unused longest unloaded when the slots are full."""
    model, a, b = lora_tiny

    class LoRARequest:  # vLLM's fields
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    with LLM(model, **KW, enable_lora=True) as llm:
        assert llm.config.max_loras == 4
        assert tokens(llm, LoRARequest("a", 1, a)) == want["a"]
        assert tokens(llm, [LoRARequest("b", 2, b), None, LoRARequest("a", 1, a)]) == [
            want["b"][0], want[None][1], want["a"][2]]
        assert sorted(llm.engine.adapters) == ["a", "b"]
    with LLM(model, **KW, lora_modules={"a": a}) as llm:  # no loading while serving: a stays as it was
        with pytest.raises(RequestError, match="not loaded while serving"):
            tokens(llm, LoRARequest("a", 1, b))
        assert tokens(llm, LoRARequest("a", 1, a + "/")) == want["a"]  # (the same folder)
    with LLM(model, **KW, enable_lora=True, max_loras=2) as llm:  # full: the adapter unused longest makes room
        assert tokens(llm, LoRARequest("a", 1, a)) == want["a"] and tokens(llm, LoRARequest("b", 2, b)) == want["b"]
        assert tokens(llm, LoRARequest("a", 1, a)) == want["a"]
        assert tokens(llm, LoRARequest("c", 3, b)) == want["b"] and sorted(llm.engine.adapters) == ["a", "c"]
        assert tokens(llm, LoRARequest("a", 1, b)) == want["b"]  # another folder under its name: loaded again
        with pytest.raises(RequestError, match="no free LoRA slot"):  # three at once in two slots
            llm.generate(PROMPTS, GREEDY, lora_request=[LoRARequest(n, 0, a) for n in "xyz"])
        with pytest.raises(RequestError, match="no readable"):  # another folder, refused: the old one stays
            tokens(llm, LoRARequest("x", 1, "/nonexistent"))
        assert tokens(llm, "x") == want["a"]


def test_a_slot_is_reused_only_once_no_request_reads_it(lora_tiny, want):
    """max_loras=1: a second adapter is refused while the first is loaded, and after it is unloaded while one of
    its requests still runs; that request ends with the first adapter's tokens, then the slot takes the second."""
    model, a, b = lora_tiny
    with LLM(model, **KW, max_loras=1) as llm:
        engine = llm.engine
        engine.load_lora("a", a)
        with pytest.raises(RequestError, match="no free LoRA slot: of the 1 of --max-loras, 1 held by a; unload one"):
            engine.load_lora("b", b)
        engine.add_request("r", PROMPTS[0], GREEDY, lora="a")
        out = []
        for d in engine.step():
            out += d.token_ids
        engine.unload_lora("a")
        with pytest.raises(RequestError, match="does not exist"):
            engine.add_request("r2", PROMPTS[1], GREEDY, lora="a")
        with pytest.raises(RequestError, match="of the 1 of --max-loras, 1 by unloaded adapters whose requests "
                                               "still run"):
            engine.load_lora("b", b)
        while engine.has_work():
            for d in engine.step():
                out += d.token_ids
        assert out == want["a"][0]
        engine.load_lora("b", b)
        assert tokens(llm, "b") == want["b"]


def test_a_name_loaded_again_shares_no_cached_block_with_its_last_load(lora_tiny, want):
    model, a, b = lora_tiny
    prompt = list(range(3, 3 + 40))
    with LLM(model, **KW, max_loras=2) as llm:
        llm.engine.load_lora("x", a)
        first = llm.generate([prompt], GREEDY, lora_request="x")[0]
        again = llm.generate([prompt], GREEDY, lora_request="x")[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32 and again.token_ids == first.token_ids
        llm.engine.unload_lora("x")
        llm.engine.load_lora("x", b)
        reloaded = llm.generate([prompt], GREEDY, lora_request="x")[0]
        assert reloaded.num_cached_tokens == 0
    with LLM(model, **KW, lora_modules={"b": b}) as llm:
        assert reloaded.token_ids == llm.generate([prompt], GREEDY, lora_request="b")[0].token_ids


def test_refusals_say_why_and_leave_the_engine_serving(lora_tiny, want, tmp_path, smollm_tokenizer_dir):
    model, a, b = lora_tiny
    with LLM(model, **KW, lora_modules={"a": a}) as llm:  # no max_loras: no loading while serving
        with pytest.raises(RequestError, match="not loaded while serving here: start with --enable-lora and "
                                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"):
            llm.engine.load_lora("b", b)
    narrow = make_tiny_model(str(tmp_path / "narrow"), "llama", None, seed=0, hidden_size=32)
    wrong = make_lora(narrow, str(tmp_path / "narrow-lora"), seed=0)
    nan = make_lora(model, str(tmp_path / "nan"), seed=0)
    weights = load_file(f"{nan}/adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, f"{nan}/adapter_model.safetensors")
    with pytest.raises(AdapterError, match="holds a NaN or a value past"):
        read_adapter("n", nan, 16)
    big = make_lora(model, str(tmp_path / "big"), seed=0, r=32)
    huge = make_lora(model, str(tmp_path / "huge"), seed=0, alpha=1e40)  # finite weights, an infinite scale
    text = make_lora(model, str(tmp_path / "text"), seed=0, alpha="16")
    regex = make_lora(model, str(tmp_path / "regex"), seed=0, alpha_pattern={"q_proj(": 2.0})
    empty = make_lora(model, str(tmp_path / "empty"), seed=0)
    liar = make_lora(model, str(tmp_path / "liar"), seed=0)  # its config's r not its tensors' (PEFT refuses it)
    with open(f"{liar}/adapter_config.json") as f:
        cfg = json.load(f)
    with open(f"{liar}/adapter_config.json", "w") as f:
        json.dump({**cfg, "r": cfg["r"] * 2}, f)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 0),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)},
              f"{empty}/adapter_model.safetensors")
    with LLM(model, **KW, lora_modules={"a": a}, max_loras=2) as llm:
        e = llm.engine
        for name, path, match in [
            ("b", str(tmp_path / "none"), "no readable adapter_config.json"),
            ("w", wrong, r"lora_A and lora_B are \(8, 128\) and \(32, 8\)"),
            ("n", nan, "NaN"),
            ("big", big, "rank 32 passes --max-lora-rank 16"),
            ("huge", huge, r"times its scale, 1.25e\+39\) holds a NaN or a value past float32's largest"),
            ("text", text, "the alpha of model.layers.0.mlp.down_proj is '16', not a number"),
            ("regex", regex, "alpha_pattern or rank_pattern is no map of regular expressions"),
            ("liar", liar, "adapter_config.json says rank 16, its tensors are of rank 8"),
            ("empty", empty, "layer 0 self_attn.q_proj's lora_A has 0 columns, the model's layer 64"),
            ("a", b, "The LoRA adapter 'a' is already loaded"),
            (e.model_name, b, "the served model's name"),
            ("", b, "1 to 256 printable characters"),
            ("a\nb", b, "printable"),
            (e.model_name + " ", b, "no space at either end"),
        ]:
            with pytest.raises(RequestError, match=match) as info:
                e.load_lora(name, path)
            assert info.value.status == 400
        with pytest.raises(RequestError, match="The LoRA adapter 'c' is not loaded") as info:
            e.unload_lora("c")
        assert info.value.status == 404
        assert sorted(e.adapters) == ["a"]
        e.load_lora("b", b)  # the slot the refused ones were tried in: empty, then b's
        assert tokens(llm, "b") == want["b"] and tokens(llm, "a") == want["a"] and tokens(llm, None) == want[None]
        e.unload_lora("a")  # one of lora_modules, too
        assert sorted(e.adapters) == ["b"] and [n for n, _ in e.ready_info().loras] == ["b"]


def test_an_adapter_that_overflows_harms_only_its_own_tokens(lora_tiny, want, tmp_path):
    """A slot whose products are inf (finite weights, ±3e38) beside requests of another slot and of the model
    alone in every step: their tokens are unchanged (masked, not multiplied by zero: inf * 0 is NaN)."""
    model, a, _ = lora_tiny
    big = make_lora(model, str(tmp_path / "big"), seed=3)
    weights = load_file(f"{big}/adapter_model.safetensors")
    save_file({k: w.sign() * 3e38 if "lora_A" in k else w for k, w in weights.items()},
              f"{big}/adapter_model.safetensors")
    with LLM(model, **KW, max_loras=2) as llm:
        llm.engine.load_lora("big", big)
        llm.engine.load_lora("a", a)
        outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=[None, "a", None, "big", "big", "big"])
        assert [o.token_ids for o in outs[:3]] == [want[None][0], want["a"][1], want[None][2]]


def test_weights_past_the_models_dtype_are_refused(lora_tiny, tmp_path):
    big = make_lora(lora_tiny[0], str(tmp_path / "big"), seed=0, alpha=8e5)  # B times 1e5: past float16's 65504
    assert read_adapter("big", big, 16, torch.float32).rank == 8
    with pytest.raises(AdapterError, match="a NaN or a value past float16's largest"):
        read_adapter("big", big, 16, torch.float16)


def test_tensor_parallel_ranks_load_their_share(lora_tiny, want):
    model, a, b = lora_tiny
    with LLM(model, **KW, tensor_parallel_size=2, max_loras=1) as llm:
        with pytest.raises(RequestError, match="no readable"):
            llm.engine.load_lora("a", "/nonexistent")
        llm.engine.load_lora("a", a)
        assert tokens(llm, [None, "a", "a"]) == [want[None][0], want["a"][1], want["a"][2]]
        llm.engine.unload_lora("a")
        llm.engine.load_lora("b", b)
        assert tokens(llm, "b") == want["b"]


def test_served_loading_through_every_frontend_and_engine(lora_tiny, monkeypatch):
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true serve --enable-lora --max-loras 1``, two engines (data parallel)
    behind two frontends on one port, with a key: an adapter loaded through one frontend serves at any (every
    engine loaded it), /v1/models lists it, unloaded it is a 404 everywhere; refusals are OpenAI errors; the
    endpoints need the key. Without the variable there are no such endpoints."""
    import openai
    from openai import OpenAI

    from tests.test_server_e2e import Server

    model, a, b = lora_tiny
    prompt = "The quick brown fox jumps over the lazy dog because"
    with LLM(model, lora_modules={"a": a}) as llm:
        text = {lora: llm.generate([prompt], GREEDY, lora_request=lora)[0].text for lora in (None, "a")}
    assert text[None] != text["a"]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    s = Server("--model", model, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "1",
               "--data-parallel-size", "2", "--api-key", "k", api_server_count=2)
    try:
        def client() -> OpenAI:  # one of its own each time: a connection to either frontend
            return OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=120)

        load = {"lora_name": "a", "lora_path": a}
        assert call(s.url, "/v1/load_lora_adapter", load, key=None)[0] == 401
        assert call(s.url, "/v1/load_lora_adapter", load) == (200, "Success: LoRA adapter 'a' added successfully.")
        for _ in range(4):  # new connections: either frontend, either engine
            # (the frontend that did not take the call lists it once its engines' answer reaches it: a moment later;
            # a CI run under load once listed only "tiny" at once)
            deadline = time.monotonic() + 10
            models = json.loads(call(s.url, "/v1/models")[1])["data"]
            while [m["id"] for m in models] != ["tiny", "a"] and time.monotonic() < deadline:
                time.sleep(0.05)
                models = json.loads(call(s.url, "/v1/models")[1])["data"]
            assert [m["id"] for m in models] == ["tiny", "a"] and models[1]["root"] == a
            r = client().completions.create(model="a", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert (r.model, r.choices[0].text) == ("a", text["a"])
        for body, match, param in [
            ({"lora_name": "b", "lora_path": b}, "no free LoRA slot", "lora_name"),
            ({"lora_name": "a", "lora_path": a}, "already loaded", "lora_name"),
            ({"lora_name": "tiny", "lora_path": a}, "a name of the served model", "lora_name"),
            ({"lora_name": "x" * 257, "lora_path": a}, "1 to 256 characters", "lora_name"),
            ({"lora_name": "a"}, "Missing required field: 'lora_path'", "lora_path"),
        ]:
            status, body_text = call(s.url, "/v1/load_lora_adapter", body)
            error = json.loads(body_text)["error"]
            assert (status, error["param"]) == (400, param) and match in error["message"], (body, body_text)
        unload = {"lora_name": "a"}
        assert call(s.url, "/v1/unload_lora_adapter", unload) == (200, "Success: LoRA adapter 'a' removed "
                                                                       "successfully.")
        status, body_text = call(s.url, "/v1/unload_lora_adapter", unload)
        assert status == 404 and json.loads(body_text)["error"]["param"] == "lora_name"
        for _ in range(4):
            with pytest.raises(openai.NotFoundError, match="'a' does not exist"):
                client().completions.create(model="a", prompt=prompt, max_tokens=2)
        status, body_text = call(s.url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/nonexistent"})
        error = json.loads(body_text)["error"]
        assert (status, error["param"]) == (400, "lora_path") and "no readable adapter_config.json" in error["message"]
        assert call(s.url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": b})[0] == 200  # a's slot
    finally:
        s.close()
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    s = Server("--model", model, "--enable-lora", "--lora-modules", f"a={a}", "--max-loras", "3")
    try:
        assert call(s.url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": b}, key=None)[0] == 404
        assert "LoRA: 1 slots of rank 8 on the device, 1 taken" in s.log()
    finally:
        s.close()


def call(url: str, path: str, body: dict | None = None, key: str | None = "k") -> tuple[int, str]:
    """A POST of ``body`` (a GET without), on a connection of its own: (status, body)."""
    req = urllib.request.Request(url + path, None if body is None else json.dumps(body).encode(),
                                 {"content-type": "application/json", **({"authorization": f"Bearer {key}"}
                                                                         if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_adapter_read_that_never_ends_is_given_up_as_a_400(monkeypatch):
    """A folder whose read hangs (a FIFO, a stalled mount) is the caller's 400 after ``LORA_READ_SECONDS``, well
    inside the frontend's wait (review: after 120 s the caller got 503 "engine unavailable", every update queued
    behind it waited, and both were loaded once the read came back); what the read gives later is dropped, and a
    read that ends in time is as before."""
    import asyncio
    import threading

    from engine import server
    from engine.engine import RequestError

    monkeypatch.setattr(server, "LORA_READ_SECONDS", 0.2)
    release = threading.Event()

    def stuck(name, path):
        release.wait(10)
        return "loaded late"

    async def main():
        start = time.monotonic()
        with pytest.raises(RequestError) as e:
            await server._read_in_time(stuck, "f", "/mnt/stalled")
        assert (e.value.status, e.value.param) == (400, "lora_path") and "within 0.2s" in e.value.message
        assert time.monotonic() - start < 2
        release.set()  # (its late result: dropped, no error in the loop)
        await asyncio.sleep(0.1)
        assert await server._read_in_time(lambda name, path: (name, path), "a", "/ok") == ("a", "/ok")
        with pytest.raises(RequestError, match="not served"):
            await server._read_in_time(refused, "b", "/b")

    def refused(name, path):
        raise RequestError(400, "invalid_request_error", "not served")
    asyncio.run(main())
    # a read that ends after the engine's loop closed (shutdown): nobody asks, and its thread raises nothing
    late, errors = threading.Event(), []
    monkeypatch.setattr(threading, "excepthook", errors.append)

    async def shut_down_while_reading():
        with pytest.raises(RequestError):
            await server._read_in_time(lambda name, path: late.wait(10), "g", "/mnt/stalled")
    asyncio.run(shut_down_while_reading())
    late.set()
    deadline = time.monotonic() + 5
    while any(t.name == "lora-read-g" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not errors
