"""What structured output costs: the same chat requests with and without ``json_schema`` (or, with
``--gbnf``, a GBNF ``grammar`` for the same object).

On the default model (or ``--model``), ``--num-requests`` chat prompts that ask for a person
as JSON, greedy, ``--max-tokens`` each, through ``LLM.generate`` in one batch:

- ``schema_cold``: with the schema, in a fresh engine: the model's token bytes are read, the
  grammar compiled and every state's mask computed as the requests first reach it;
- then, ``--repeats`` times, alternated: ``free``, no schema, each request writing as many tokens
  as it wrote under the schema (EOS ignored), so the batches are the same size step by step; and
  ``schema_warm``, the schema again, every mask cached.

Reported per run (``free`` and ``schema_warm``: the faster of their repeats): output tokens,
seconds, output tokens/s, and for the schema runs how many outputs parse as JSON; then the masks' own cost (``mask_ms``: median and max of computing one
state's mask, timed around ``TokenGrammar.info`` cold) over the vocabulary's size. The last line is one
JSON object.

    python tools/bench_structured.py --num-requests 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "married"],
}
# SCHEMA as a GBNF grammar (keys in order, whitespace between tokens as the schema's automaton allows it)
PERSON_GBNF = r'''
root ::= "{" ws "\"name\":" ws str "," ws "\"age\":" ws int "," ws "\"city\":" ws str "," ws
         "\"hobbies\":" ws "[" ws (str ws ("," ws str ws){0,2})? "]" ws "," ws "\"married\":" ws ("true" | "false") ws "}"
str ::= "\"" ([^"\\\x00-\x1F] | "\\" ["\\/bfnrt]){0,40} "\""
int ::= "-"? ("0" | [1-9] [0-9]{0,15})
ws ::= [ \t\n]{0,20}
'''
PEOPLE = ["a baker from Lyon", "a retired pilot", "a student in Tokyo", "a chess champion", "a painter",
          "a nurse in Berlin", "a farmer", "a software engineer", "a sailor", "a violinist in Vienna"]


def run(llm, prompts: list[str], params) -> tuple[dict, list[int]]:
    """The run's figures, and each output's length."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    parsed = 0
    for o in outs:
        try:
            json.loads(o.text)
            parsed += 1
        except ValueError:
            pass
    return ({"output_tokens": tokens, "seconds": round(seconds, 3), "out_tok_s": round(tokens / seconds, 1),
             "valid_json": parsed, "cut_by_max_tokens": sum(o.finish_reason == "length" for o in outs),
             "requests": len(outs)}, [len(o.token_ids) for o in outs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gbnf", action="store_true", help="hold the output to the same object as a GBNF grammar")
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from engine.structured import TokenGrammar

    timings: list[float] = []
    info = TokenGrammar.info

    def timed_info(self, state):  # times the masks computed, not the cache hits
        cached = state in self._info
        t = time.perf_counter()
        out = info(self, state)
        if not cached:
            timings.append(time.perf_counter() - t)
        return out

    TokenGrammar.info = timed_info
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_requests)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON "
                                         "with name, age, city, hobbies and married."}],
                                       tokenize=False, add_generation_prompt=True)
               for i in range(args.num_requests)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    held = {"grammar": PERSON_GBNF} if args.gbnf else {"json_schema": SCHEMA}
    structured = SamplingParams(max_tokens=args.max_tokens, temperature=0, **held)
    cold, lengths = run(llm, prompts, structured)
    free_params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    runs: dict[str, list[dict]] = {"free": [], "schema_warm": []}
    for _ in range(args.repeats):
        runs["free"].append(run(llm, prompts, free_params)[0])
        runs["schema_warm"].append(run(llm, prompts, structured)[0])
    free, warm = (max(runs[k], key=lambda r: r["out_tok_s"]) for k in ("free", "schema_warm"))
    result = {
        "model": llm.engine.model_name, "vocab_size": llm.engine.vocab_size, "requests": args.num_requests,
        "held_by": next(iter(held)),
        "free": free, "schema_cold": cold, "schema_warm": warm, "runs": runs,
        "masks_computed": len(timings),
        "mask_ms": {"median": round(statistics.median(timings) * 1e3, 2), "max": round(max(timings) * 1e3, 2),
                    "total": round(sum(timings) * 1e3, 1)},
        "warm_vs_free": round(warm["out_tok_s"] / free["out_tok_s"], 3),
    }
    for name in ("free", "schema_cold", "schema_warm"):
        r = result[name]
        print(f"{name:12s} {r['output_tokens']:6d} tokens {r['seconds']:7.2f} s {r['out_tok_s']:8.1f} out tok/s"
              + (f"  valid JSON {r['valid_json']}/{r['requests']} ({r['cut_by_max_tokens']} cut by --max-tokens)"
                 if name != "free" else ""))
    print(f"masks: {len(timings)} computed, median {result['mask_ms']['median']} ms, max {result['mask_ms']['max']} ms "
          f"over a vocabulary of {result['vocab_size']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
