"""BERT-style encoders (``engine/models/bert.py``): embeddings and classifier scores equal to
transformers' (fp32, tiny random BERT, RoBERTa, XLM-R, MPNet, DistilBERT and ModernBERT checkpoints) however the inputs are batched
(one-token ones beside long ones, more than one step's worth); each input computed whole, in one step,
none of it from the prefix cache; a BERT cross-encoder's pair typed as its tokenizer types it; the
refusals; and served: the official ``openai`` client's embeddings, ``/rerank`` on a cross-encoder."""

from __future__ import annotations

import json
import os

import pytest
import requests
import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    BertConfig,
    BertTokenizerFast,
    DistilBertConfig,
    ModernBertConfig,
    MPNetConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

from engine import LLM, SamplingParams
from engine.engine import RequestError
from tests.test_server_e2e import Server

KW = dict(device="cpu", dtype="float32")
WORDS = ("the quick brown fox jumps over lazy dog what is capital of france paris a cat sat on mat hello world "
         "search query document about cats dogs").split()
SHAPE = dict(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)


def distilbert(**kw) -> DistilBertConfig:
    """SHAPE in DistilBERT's spelling (dim, n_layers, n_heads, hidden_dim)."""
    return DistilBertConfig(vocab_size=64, dim=48, n_layers=2, n_heads=4, hidden_dim=96, **kw)



def save_encoder(out: str, config, head: bool = False, seed: int = 0, tokenizer: bool = True) -> str:
    """A random-weight checkpoint of ``config`` (its classifier's when ``head``), with a WordPiece tokenizer
    over ``WORDS`` (the vocabulary's first 64 ids)."""
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if head else AutoModel
    model = cls.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    if tokenizer:
        tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]
        tok = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)})
        assert len(tok) == len(tokens) and tok.convert_tokens_to_ids("paris") == tokens.index("paris")
        tok.save_pretrained(out)
    return out


def sentence_transformers_pooling(path: str, mode: str) -> None:
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
                  f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 48, f"pooling_mode_{mode}": True}, f)


def hf_vector(path: str, ids: list[int], pooling: str) -> torch.Tensor:
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(h[0] if pooling == "cls" else h.mean(0), dim=0)


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=1e-5, rtol=1e-4)


# a one-token input (a decode row of the step), short ones, and long ones: 2 x 120 tokens take two steps of 128
INPUTS = [[2, 9, 10, 3], [7], [2, *range(5, 40), 3], [2, *range(5, 63), *range(5, 63), 3], [2, 11, 3],
          [2, *range(63, 4, -1), *range(5, 63), 3]]


@pytest.mark.parametrize("kind,pooling", [("bert", "cls"), ("bert", "mean"), ("xlm-roberta", "cls"),
                                          ("roberta", "mean"), ("mpnet", "mean"), ("distilbert", "mean")])
def test_embeddings_match_transformers(tmp_path, kind, pooling):
    """(MPNet, all-mpnet-base-v2's kind: distances up to 117 cover its exact and logarithmic buckets.)"""
    if kind == "distilbert":
        config = distilbert(max_position_embeddings=128)
    else:
        config = {"bert": BertConfig, "roberta": RobertaConfig, "xlm-roberta": XLMRobertaConfig, "mpnet": MPNetConfig}[
            kind](**SHAPE, max_position_embeddings=128 + 2 * (kind != "bert"))
    path = save_encoder(str(tmp_path / kind), config, seed=len(kind), tokenizer=False)
    if pooling == "mean":
        sentence_transformers_pooling(path, "mean_tokens")
    llm = LLM(path, max_num_batched_tokens=128, **KW)
    assert llm.engine.max_model_len == 128 and llm.engine.pooler.pooling_type == pooling
    assert llm.engine.runner.kv_cache.numel() == 0  # nothing cached: the blocks are names
    first, again = llm.embed(INPUTS), llm.embed(INPUTS)
    for a, b, ids in zip(first, again, INPUTS, strict=True):
        want = hf_vector(path, ids, pooling)
        assert close(a.embedding, want) and close(b.embedding, want), len(ids)
        assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_each_input_is_computed_whole_in_one_step(tmp_path):
    """Budget 128: the 120-token inputs never share a step, and none is cut into chunks."""
    path = save_encoder(str(tmp_path / "bert"), BertConfig(**SHAPE, max_position_embeddings=128), tokenizer=False)
    llm = LLM(path, max_num_batched_tokens=128, **KW)
    eng, steps = llm.engine, []
    schedule = eng.scheduler.schedule

    def spy():
        batch = schedule()
        steps.append([(r.num_computed_tokens, n, r.num_tokens)
                      for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)])
        return batch

    eng.scheduler.schedule = spy
    llm.embed(INPUTS)
    chunks = [c for step in steps for c in step]
    assert sorted(n for _, n, _ in chunks) == sorted(len(i) for i in INPUTS)  # each input once...
    assert all(start == 0 and n == total for start, n, total in chunks)  # ...whole
    assert all(sum(n for _, n, _ in step) <= 128 for step in steps) and len([s for s in steps if s]) >= 3


def test_roberta_positions_skip_padding_tokens(tmp_path):
    """transformers numbers a RoBERTa input's positions past its padding id, skipping padding tokens."""
    config = XLMRobertaConfig(**SHAPE, max_position_embeddings=66)
    path = save_encoder(str(tmp_path / "xlmr"), config, seed=3, tokenizer=False)
    ids = [0, 9, 1, 1, 12, 13, 2]  # (1: the padding id)
    assert close(LLM(path, **KW).embed([ids])[0].embedding, hf_vector(path, ids, "cls"))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    """A BERT cross-encoder (ms-marco-MiniLM's shape, small): one label, two token types."""
    config = BertConfig(**SHAPE, max_position_embeddings=64, num_labels=1)
    return save_encoder(str(tmp_path_factory.mktemp("ce") / "bert-ce"), config, head=True, seed=5)


PAIRS = [("what is the capital of france", "paris"), ("cats", "a cat sat on the mat"),
         ("hello", "the quick brown fox jumps over the lazy dog")]


def hf_pair_scores(path: str, pairs: list[tuple[str, str]]) -> list[float]:
    tok = BertTokenizerFast.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(**tok(q, d, return_tensors="pt")).logits[0, 0].item() for q, d in pairs]


def test_a_bert_cross_encoder_types_the_pair_as_its_tokenizer_does(cross_encoder):
    tok = BertTokenizerFast.from_pretrained(cross_encoder)
    llm = LLM(cross_encoder, **KW)
    assert llm.engine.labels == ("LABEL_0",) and llm.engine.pooler.pooling_type == "cls"
    got = [o.logits[0] for o in llm.classify([tok(q, d)["input_ids"] for q, d in PAIRS])]
    assert got == pytest.approx(hf_pair_scores(cross_encoder, PAIRS), abs=1e-5)


def test_llm_score_as_vllms(cross_encoder, tmp_path):
    """``LLM.score``: a cross-encoder's sigmoid of each pair's score (one query against many documents, or pair by
    pair); an embedding model's cosine similarity of the two texts' vectors."""
    llm = LLM(cross_encoder, **KW)
    docs = [d for _, d in PAIRS]
    want = torch.sigmoid(torch.tensor(hf_pair_scores(cross_encoder, [("cats", d) for d in docs]))).tolist()
    got = llm.score("cats", docs)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-6)
    tok = BertTokenizerFast.from_pretrained(cross_encoder)
    assert got[1].prompt_token_ids == tok("cats", docs[1])["input_ids"]
    pairwise = llm.score([q for q, _ in PAIRS], docs)
    want = torch.sigmoid(torch.tensor(hf_pair_scores(cross_encoder, PAIRS))).tolist()
    assert [o.outputs.score for o in pairwise] == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["a", "b"], docs)
    for bad, why in [(({"text": "a"}, "paris"), "text_1 must be"), (("paris", [None]), "text_2 must be"),
                     (("", "paris"), "text_1 must be"), (("paris", "x", 2.5), "truncate_prompt_tokens"),
                     (("paris", "x", True), "truncate_prompt_tokens"), (("paris", "x", 65), "in \\[1, 64\\]"),
                     (("paris paris", "france", 3), "leaves no token of either text: a pair takes 3 special")]:
        with pytest.raises(ValueError, match=why):
            llm.score(*bad)
    assert len(llm.score("paris paris", "france", 5)[0].prompt_token_ids) == 5  # [CLS] paris [SEP] france [SEP]

    path = save_encoder(str(tmp_path / "bert"), BertConfig(**SHAPE, max_position_embeddings=128), seed=13)
    vectors = {t: hf_vector(path, tok(t)["input_ids"], "cls") for t in ["cats", *docs]}
    got = LLM(path, **KW).score("cats", docs)
    assert [o.outputs.score for o in got] == pytest.approx([float(vectors["cats"] @ vectors[d]) for d in docs],
                                                           abs=1e-5)


@pytest.mark.parametrize("kind", ["xlm-roberta", "mpnet", "distilbert"])
def test_a_classifier_matches_transformers(tmp_path, kind):
    """bge-reranker's kind: XLMRobertaForSequenceClassification (dense, tanh, out_proj over <s>), one type;
    MPNetForSequenceClassification's head is the same; DistilBERT's (sst-2's) has a ReLU and two labels."""
    config = {"xlm-roberta": lambda: XLMRobertaConfig(type_vocab_size=1, **SHAPE, max_position_embeddings=66,
                                                      num_labels=1),
              "mpnet": lambda: MPNetConfig(**SHAPE, max_position_embeddings=66, num_labels=1),
              "distilbert": lambda: distilbert(max_position_embeddings=64, num_labels=2)}[kind]()
    path = save_encoder(str(tmp_path / kind), config, head=True, seed=6, tokenizer=False)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    inputs = [[0, 9, 10, 2, 2, 20, 21, 22, 2], [0, 5, 2], [7]]
    llm = LLM(path, **KW)
    got = [o.logits for o in llm.classify(inputs)]
    with torch.no_grad():
        want = [hf(torch.tensor([i])).logits[0].tolist() for i in inputs]
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=1e-5)
    if config.num_labels > 1:
        with pytest.raises(ValueError, match=f"classifies into {config.num_labels} labels"):
            llm.score("a", "b")


def modernbert(**kw) -> ModernBertConfig:
    """A small ModernBERT: a window of 8 either side in its sliding layers (1, 2: every third is full), weights
    large enough (initializer_range 0.2) that a position's RoPE base or a window's edge shows in the output."""
    return ModernBertConfig(vocab_size=64, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=80, max_position_embeddings=256, local_attention=16, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, initializer_range=0.2, **kw)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_embeddings_match_transformers(tmp_path, pooling):
    path = save_encoder(str(tmp_path / "modernbert"), modernbert(), seed=11, tokenizer=False)
    if pooling == "mean":
        sentence_transformers_pooling(path, "mean_tokens")
    llm = LLM(path, max_num_batched_tokens=256, **KW)
    for out, ids in zip(llm.embed(INPUTS), INPUTS, strict=True):
        assert torch.allclose(torch.tensor(out.embedding), hf_vector(path, ids, pooling), atol=1e-6), len(ids)


def test_a_modernbert_configs_older_spelling_reads_the_same(tmp_path):
    """Checkpoints before transformers 5 name the layer kinds by global_attn_every_n_layers and the RoPE bases
    flat (global_rope_theta, local_rope_theta)."""
    from engine.loader import load_model_config

    path = save_encoder(str(tmp_path / "modernbert"), modernbert(), seed=11, tokenizer=False)
    new = load_model_config(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["layer_types"], cfg["rope_parameters"]
    cfg |= {"global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert load_model_config(path) == new and new.encoder.modern.sliding == {1, 2} and new.encoder.modern.window == 8


def test_what_a_modernbert_config_may_not_say(tmp_path):
    """RoPE scaling (either spelling) and layer kinds other than full_attention and sliding_attention are
    refused (transformers would scale, or refuse); classifier_pooling mean makes only the classifier's pooling
    mean: a bare ModernBertModel still embeds by its first token."""
    path = save_encoder(str(tmp_path / "modernbert"), modernbert(classifier_pooling="mean"), tokenizer=False)
    assert LLM(path, **KW).engine.pooler.pooling_type == "cls"
    linear = {"rope_type": "linear", "factor": 4.0}
    for overrides, why in [({"rope_parameters": {"full_attention": linear}}, "RoPE scaling \\['linear'\\]"),
                           ({"rope_scaling": linear}, "RoPE scaling"),
                           ({"layer_types": ["full_attention", "sliding", "sliding", "full_attention"]}, "layer_types"),
                           ({"layer_types": ["full_attention"]}, "each of its 4 layers"),
                           ({"classifier_pooling": "max"}, "classifier_pooling 'max'")]:
        with pytest.raises(ValueError, match=why):
            LLM(path, hf_overrides=overrides, **KW)


def test_a_modernbert_classifier_matches_transformers(tmp_path):
    """gte-reranker-modernbert's kind: mean pooling (classifier_pooling), then dense, GELU, norm, classifier."""
    path = save_encoder(str(tmp_path / "modernbert-cls"), modernbert(num_labels=2, classifier_pooling="mean"),
                        head=True, seed=12, tokenizer=False)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_num_batched_tokens=256, **KW)
    assert llm.engine.pooler.pooling_type == "mean"
    for out, ids in zip(llm.classify(INPUTS), INPUTS, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert out.logits == pytest.approx(want.tolist(), abs=1e-5), len(ids)


def test_a_roberta_classifiers_stray_pooler_is_not_read(tmp_path):
    """Older RobertaForSequenceClassification checkpoints still hold ``roberta.pooler.dense``, which transformers
    ignores (the head is ``classifier.dense``): it must not be read in the head's place."""
    from safetensors.torch import load_file, save_file

    config = RobertaConfig(**SHAPE, max_position_embeddings=66, num_labels=3, type_vocab_size=1)
    path = save_encoder(str(tmp_path / "roberta-3"), config, head=True, seed=8, tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    torch.manual_seed(9)
    tensors |= {"roberta.pooler.dense.weight": torch.randn(48, 48), "roberta.pooler.dense.bias": torch.randn(48)}
    save_file(tensors, file, metadata={"format": "pt"})
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = [0, 9, 10, 11, 2]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert LLM(path, **KW).classify([ids])[0].logits == pytest.approx(want.tolist(), abs=1e-5)


def test_length_groups_pad_no_prompt_to_a_much_longer_ones_length():
    """A prompt joins the group of the longer ones while it is at least half as long: 120 and 60 together,
    the 8s apart, the 3 alone; a one-token prompt is a decode row, in no group."""
    from engine.attention import build_metadata
    from engine.models.bert import length_groups

    lens = [8, 120, 3, 1, 60, 8]
    _, meta = build_metadata(lens, [0] * len(lens), [[0]] * len(lens), 128, torch.device("cpu"))
    groups = length_groups(meta)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    want = [[1, 4], [0, 5], [2]]  # prompts, longest first
    assert len(groups) == len(want)
    for (rows, index, keep, mask), prompts in zip(groups, want, strict=True):
        assert torch.equal(mask, keep[:, None, None, :])
        assert rows.tolist() == [starts[i] + j for i in prompts for j in range(lens[i])]
        assert keep.sum(1).tolist() == [lens[i] for i in prompts] and keep.shape[1] == lens[prompts[0]]
        assert index[keep].tolist() == list(range(len(rows))) and (index[~keep] == len(rows)).all()


def test_checkpoint_errors_name_the_checkpoints_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_encoder(str(tmp_path / "bert"), BertConfig(**SHAPE, max_position_embeddings=128), tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)
    for change, why in [
        (lambda t: t.pop("encoder.layer.1.output.dense.weight"), "lacks 1 of the model's tensors: "
                                                                  "encoder.layer.1.output.dense.weight$"),
        (lambda t: t.update({"encoder.layer.0.attention.self.key.weight": torch.zeros(40, 48)}),
         "encoder.layer.0.attention.self.key.weight: shape \\(40, 48\\), but the config says \\(48, 48\\)"),
        (lambda t: t.update({"bert.embeddings.LayerNorm.gamma": t["embeddings.LayerNorm.weight"].clone()}),
         "LayerNorm.* and .*LayerNorm.* are the same tensor"),
    ]:
        tensors = dict(good)
        change(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=why):
            LLM(path, **KW)
    # MPNet's and DistilBERT's own names
    for config, name in [(MPNetConfig(**SHAPE, max_position_embeddings=66), "encoder.layer.1.attention.attn.q.weight"),
                         (distilbert(max_position_embeddings=64), "transformer.layer.1.ffn.lin1.weight")]:
        path = save_encoder(str(tmp_path / config.model_type), config, tokenizer=False)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        del tensors[name]
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"lacks 1 of the model's tensors: {name}$"):
            LLM(path, **KW)
    # a classifier's checkpoint: its body's names prefixed (bert.), its head's not
    path = save_encoder(str(tmp_path / "bert-ce"), BertConfig(**SHAPE, max_position_embeddings=64, num_labels=1),
                        head=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["bert.pooler.dense.weight"], tensors["classifier.bias"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 2 of the model's tensors: bert.pooler.dense.weight, classifier.bias$"):
        LLM(path, **KW)


def test_what_an_encoder_refuses(tmp_path):
    path = save_encoder(str(tmp_path / "bert"), BertConfig(**SHAPE, max_position_embeddings=128), tokenizer=False)
    llm = LLM(path, **KW)
    with pytest.raises(RequestError, match="no language-model head") as e:
        llm.generate([[2, 9, 3]], SamplingParams(max_tokens=2))
    assert e.value.status == 400
    small = LLM(path, max_num_batched_tokens=64, **KW)  # raised to the model's length: inputs are computed whole
    assert small.engine.scheduler.max_num_batched_tokens == small.config.max_num_batched_tokens == 128 and close(small.embed([INPUTS[3]])[0].embedding,
                                                                            hf_vector(path, INPUTS[3], "cls"))
    with pytest.raises(ValueError, match="served on one rank"):
        LLM(path, tensor_parallel_size=2, **KW)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key, value, why in [("position_embedding_type", "relative_key", "position_embedding_type"),
                            ("is_decoder", True, "decoder is not supported"), ("hidden_act", "swish", "activation")]:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg | {key: value}, f)
        with pytest.raises(ValueError, match=why):
            LLM(path, **KW)


def test_served_embeddings_and_rerank(tmp_path, cross_encoder):
    """What users touch: the openai client's embeddings from a BERT embedding model (mean pooling, its
    sentence-transformers files), a completion refused with a 400; a cross-encoder's /rerank."""
    import openai

    path = save_encoder(str(tmp_path / "minilm"), BertConfig(**SHAPE, max_position_embeddings=128), seed=7)
    sentence_transformers_pooling(path, "mean_tokens")
    tok = BertTokenizerFast.from_pretrained(path)
    texts = ["the quick brown fox", "hello world", "paris"]
    assert tok.unk_token_id not in tok(texts[0])["input_ids"]  # (words, not [UNK]s)
    s = Server("--model", path, "--served-model-name", "minilm", "--dtype", "float32", startup=120)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        got = client.embeddings.create(model="minilm", input=texts)
        for d, text in zip(got.data, texts, strict=True):
            assert close(d.embedding, hf_vector(path, tok(text)["input_ids"], "mean")), text
        assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
        with pytest.raises(openai.BadRequestError, match="no language-model head"):
            client.completions.create(model="minilm", prompt="hello", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="chat template"):  # (a tokenizer without one)
            client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    finally:
        s.stop()
    s = Server("--model", cross_encoder, "--served-model-name", "ce", "--dtype", "float32", startup=120)
    try:
        docs = [d for _, d in PAIRS]
        r = requests.post(s.url + "/rerank", json={"model": "ce", "query": "cats", "documents": docs}, timeout=30)
        assert r.status_code == 200, r.text
        want = [torch.sigmoid(torch.tensor(x)).item() for x in hf_pair_scores(cross_encoder, [("cats", d) for d in docs])]
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        assert [got[i] for i in range(len(docs))] == pytest.approx(want, abs=1e-5)
        r = requests.post(s.url + "/score", json={"model": "ce", "text_1": "cats", "text_2": docs,
                                                  "truncate_prompt_tokens": 3}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    finally:
        s.stop()
