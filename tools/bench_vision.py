"""What images cost: a random LLaVA (llava-1.5's layout: a CLIP tower, a two-layer projector, a Llama) in one
run, offline, greedy:

- the frontend's share: decoding a JPEG data URL and making its pixels (``frontends.images``);
- time to first token of a prompt holding an image against a text prompt of as many tokens (the vision tower's
  share), and of the same image asked about again (its blocks from the prefix cache);
- output tokens per second for requests that each hold an image of their own, against the same requests as text;
- the longest gap between a decoding stream's tokens while such a burst of image requests arrives, against a burst
  of the same requests as text (the scheduler counts an image's positions against a step's prompt budget).

Rounds alternate the cases, so the ratios within one run are what to read on a noisy machine.

    python3 tools/bench_vision.py [--model DIR] [--rounds 3] [--num-requests 8]

Without ``--model`` it builds one (its tower CLIP ViT-B/16 at 224 pixels: 196 tokens an image, its language model
SmolLM2-135M's shape, SmolLM2's tokenizer with ``<image>`` added) under ``--work-dir``. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOWER = dict(model_type="clip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=12, image_size=224, patch_size=16)


def build(out_dir: str) -> str:
    """A random LLaVA in the shape above (skipped where ``out_dir`` has one)."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from engine.model_path import default_model_path
    from tools.random_model import SHAPES

    text = LlamaConfig(**(SHAPES["smollm2-135m"][1] | {"vocab_size": 49153, "bos_token_id": 1, "eos_token_id": 2}))
    cfg = LlavaConfig(text_config=text.to_dict(), vision_config=TOWER, image_token_index=49152, image_seq_length=196)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(out_dir)
    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(out_dir)
    CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(out_dir)
    return out_dir


def jpeg_url(seed: int, size=(480, 640)) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size[0] // 16, size[1] // 16, 3), dtype=np.uint8)  # blocks: a photo-sized file
    buf = io.BytesIO()
    Image.fromarray(base).resize(size[::-1]).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a LLaVA folder (default: build a random one in --work-dir)")
    ap.add_argument("--work-dir", default="/tmp/tokenmill-bench-vision")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--compare-hf", action="store_true",
                    help="also transformers' LLaVA (generate(), one request at a time) on each round's image requests: "
                         "its tok/s, and how many of its greedy tokens tokenmill's match")
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from frontends import images
    from frontends.images import ImageProcessor, open_image
    from frontends.media import data_bytes

    model = args.model or build(args.work_dir)
    proc = ImageProcessor.load(model)
    urls = [jpeg_url(i) for i in range(args.rounds * 2 * args.num_requests)]  # each image asked about once
    t = time.perf_counter()
    for u in urls:
        proc.pixels(open_image(data_bytes(u)))
    decode_ms = (time.perf_counter() - t) / len(urls) * 1e3

    llm = LLM(model, dtype=args.dtype)
    vision = llm.engine.vision
    question = "USER: <image>\nWhat is in this picture? ASSISTANT:"
    n_text = len(llm.tokenizer.encode(question)) - 1 + vision.num_tokens
    words = " ".join(f"w{i}" for i in range(4 * n_text))
    text_ids = llm.tokenizer.encode(words)[:n_text]  # a text prompt as long as the image's

    def first_token(prompt) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        return time.perf_counter() - t

    outputs = []

    def throughput(prompts) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True))
        outputs.append(outs)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)

    def stream_gap(burst: list) -> float:
        """The longest gap between a stream's tokens while ``burst`` (image URLs, or token ids) arrives beside it."""
        eng, q = llm.engine, llm.tokenizer.encode(question)
        eng.add_request("stream", [3] + text_ids[:40], SamplingParams(max_tokens=4000, temperature=0.0,
                                                                      ignore_eos=True))
        for _ in range(3):
            eng.step()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, item in enumerate(burst):
            if isinstance(item, str):
                ids, at = images.expand(q, 1, vision.image_token_id, vision.num_tokens)
                eng.add_request(f"b{i}", ids, params, images=images.inputs(
                    at, [proc.pixels(open_image(data_bytes(item)))], vision.num_tokens))
            else:
                eng.add_request(f"b{i}", item, params)
        gaps, last = [], time.perf_counter()
        while len(eng.requests) > 1:
            if any(d.request_id == "stream" for d in eng.step()):
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()
        eng.abort("stream")
        return max(gaps)

    hf = None
    if args.compare_hf:
        import torch
        from transformers import LlavaForConditionalGeneration

        hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=llm.engine.runner.dtype).eval()
    agree = [0, 0]

    def hf_throughput(batch, outs) -> float:
        t = time.perf_counter()
        for prompt, out in zip(batch, outs, strict=True):
            image = open_image(data_bytes(prompt["multi_modal_data"]["image"]))
            pixels = torch.from_numpy(proc.pixels(image))[None].to(hf.dtype)
            with torch.inference_mode():
                ids = hf.generate(torch.tensor([out.prompt_token_ids]), pixel_values=pixels, do_sample=False,
                                  max_new_tokens=args.output_len, min_new_tokens=args.output_len)
            theirs = ids[0, len(out.prompt_token_ids):].tolist()
            agree[0] += next((i for i, (a, b) in enumerate(zip(theirs, out.token_ids, strict=True)) if a != b), len(theirs))
            agree[1] += len(theirs)
        return len(batch) * args.output_len / (time.perf_counter() - t)

    first_token([4] + text_ids[:-1])  # (warm-up)
    fresh = iter(urls)
    cases: dict[str, list[float]] = {"ttft image": [], "ttft text": [], "ttft same image": [], "tok/s images": [],
                                     "tok/s text": [], "gap beside images": [], "gap beside text": []}
    # (and "tok/s images, HF" with --compare-hf)
    for r in range(args.rounds):
        url = next(fresh)
        cases["ttft image"].append(first_token({"prompt": question, "multi_modal_data": {"image": url}}))
        cases["ttft same image"].append(first_token({"prompt": question, "multi_modal_data": {"image": url}}))
        cases["ttft text"].append(first_token([r + 5] + text_ids[:-1]))  # (its own first token: nothing cached)
        batch = [{"prompt": question, "multi_modal_data": {"image": next(fresh)}}
                 for _ in range(args.num_requests - 1)]
        cases["tok/s images"].append(throughput(batch))
        if hf is not None:
            cases.setdefault("tok/s images, HF", []).append(hf_throughput(batch, outputs[-1]))
        cases["tok/s text"].append(throughput([[r + 100, i + 9] + text_ids[:-2] for i in range(len(batch))]))
        cases["gap beside images"].append(stream_gap([next(fresh) for _ in range(len(batch))]))
        cases["gap beside text"].append(stream_gap([[r + 200, i + 9] + text_ids[:-2] for i in range(len(batch))]))
    result = {"model": model, "image_tokens": vision.num_tokens, "prompt_tokens": n_text,
              "frontend_ms_per_image": round(decode_ms, 2)}
    print(f"{'case':<20}" + "".join(f"round {r:<6}" for r in range(args.rounds)) + "median")
    for name, values in cases.items():
        scale = 1.0 if name.startswith("tok/s") else 1e3
        print(f"{name:<20}" + "".join(f"{v * scale:<12.1f}" for v in values) + f"{statistics.median(values) * scale:.1f}"
              + (" ms" if scale > 1 else ""))
        result[name.replace(", ", "_").replace(" ", "_").replace("/", "_per_")] = [round(v * scale, 2) for v in values]
    print(f"frontend: {decode_ms:.1f} ms an image (a 640x480 JPEG data URL decoded, resized, normalized)")
    if hf is not None:
        result["greedy_agreement_with_hf"] = round(agree[0] / agree[1], 4)
        print(f"greedy agreement with transformers (tokens before the first difference): {agree[0] / agree[1]:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
