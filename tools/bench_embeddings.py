"""Embeddings benchmark: tokenmill's ``LLM.embed`` against transformers, and a stream beside them.

Workload: ``--num-docs`` (128) documents of random token ids in [0, 10000), lengths uniform in
[``--min-len``, ``--max-len``] ([32, 512]), seed 0, on ``--model`` (default: the bundled
SmolLM2-135M) with its pooling (``engine.pooling``: last token unless the model says otherwise).

Systems, in this process, each warmed up first:

- ``tokenmill``: ``LLM.embed`` on every document at once (continuous batching, chunked prefill).
- ``hf-batched``: transformers ``AutoModel`` as sentence-transformers runs it: documents sorted by
  length, batches of ``--hf-batch-size`` (32) padded on the right, one forward each, the same
  pooling; ``max_abs_diff`` is the largest difference between its vectors and tokenmill's.

Then the point of serving both from one engine: one greedy generation's step gaps (``--stream-tokens``
tokens) alone, and while every document embeds; ``stream_gap_ms`` is their median and max (the
engine's prefill cap keeps a step with decodes at about twice a decode-only one). An encoder (BERT:
its own length, 512 at most; its [CLS] pooling) generates nothing: no streams then.

    python tools/bench_embeddings.py
    python tools/bench_embeddings.py --model /tmp/qwen3-0.6b --dtype bfloat16 --num-docs 64
    python tools/random_model.py bge-small /tmp/bge-small --dtype float32
    python tools/bench_embeddings.py --model /tmp/bge-small --max-len 510

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams  # noqa: E402
from engine.protocol import PoolingParams  # noqa: E402


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_tokenmill(llm: LLM, docs: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = llm.embed(docs)
    return time.perf_counter() - start, [torch.tensor(o.embedding) for o in outs]


@torch.inference_mode()
def run_hf(model, docs: list[list[int]], batch: int, pooling: str, normalize: bool) -> tuple[float, list[torch.Tensor]]:
    """sentence-transformers' way: by length, padded batches (right padding, masked)."""
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    out: list[torch.Tensor | None] = [None] * len(docs)
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        width = max(len(docs[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(docs[i])] = torch.tensor(docs[i])
            mask[row, :len(docs[i])] = 1
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        lens = mask.sum(1)
        if pooling == "last":
            v = h[torch.arange(len(idx)), lens - 1]
        elif pooling == "cls":
            v = h[:, 0]
        else:
            v = (h * mask[..., None]).sum(1) / lens[:, None]
        if normalize:
            v = F.normalize(v, dim=-1)
        for row, i in enumerate(idx):
            out[i] = v[row]
    return time.perf_counter() - start, out


def stream_gaps(llm: LLM, tokens: int, docs: list[list[int]] | None) -> list[float]:
    """Seconds between one greedy generation's tokens, with ``docs`` embedding meanwhile (or not)."""
    eng = llm.engine
    eng.add_request("stream", list(range(100, 132)), SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                     ignore_eos=True))
    for i, d in enumerate(docs or []):
        eng.add_request(f"doc{i}", d, SamplingParams(max_tokens=1), pooling=PoolingParams())
    times = []
    while eng.has_work():
        for d in eng.step():
            if d.request_id == "stream":
                times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times[1:])]  # from the second token: the first is the prompt's


def _is_encoder(model: str | None) -> bool:
    """Whether ``model`` is a BERT-style encoder (served at its own length)."""
    from engine.models.config import ENCODER_ARCHITECTURES

    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        return False
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f).get("model_type") in ENCODER_ARCHITECTURES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--num-docs", type=int, default=128)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--compare", choices=("none", "hf"), default="hf")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    docs = workload(args.num_docs, args.min_len, args.max_len, args.seed)
    num_tokens = sum(map(len, docs))
    encoder = _is_encoder(args.model)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=None if encoder else max(1024, args.max_len + 64))
    pooler = llm.engine.pooler
    print(f"{len(docs)} documents, {num_tokens} tokens; pooling {pooler.pooling_type}, "
          f"normalize {pooler.normalize}; {args.dtype}", flush=True)
    llm.embed(docs[:2])  # warm-up
    seconds, ours = run_tokenmill(llm, docs)
    summary = {"num_docs": len(docs), "num_tokens": num_tokens, "dtype": args.dtype,
               "tokenmill_seconds": round(seconds, 3), "tokenmill_tok_s": round(num_tokens / seconds, 1)}
    print(f"tokenmill: {seconds:.2f} s, {num_tokens / seconds:.0f} tok/s", flush=True)

    if args.compare == "hf":
        from transformers import AutoModel

        path = llm.engine.runner.facts.model_path
        kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
        folder = os.path.dirname(path) if path.endswith(".gguf") else path
        model = AutoModel.from_pretrained(folder, dtype=getattr(torch, args.dtype), **kw).eval()
        run_hf(model, docs[:2], 2, pooler.pooling_type, pooler.normalize)  # warm-up
        hf_seconds, theirs = run_hf(model, docs, args.hf_batch_size, pooler.pooling_type, pooler.normalize)
        diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        summary |= {"hf_seconds": round(hf_seconds, 3), "hf_tok_s": round(num_tokens / hf_seconds, 1),
                    "speedup": round(hf_seconds / seconds, 2), "max_abs_diff": diff}
        print(f"hf-batched (batch {args.hf_batch_size}): {hf_seconds:.2f} s, {num_tokens / hf_seconds:.0f} tok/s; "
              f"tokenmill {hf_seconds / seconds:.2f}x; max |difference| {diff:.2e}", flush=True)

    if not llm.engine.can_generate:
        print(json.dumps(summary))
        return
    alone = stream_gaps(llm, args.stream_tokens, None)
    beside = stream_gaps(llm, args.stream_tokens, docs)
    gaps = {name: [round(1e3 * statistics.median(g), 1), round(1e3 * max(g), 1)]
            for name, g in (("alone", alone), ("beside_embeddings", beside))}
    summary["stream_gap_ms"] = gaps
    print(f"a stream's token gaps, median / max: alone {gaps['alone'][0]} / {gaps['alone'][1]} ms; while "
          f"{len(docs)} documents embed {gaps['beside_embeddings'][0]} / {gaps['beside_embeddings'][1]} ms")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
