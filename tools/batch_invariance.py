"""Does batching change greedy output? Each chat prompt is answered alone (the prefix cache emptied before each),
then all together, then all together again from the prefix cache, then in batches of 8. For each way, it counts
the answers that differ from the alone ones (tokens, or with ``--logprobs`` the top-5 logprobs' bits), with
the times. Ends with one JSON line.

    python tools/batch_invariance.py                      # the default model: some answers change
    python tools/batch_invariance.py --batch-invariant    # none do

Offline (``engine.LLM``), so it measures this checkout's engine, not a server.
"""

from __future__ import annotations

import argparse
import json
import time

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
             "List three prime numbers.", "Who wrote Hamlet?", "What is 17 times 23?", "Describe a cat.",
             "Give me a recipe for pancakes.", "Why is the sky blue?", "Name a famous painter.",
             "What does a CPU do?", "Tell me a joke.", "How do plants grow?", "What is Python?",
             "Translate 'hello' into Spanish.", "Summarize the plot of Cinderella."]


def questions(n: int) -> list[str]:
    """``n`` questions: the list above, then again with a suffix (" Answer briefly.", twice...)."""
    return [q + " Answer briefly." * (i // len(QUESTIONS)) for i, q in
            ((i, QUESTIONS[i % len(QUESTIONS)]) for i in range(n))]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="as the server's (auto: bfloat16 on CPUs with native bf16, else float32)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer, EOS ignored")
    p.add_argument("--batch-invariant", action="store_true", help="tokenmill's batch-invariant mode")
    p.add_argument("--logprobs", action="store_true", help="compare the top-5 logprobs too, bit for bit")
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, batch_invariant=args.batch_invariant)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions(args.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=5 if args.logprobs else None)

    def run(batch: list[str]) -> list:
        return [(o.token_ids, o.logprobs) for o in llm.generate(batch, greedy)]

    def batches(size: int) -> list:
        """The prompts ``size`` at a time, each batch after emptying the prefix cache."""
        out = []
        for i in range(0, len(prompts), size):
            llm.reset_prefix_cache()
            out += run(prompts[i:i + size])
        return out

    seconds: dict[str, float] = {}
    answers: dict[str, list] = {}
    for way, answer in [("alone", lambda: batches(1)), ("batched", lambda: batches(len(prompts))),
                        ("prefix-cached", lambda: run(prompts)),  # (right after: every prompt's blocks cached)
                        ("batches of 8", lambda: batches(8))]:
        start = time.perf_counter()
        answers[way] = answer()
        seconds[way] = time.perf_counter() - start
    changed = {way: sum(a != b for a, b in zip(answers[way], answers["alone"], strict=True))
               for way in answers if way != "alone"}
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens each, batch_invariant={args.batch_invariant}:")
    for way in answers:
        print(f"  {way:14} {seconds[way]:6.1f} s" + ("" if way == "alone" else f"  {changed[way]} answers changed"))
    summary = {"model": llm.config.model, "dtype": args.dtype, "num_prompts": len(prompts),
               "max_tokens": args.max_tokens, "batch_invariant": args.batch_invariant, "logprobs": args.logprobs,
               "changed": changed, "seconds": {k: round(v, 2) for k, v in seconds.items()}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
