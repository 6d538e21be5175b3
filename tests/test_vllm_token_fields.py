"""vLLM's token fields on /v1/completions and /v1/chat/completions, through the official openai client against
``tokenmill serve`` on a tiny random llama (fp32): ``return_token_ids`` (``prompt_token_ids`` and ``token_ids``,
whole and streamed), ``prompt_logprobs`` (every prompt token's logprob and rank, checked against transformers'
``log_softmax``), ``truncate_prompt_tokens`` (the last k prompt tokens, as if sent alone) and ``add_special_tokens``."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from tests.conftest import TINY_KEY

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=256)


def greedy(llm, ids: list[int], n: int) -> list[int]:
    return llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


def test_return_token_ids_completions(tiny_client, llm):
    ids = llm.tokenizer.encode(PROMPT)
    want = greedy(llm, ids, 12)
    r = tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    for c in r.choices:
        assert c.prompt_token_ids == ids and c.token_ids == want
        assert c.text == llm.tokenizer.decode(want)
    plain = tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_dump() and "prompt_token_ids" not in plain.choices[0].model_dump()

    stream = tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, n=2, stream=True,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    got, prompts = [[], []], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            if prompts[c.index] is None:
                prompts[c.index] = c.prompt_token_ids  # the first chunk of each choice
            else:
                assert getattr(c, "prompt_token_ids", None) is None
            got[c.index] += c.token_ids
    assert prompts == [ids, ids] and got == [want, want]


def test_return_token_ids_chat(tiny_client, llm):
    messages = [{"role": "user", "content": "Say something."}]
    ids = llm._codec.apply_chat_template(messages, True, None, None, False)
    r = tiny_client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    want = greedy(llm, ids, 10)
    assert r.prompt_token_ids == ids and r.choices[0].token_ids == want
    stream = tiny_client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == ids and all(getattr(c, "prompt_token_ids", None) is None
                                                     for c in chunks[1:])
    assert [t for c in chunks[1:] for ch in c.choices for t in ch.token_ids] == want


def hf_prompt_logprobs(tiny_llama, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' logprob of each prompt token after the first, and the least and most its rank can be
    within float noise (a random model's tail is full of near ties)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    tok = lp.gather(1, torch.tensor(ids[1:])[:, None])
    return tok.squeeze(1), (lp > tok + 1e-4).sum(1) + 1, (lp > tok - 1e-4).sum(1) + 1


def test_prompt_logprobs(tiny_client, tiny_llama):
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT)
    want_lp, least, most = hf_prompt_logprobs(tiny_llama, ids)
    r = tiny_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i, entry in enumerate(plp[1:]):
        tid = str(ids[i + 1])
        assert next(iter(entry)) == tid  # the prompt token's entry first
        assert entry[tid]["logprob"] == pytest.approx(want_lp[i].item(), abs=1e-4)
        rank = entry[tid]["rank"]
        assert least[i].item() <= rank <= most[i].item()
        tops = sorted((e for k, e in entry.items() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in tops] == [1, 2, 3] and len(entry) == 3 + (rank > 3)
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    echoed = r.choices[0].logprobs.top_logprobs
    # echo shows logprobs=1's, not 3: the likeliest, and the prompt's token where it is another (as vLLM)
    tokens = r.choices[0].logprobs.tokens
    assert echoed[0] is None and all(token in t and len(t) <= 2 for token, t in zip(tokens[1:], echoed[1:],
                                                                                     strict=True))

    chat = tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens(tiny_client, llm):
    long = [(7 * i) % 30000 + 100 for i in range(300)]  # longer than the context
    r = tiny_client.completions.create(model="tiny", prompt=long, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 100, "ignore_eos": True,
                                              "return_token_ids": True})
    assert r.usage.prompt_tokens == 100 and r.choices[0].prompt_token_ids == long[-100:]
    assert r.choices[0].token_ids == greedy(llm, long[-100:], 8)
    text = " ".join(["word"] * 400)
    r = tiny_client.completions.create(model="tiny", prompt=text, max_tokens=4, extra_body={"truncate_prompt_tokens": 50})
    assert r.usage.prompt_tokens == 50
    r = tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4,
                                       extra_body={"truncate_prompt_tokens": 20, "return_token_ids": True})
    assert r.usage.prompt_tokens == 20 and len(r.prompt_token_ids) == 20
    r = tiny_client.completions.create(model="tiny", prompt=long[:200], max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": -1})  # (as many as the context holds)
    assert r.usage.prompt_tokens == 200
    for bad in (0, -2, 257):
        with pytest.raises(openai.BadRequestError) as e:
            tiny_client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("text", ["x" * 3001, "x" * 3003, " " * 3003 + "a", "=" * 3003, "x" * 120000,
                                  "the cat sat on the mat. " * 4000])
def test_truncation_keeps_the_whole_texts_last_tokens(tiny_client, llm, text):
    """Only a long text's end is tokenized, but its last k tokens are the whole text's, even in a run of one
    character that BPE groups from wherever a cut falls."""
    r = tiny_client.completions.create(model="tiny", prompt=text, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True})
    assert r.choices[0].prompt_token_ids == llm.tokenizer.encode(text)[-10:]


def test_websocket_sends_the_prompt_fields(tiny_server, llm):
    import asyncio
    import json

    from websockets.asyncio.client import connect

    async def main():
        async with connect(tiny_server.url.replace("http", "ws") + "/v1/stream",
                           additional_headers={"Authorization": f"Bearer {TINY_KEY}"}) as ws:
            await ws.send(json.dumps({"type": "completion", "id": "a", "prompt": PROMPT, "max_tokens": 3,
                                      "return_token_ids": True, "prompt_logprobs": 1}))
            msgs = []
            while not msgs or msgs[-1]["type"] != "done":
                msgs.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return msgs

    msgs = asyncio.run(main())
    first = msgs[0]
    assert first["type"] == "delta" and first["prompt_token_ids"] == llm.tokenizer.encode(PROMPT)
    assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) == len(first["prompt_token_ids"])
    assert all("prompt_token_ids" not in m for m in msgs[1:])


def test_add_special_tokens_as_vllm_takes_it(tmp_path, smollm_tokenizer_dir):
    """vLLM's ``add_special_tokens``: on /v1/completions true (the default) encodes a text prompt with the
    tokenizer's BOS, false without it (a prompt formatted by hand, its BOS written already), token ids as they are;
    on a chat false (the default: the template writes what it needs), true adds the BOS to what it wrote."""
    import asyncio

    from tokenizers import processors

    from frontends.text import TextCodec
    from frontends.tokenizer import load_tokenizer
    from tests.test_frontend_openai import post
    from tests.test_websocket import serving
    from tools.fake_engine import FakeEngine

    tok = load_tokenizer(smollm_tokenizer_dir)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.bos_token = "<|im_start|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                         special_tokens=[("<|im_start|>", bos)])
    codec = TextCodec(tok)
    text = codec.encode("one two", add_special_tokens=False)
    chat = [{"role": "user", "content": "one two"}]
    templated = codec.apply_chat_template(chat)
    engine = FakeEngine(f"ipc://{tmp_path}/engine.sock")
    engine.start()

    async def main():
        async with serving(engine, codec) as s:
            def prompt(path: str, **body) -> list[int]:
                r = post(s.port, path, {"max_tokens": 1, **body})
                assert r.status_code == 200, r.text
                return engine.adds[-1].prompt_token_ids

            def sent(path: str, **body) -> list[int]:
                return asyncio.to_thread(prompt, path, **body)

            assert await sent("/v1/completions", prompt="one two") == [bos, *text]
            assert await sent("/v1/completions", prompt="one two", add_special_tokens=False) == text
            assert await sent("/v1/completions", prompt=text, add_special_tokens=True) == text
            assert await sent("/v1/chat/completions", messages=chat) == templated
            assert await sent("/v1/chat/completions", messages=chat, add_special_tokens=True) == [bos, *templated]
            for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": chat})):
                r = await asyncio.to_thread(post, s.port, path, {**body, "add_special_tokens": "no"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
    try:
        asyncio.run(main())
    finally:
        engine.stop()
