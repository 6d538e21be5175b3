"""Beam search, tokenmill against transformers, in one process: the same prompts, widths and lengths.

``python tools/bench_beam_search.py [--model PATH] [--num-prompts 8] [--beam-width 4] [--max-tokens 32]``

tokenmill runs every prompt's search at once (``LLM.beam_search``: a round of one-token requests per step,
every live beam of every prompt in one batch); transformers runs ``generate(num_beams=k,
num_return_sequences=k)`` one prompt at a time, as it is usually called. Prompts are random tokens (W1's
kind), the model's EOS ignored by both, so that every beam runs to ``--max-tokens``. Prints the time each
took, how many of the k sequences of each prompt are the same (in the same order), and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="time tokenmill alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from engine import LLM, BeamSearchParams
    from engine.model_path import resolve_model_path
    from tools.bench_offline import load_hf

    path = resolve_model_path(args.model)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    k, n = args.beam_width, args.max_tokens
    print(f"{len(prompts)} prompts of {args.prompt_len} tokens, beam width {k}, {n} tokens, length_penalty "
          f"{args.length_penalty}, float32, {torch.get_num_threads()} threads, model {path}", flush=True)

    llm = LLM(path, dtype="float32", device="cpu")
    params = BeamSearchParams(beam_width=k, max_tokens=n, ignore_eos=True, length_penalty=args.length_penalty)
    llm.beam_search([prompts[0][:8]], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    ours = [[s.tokens[len(p):] for s in out.sequences] for p, out in zip(prompts, llm.beam_search(prompts, params),
                                                                           strict=True)]
    tm_s = time.perf_counter() - start
    result = {"prompts": len(prompts), "beam_width": k, "max_tokens": n, "tokenmill_s": round(tm_s, 3)}
    print(f"tokenmill: {tm_s:.2f} s ({len(prompts) * k * n / tm_s:.1f} beam tok/s)", flush=True)
    if not args.skip_hf:
        hf = load_hf(path, torch.float32)
        saved, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None  # (as ignore_eos)

        def generate(prompt: list[int], new: int, width: int) -> list[list[int]]:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                  num_return_sequences=width, max_new_tokens=new, do_sample=False,
                                  length_penalty=args.length_penalty, pad_token_id=0)
            return [row[len(prompt):] for row in out.tolist()]

        try:
            generate(prompts[0][:8], 2, 2)  # warm-up
            start = time.perf_counter()
            theirs = [generate(p, n, k) for p in prompts]
            hf_s = time.perf_counter() - start
        finally:
            hf.generation_config.eos_token_id = saved
        same = sum(a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True))
        best = sum(x[0] == y[0] for x, y in zip(ours, theirs, strict=True))
        print(f"transformers generate(num_beams={k}), one prompt at a time: {hf_s:.2f} s "
              f"({len(prompts) * k * n / hf_s:.1f} beam tok/s)")
        print(f"tokenmill / transformers speed: {hf_s / tm_s:.2f}x; the same sequences: {same} of "
              f"{len(prompts) * k}, the same best: {best} of {len(prompts)}")
        result.update(hf_s=round(hf_s, 3), speedup=round(hf_s / tm_s, 3), same_sequences=same,
                      sequences=len(prompts) * k, same_best=best)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
