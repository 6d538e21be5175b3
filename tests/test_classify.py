"""Sequence classifiers (``*ForSequenceClassification``: classifiers, reward models): their scores equal
transformers' (fp32, tiny random Llama and Qwen2 ones), offline (``LLM.classify``) and served (vLLM's
``/classify``); a classifier refuses to generate or embed, and a generator to classify."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
import torch
import transformers

from engine import LLM
from tests.conftest import TINY, _save_random
from tests.test_server_e2e import Server

TEXTS = ["I love this movie", "Terrible, never again.", "It was fine, I guess, but the second half dragged on"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_classifier(out_dir: str, tokenizer_dir: str, arch: str, labels: dict | None) -> str:
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)}[arch]
    kw = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if labels else {"num_labels": 1}
    config = cfg_cls(**TINY, pad_token_id=0, **kw)
    torch.manual_seed(3)
    _save_random(model_cls(config).float().eval(), out_dir, tokenizer_dir, gemma=False)
    return out_dir


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return make_classifier(str(tmp_path_factory.mktemp("sentiment")), smollm_tokenizer_dir, "llama", LABELS)


@pytest.fixture(scope="module")
def reward(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return make_classifier(str(tmp_path_factory.mktemp("reward")), smollm_tokenizer_dir, "qwen2", None)


def hf_scores(path: str, texts: list[str]) -> list[list[float]]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(torch.tensor([tok.encode(t)])).logits[0].tolist() for t in texts]


@pytest.mark.parametrize("which", ["sentiment", "reward"])
def test_scores_match_transformers(which, request):
    path = request.getfixturevalue(which)
    want = hf_scores(path, TEXTS)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128)
    outs = llm.classify(TEXTS)
    for out, w in zip(outs, want, strict=True):
        assert out.logits == pytest.approx(w, abs=1e-4)
        if len(w) == 1:
            assert out.probs == pytest.approx([1 / (1 + math.exp(-w[0]))], abs=1e-5) and out.label == "LABEL_0"
        else:
            e = [math.exp(x) for x in w]
            assert out.probs == pytest.approx([x / sum(e) for x in e], abs=1e-5)
            assert out.label == LABELS[max(range(3), key=w.__getitem__)]
    with pytest.raises(Exception, match="sequence classifier"):
        llm.generate(TEXTS[:1])
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.embed(TEXTS[:1])


@pytest.mark.parametrize("cfg", [{"id2label": {"a": "x"}}, {"id2label": ["x", "y"]}, {"id2label": {"1": "x"}},
                                 {"num_labels": 0}])
def test_odd_labels_are_refused_clearly(cfg):
    from engine.models.config import _labels

    with pytest.raises(ValueError, match="id2label"):
        _labels({"architectures": ["LlamaForSequenceClassification"], **cfg})
    assert _labels({"architectures": ["LlamaForCausalLM"], **cfg}) == ()


def test_a_head_that_does_not_fit_its_labels_is_refused(tmp_path, smollm_tokenizer_dir):
    import json

    path = make_classifier(str(tmp_path), smollm_tokenizer_dir, "llama", LABELS)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["id2label"], cfg["label2id"] = {"0": "a", "1": "b"}, {"a": 0, "b": 1}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="score.weight has 3 rows"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_served_classify(sentiment, tiny_llama):
    want = hf_scores(sentiment, TEXTS)
    s = Server("--model", sentiment, "--served-model-name", "sent", "--dtype", "float32", startup=120)
    try:
        status, r = post(s.url, "/classify", {"model": "sent", "input": TEXTS})
        assert status == 200, r
        assert r["object"] == "list" and [d["index"] for d in r["data"]] == [0, 1, 2]
        for d, w in zip(r["data"], want, strict=True):
            e = [math.exp(x) for x in w]
            assert d["probs"] == pytest.approx([x / sum(e) for x in e], abs=1e-5)
            assert d["label"] == LABELS[max(range(3), key=w.__getitem__)] and d["num_classes"] == 3
        assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0
        status, r = post(s.url, "/classify", {"input": TEXTS[0], "activation": False, "truncate_prompt_tokens": 2})
        assert status == 200 and len(r["data"][0]["probs"]) == 3 and r["usage"]["prompt_tokens"] == 2
        status, raw = post(s.url, "/classify", {"input": TEXTS[0], "activation": False})
        assert raw["data"][0]["probs"] == pytest.approx(want[0], abs=1e-4)  # the raw scores
        for path, body, param in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "model"),
                                  ("/v1/embeddings", {"input": "Hi"}, "model"),
                                  ("/rerank", {"query": "a", "documents": ["b"]}, "model"),
                                  ("/classify", {"input": []}, "input")):
            status, r = post(s.url, path, body)
            assert status == 400 and r["error"]["param"] == param, (path, r)
    finally:
        s.close()
    s = Server("--model", tiny_llama, "--dtype", "float32", startup=120)
    try:
        status, r = post(s.url, "/classify", {"input": "Hi"})
        assert status == 400 and r["error"]["param"] == "model" and "does not classify" in r["error"]["message"]
    finally:
        s.close()


def hf_pair_scores(path: str, pairs: list[tuple[str, str]], max_length: int | None = None) -> list[float]:
    """transformers' one-label classifier on each pair, tokenized as its tokenizer pairs two texts (truncated
    as vLLM asks it to where ``max_length`` is given)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    cut = {"truncation": "longest_first", "max_length": max_length} if max_length else {}
    with torch.no_grad():
        return [model(torch.tensor([tok(a, b, **cut)["input_ids"]])).logits[0, 0].item() for a, b in pairs]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


QUERY, DOCS = "Where do cats sleep?", ["Cats sleep in boxes.", "The stock market fell.", "Dogs bark at night."]


def test_a_one_label_classifier_reranks_pairs(reward):
    """A one-label classifier is a cross-encoder: /rerank and /score read each pair as one prompt and give the
    sigmoid of its score, as vLLM does."""
    want = [sigmoid(x) for x in hf_pair_scores(reward, [(QUERY, d) for d in DOCS])]
    s = Server("--model", reward, "--dtype", "float32", startup=120)
    try:
        status, r = post(s.url, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
        assert status == 200, r
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in r["results"]] == order
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
        status, r = post(s.url, "/score", {"text_1": QUERY, "text_2": DOCS})
        assert status == 200 and [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
        status, r = post(s.url, "/score", {"text_1": [QUERY, "b"], "text_2": [DOCS[0], "c"]})
        assert r["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)
        status, r = post(s.url, "/rerank", {"query": QUERY, "documents": ["word " * 3000]})
        assert status == 400 and r["error"]["param"] == "documents", r
        status, r = post(s.url, "/score", {"text_1": "word " * 3000, "text_2": ["a", "b"]})  # (the longer text's)
        assert status == 400 and r["error"]["param"] == "text_1" and "text_1" in r["error"]["message"], r
        # truncated as transformers truncates a pair (the longer text cut from its end first), the query kept
        long = "word " * 3000
        cut = hf_pair_scores(reward, [(QUERY, long)], max_length=12)
        status, r = post(s.url, "/score", {"text_1": QUERY, "text_2": [long], "truncate_prompt_tokens": 12})
        assert status == 200 and r["data"][0]["score"] == pytest.approx(sigmoid(cut[0]), abs=1e-5), r
        assert r["usage"]["prompt_tokens"] == 12
    finally:
        s.close()


@pytest.mark.parametrize("arch", ["qwen3", "granite"])
def test_a_reranker_from_its_yes_and_no_tokens(arch, tmp_path, smollm_tokenizer_dir):
    """Qwen3-Reranker as vLLM serves it (``classifier_from_token: ["no", "yes"]``): the score is the LM head's
    "yes" logit less its "no" logit at the pair's last token (Granite's logits scaled as its LM head's)."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model(str(tmp_path), arch, smollm_tokenizer_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    pairs = [(QUERY, d) for d in DOCS]
    with torch.no_grad():
        want = [(lg[yes] - lg[no]).item() for lg in (hf(torch.tensor([tok(a, b)["input_ids"]])).logits[0, -1]
                                                      for a, b in pairs)]
    overrides = {"architectures": [f"{arch.capitalize()}ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"]}
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, hf_overrides=overrides)
    assert [o.logits[0] for o in llm.classify([tok(a, b)["input_ids"] for a, b in pairs])] == \
        pytest.approx(want, abs=1e-4)
    if arch == "qwen3":
        s = Server("--model", path, "--dtype", "float32", "--hf-overrides", json.dumps(overrides), startup=120)
        try:
            status, r = post(s.url, "/score", {"text_1": QUERY, "text_2": DOCS})
            assert status == 200 and [d["score"] for d in r["data"]] == pytest.approx([sigmoid(x) for x in want],
                                                                                       abs=1e-5)
        finally:
            s.close()
    for odd, match in ((["nope-not-a-token", "yes"], "not tokens"), (["yes", "yes"], "distinct"), ("yes", "list")):
        with pytest.raises(ValueError, match=match):
            LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64,
                hf_overrides={**overrides, "classifier_from_token": odd})
    with pytest.raises(ValueError, match="architecture of a classifier"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64,
            hf_overrides={"classifier_from_token": ["no", "yes"]})
