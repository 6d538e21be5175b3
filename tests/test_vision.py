"""Images in prompts (LLaVA): pixels as transformers makes them, greedy output as transformers' LLaVA gives it
(one image, two, none; chunked prefill through an image; preemption; prefix caching keyed by the image), and
the served API: chat, Responses and Messages with data URLs through the official clients, and the 400s."""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.request

import numpy as np
import pytest

from engine import LLM, SamplingParams
from frontends.images import ImageProcessor, lists_contents
from tests.conftest import LLAVA_TEMPLATE, make_tiny_llava
from tests.test_server_e2e import Server, openai_client

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


def picture(seed: int, size=(40, 52), mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, (*size, channels), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if mode == "L" else a, mode)


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def hf_greedy(folder: str, ids: list[int], pixels: list[np.ndarray], n: int) -> list[int]:
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    kw = {"pixel_values": torch.from_numpy(np.stack(pixels))} if pixels else {}
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def llm(tiny_llava):
    with LLM(tiny_llava, dtype="float32") as llm:
        yield llm


def test_pixels_match_transformers_image_processor(tiny_llava, tmp_path):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    ours, theirs = ImageProcessor.load(tiny_llava), CLIPImageProcessorPil.from_pretrained(tiny_llava)
    siglip = SiglipImageProcessorPil(size={"height": 24, "width": 24})
    siglip.save_pretrained(tmp_path)
    ours_s = ImageProcessor.load(str(tmp_path))
    for i, (size, mode) in enumerate([((40, 52), "RGB"), ((64, 30), "RGBA"), ((31, 31), "L"), ((300, 7), "RGB")]):
        im = picture(i, size, mode)
        a = ours.pixels(im)
        assert a.shape == (3, 30, 30) and a.dtype == np.float32
        assert np.array_equal(a, theirs(im, return_tensors="np")["pixel_values"][0])
        assert np.array_equal(ours_s.pixels(im), siglip(im, return_tensors="np")["pixel_values"][0])


def test_greedy_matches_transformers_with_one_two_and_no_images(llm, tiny_llava):
    a, b = picture(1), picture(2, (64, 30))
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": a}},
               {"prompt": "USER: <image>\n<image>\nWhich is brighter? ASSISTANT:",
                "multi_modal_data": {"image": [a, data_url(b)]}},
               "USER: Hello there ASSISTANT:"]
    outs = llm.generate(prompts, GREEDY)
    proc = ImageProcessor.load(tiny_llava)
    for out, pics in zip(outs, ([a], [a, b], []), strict=True):
        assert out.prompt_token_ids.count(49152) == 25 * len(pics)  # each image's 25 placeholders
        assert out.token_ids == hf_greedy(tiny_llava, out.prompt_token_ids, [proc.pixels(p) for p in pics], 10)
    assert outs[0].token_ids != llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": b}}],
                                             GREEDY)[0].token_ids  # the image is read


def test_chunked_prefill_through_an_image_preemption_and_prefix_cache(llm, tiny_llava):
    images = [picture(i) for i in range(4)]
    prompts = [{"prompt": f"USER: Look, {i}: <image>\nDescribe it. ASSISTANT:", "multi_modal_data": {"image": im}}
               for i, im in enumerate(images)]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    # chunks of 8 tokens cut each image's 25 placeholders in four; 7 blocks of 16 hold two prompts, not two answers
    with LLM(tiny_llava, dtype="float32", max_num_batched_tokens=8, num_kv_blocks=7,
             enable_prefix_caching=False) as small:
        assert [o.token_ids for o in small.generate(prompts, GREEDY)] == want
        assert small.engine.scheduler.num_preemptions > 0
    # the same image again is served from the prefix cache; another image behind the same text is not
    same = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": images[0]}}] * 2, GREEDY)
    again = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": images[0]}}], GREEDY)[0]
    fresh = picture(11)  # (not seen before by this LLM)
    other = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": fresh}}], GREEDY)[0]
    assert again.num_cached_tokens >= 16 * (len(again.prompt_token_ids) // 16) - 16 > 0
    assert again.token_ids == same[0].token_ids
    assert other.num_cached_tokens < 16  # only the block before the image: "USER: " and the image's first
    assert other.token_ids == hf_greedy(tiny_llava, other.prompt_token_ids,
                                        [ImageProcessor.load(tiny_llava).pixels(fresh)], 10)


def test_chat_writes_images_for_list_and_string_templates(llm, tiny_llava, tmp_path, smollm_tokenizer_dir):
    im = picture(3)
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}},
                                        {"type": "text", "text": "What is in the picture?"}]}]
    out = llm.chat(msg, GREEDY)[0]
    direct = llm.generate([{"prompt": "USER: <image>\nWhat is in the picture? ASSISTANT:",
                            "multi_modal_data": {"image": im}}], GREEDY)[0]
    assert out.prompt_token_ids == direct.prompt_token_ids and out.token_ids == direct.token_ids
    assert lists_contents(LLAVA_TEMPLATE) and not lists_contents(llm.tokenizer.chat_template.replace(
        "message['content']", "x"))
    # a template that reads contents as strings (SmolLM2's): the image token before the message's text
    folder = make_tiny_llava(str(tmp_path / "plain"), smollm_tokenizer_dir, template=None)
    with LLM(folder, dtype="float32") as plain:
        out = plain.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                       {"type": "image_pil", "image_pil": im}]}], GREEDY)[0]
        text = plain.tokenizer.decode(out.prompt_token_ids)
        assert "<|im_start|>user\n" + "<image>" * 25 + "\nHi<|im_end|>" in text
        assert out.token_ids == hf_greedy(folder, out.prompt_token_ids, [ImageProcessor.load(folder).pixels(im)], 10)


def test_a_template_that_reads_parts_in_order_gets_them_in_order(tiny_llava):
    from frontends.openai_params import parse_messages
    from frontends.text import TextCodec
    from frontends.tokenizer import load_tokenizer

    codec = TextCodec(load_tokenizer(tiny_llava))
    codec.tokenizer.chat_template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                                     "[{{ '<image>' }}]{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
    codec.use_images(49152)
    messages = parse_messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "before "}, image_part("data:,"), {"type": "text", "text": " after"}]}]})
    assert codec.tokenizer.decode(codec.apply_chat_template(messages, add_generation_prompt=False)) == \
        "before [<image>] after"


def test_decoding_is_charged_by_pixels_and_a_requests_pixels_are_bounded():
    from PIL import Image

    from frontends import images

    def png(image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        return buf.getvalue()

    clip = images.ImageProcessor({"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                                  "do_center_crop": True})
    big = png(Image.new("1", (7000, 7000)))  # 49 megapixels in a few kilobytes
    small = images.open_image(png(picture(0)))
    assert images.cost([images.open_image(big)], clip) > 100 * images.cost([small], clip) > 0  # (before decoding)
    with pytest.raises(images.ImageError, match="million pixels in all"):
        images.cost([images.open_image(big)] * 3, clip)
    with pytest.raises(images.ImageError, match="at most 50 million"):
        images.open_image(png(Image.new("1", (8000, 8000))))
    # 1x200000 in 467 bytes: resized by its shortest edge, 336x67200000 (tens of GB): refused before decoding
    with pytest.raises(images.ImageError, match="resized to 336x67200000 for this model: at most 50 million"):
        images.cost([images.open_image(png(Image.new("L", (1, 200_000))))], clip)
    assert images.cost([images.open_image(png(Image.new("L", (4000, 10))))], clip) > 134_400 * 336 // 30  # (charged so)


def test_bad_images_are_refused_offline(llm, tiny_llama):
    with pytest.raises(ValueError, match="placeholders for 2 images"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": [picture(0), picture(1)]}}], GREEDY)
    with pytest.raises(ValueError, match="one of them"):
        llm.generate([{"prompt": PROMPT, "prompt_token_ids": [1]}], GREEDY)
    with pytest.raises(Exception, match="not in text"):  # the token typed, no image
        llm.generate([PROMPT], GREEDY)
    with LLM(tiny_llama) as text_only, pytest.raises(ValueError, match="does not read images"):
        text_only.generate([{"prompt": "<image>", "multi_modal_data": {"image": picture(0)}}], GREEDY)


# ---------------------------------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of images, served over HTTP on 127.0.0.1 too (``/moved`` redirects to ``/cat.png``, ``/away`` to
    another host)."""
    import http.server
    import threading

    folder = tmp_path_factory.mktemp("media")
    picture(7).save(folder / "cat.png")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(folder), **kw)

        def do_GET(self):
            if self.path in ("/moved", "/away"):
                self.send_response(302)
                self.send_header("Location", "/cat.png" if self.path == "/moved" else "http://localhost:1/cat.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_media_sources(media):
    import asyncio

    from frontends.images import ImageError
    from frontends.media import MediaReader, MediaSources

    folder, base = media
    png = (folder / "cat.png").read_bytes()
    reader = MediaReader(MediaSources(("127.0.0.1",), str(folder)))

    async def read(url, r=reader):
        return await r.read(url)

    for url in (f"{base}/cat.png", f"{base}/moved", f"file://{folder}/cat.png", data_url(picture(7))):
        assert asyncio.run(read(url)) == png
    os.mkfifo(folder / "pipe")
    for url, message in [(f"{base}/nothing.png", "HTTP 404"), (f"{base}/away", "only from 127.0.0.1"),
                         (f"file://{folder}/pipe", "regular file"), (f"file://{folder}", "regular file"),
                         (f"file://{folder}/../etc/passwd", "only from under"), ("http://example.com/a.png",
                                                                                  "only from 127.0.0.1"),
                         ("ftp://127.0.0.1/a.png", "data:image"), ("data:image/png;base64,!", "not valid base64")]:
        with pytest.raises(ImageError, match=message):
            asyncio.run(read(url))
    for url, message in [(f"{base}/cat.png", "--allowed-media-domains"), (f"file://{folder}/cat.png",
                                                                        "--allowed-local-media-path"),
                         (f"file://elsewhere{folder}/cat.png", "local path"), (f"file://{folder}/x%00.png", "local path")]:
        with pytest.raises(ImageError, match=message):
            asyncio.run(read(url, MediaReader(MediaSources((), str(folder)) if message == "local path"
                                              else MediaSources())))


def test_a_server_dripping_bytes_is_cut_off_at_the_deadline(monkeypatch):
    import asyncio
    import socket
    import threading
    import time

    from frontends import media
    from frontends.images import ImageError

    monkeypatch.setattr(media, "FETCH_SECONDS", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip():  # a status line, then a header a byte at a time, forever
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while not stop.wait(0.1):
            try:
                conn.sendall(b"x")
            except OSError:
                break
        conn.close()

    threading.Thread(target=drip, daemon=True).start()
    reader = media.MediaReader(media.MediaSources(("127.0.0.1",)))
    started = time.monotonic()
    with pytest.raises(ImageError, match="took longer than 1 s"):
        asyncio.run(reader.read(f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"))
    assert time.monotonic() - started < 3
    stop.set()
    listener.close()


@pytest.mark.parametrize("reply", [b"garbage\r\n\r\n", b"\x89PNG\r\n\x1a\n", b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000,
                                   b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_a_malformed_response_is_the_clients_400(reply):
    import asyncio
    import socket
    import threading

    from frontends import media
    from frontends.images import ImageError

    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(reply)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    reader = media.MediaReader(media.MediaSources(("127.0.0.1",)))
    with pytest.raises(ImageError, match="cannot fetch an image from 127.0.0.1"):
        asyncio.run(reader.read(f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"))
    listener.close()


@pytest.fixture(scope="module")
def server(tiny_llava, media):
    s = Server("--model", tiny_llava, "--served-model-name", "llava", "--dtype", "float32",
               "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "127.0.0.1",
               "--allowed-local-media-path", str(media[0]))
    yield s
    s.close()


def test_served_images_from_urls_and_files(server, media):
    folder, base = media
    client = openai_client(server)
    want = chat(client, image_part(data_url(picture(7))), "Hi").choices[0].message.content
    for url in (f"{base}/cat.png", f"file://{folder}/cat.png"):
        assert chat(client, image_part(url), "Hi").choices[0].message.content == want


def test_served_an_image_past_the_body_limit_is_a_413_naming_the_flag(server, tiny_llava):
    """A data: URL past --max-body-bytes (8 MiB: an image of 6) is a 413 that names the flag (review: the README let
    an image have 20 MiB, which no body could carry); with --max-body-bytes 32M it is read."""
    import openai

    url = data_url(picture(3, size=(1800, 1800)))  # (noise: a 9.3 MiB PNG, 12.4 MiB as base64)
    assert 8 << 20 < len(url) < 32 << 20
    with pytest.raises(openai.APIStatusError) as e:
        chat(openai_client(server), image_part(url), "Hi")
    assert e.value.status_code == 413 and "--max-body-bytes" in e.value.message
    big = Server("--model", tiny_llava, "--served-model-name", "llava", "--dtype", "float32", "--max-body-bytes", "32M")
    try:
        small = chat(openai_client(big), image_part(data_url(picture(3))), "Hi")
        assert chat(openai_client(big), image_part(url), "Hi").usage.prompt_tokens == small.usage.prompt_tokens
    finally:
        big.close()


def chat(client, *parts, **kw):
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return client.chat.completions.create(model="llava", messages=[{"role": "user", "content": content}],
                                          max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}, **kw)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_served_chat_responses_and_messages_read_images(server, llm):
    import anthropic

    im = picture(5)
    url = data_url(im, "JPEG")
    want = llm.chat([{"role": "user", "content": [image_part(url), {"type": "text", "text": "Describe it."}]}],
                    GREEDY)[0]
    client = openai_client(server)
    r = chat(client, image_part(url), "Describe it.")
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.choices[0].message.content == want.text
    stream = chat(client, image_part(url), "Describe it.", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    r = client.responses.create(model="llava", max_output_tokens=10, temperature=0.0, extra_body={"ignore_eos": True},
                                input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                                    {"type": "input_text", "text": "Describe it."}]}])
    assert r.output_text == want.text
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    b64 = url.split(",", 1)[1]
    m = ac.messages.create(model="llava", max_tokens=10, extra_body={"temperature": 0.0, "ignore_eos": True},
                           messages=[{"role": "user", "content": [
                               {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64}},
                               {"type": "text", "text": "Describe it."}]}])
    assert m.content[0].text == want.text  # (the image's blocks cached by the calls before: Anthropic's count apart)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(want.prompt_token_ids)
    # counted as they would run: /tokenize and count_tokens
    body = {"model": "llava", "messages": [{"role": "user", "content": [image_part(url), {"type": "text",
                                                                                        "text": "Describe it."}]}]}
    request = urllib.request.Request(server.url + "/tokenize", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.load(r)["tokens"] == want.prompt_token_ids
    assert ac.messages.count_tokens(model="llava", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64}},
        {"type": "text", "text": "Describe it."}]}]).input_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("parts, message", [
    ([image_part("https://example.com/cat.png"), "Hi"], "only from 127.0.0.1"),
    ([image_part("data:image/png;base64,!!!!"), "Hi"], "not valid base64"),
    ([image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode()), "Hi"], "cannot read"),
    ([image_part(data_url(picture(0)))] * 3 + ["Hi"], "at most 2 images"),
    ([image_part(data_url(picture(0))), "Is <image> here?"], "placeholders for 1 images"),
    (["Is <image> here?"], "placeholders for 0 images"),
])
def test_served_bad_images_get_a_400_and_the_server_goes_on(server, parts, message):
    import openai

    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match=message) as e:
        chat(client, *parts)
    assert e.value.body["param"] == "messages"
    assert chat(client, image_part(data_url(picture(0))), "Hi").choices[0].finish_reason == "length"


def test_the_image_token_in_a_completions_prompt_is_refused(server):
    import openai

    with pytest.raises(openai.BadRequestError, match="not in text") as e:
        openai_client(server).completions.create(model="llava", prompt="a <image> b", max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="cannot be embedded") as e:  # (by its ids: the engine's)
        openai_client(server).embeddings.create(model="llava", input=[[5, 49152, 6]])  # (tiny_llava's image token)
    assert e.value.body["param"] == "input"


def test_an_assistants_image_is_refused(server):
    import openai

    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="image_url parts"):
        client.chat.completions.create(model="llava", max_tokens=2, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [image_part(data_url(picture(0)))]}, {"role": "user", "content": "?"}])


def test_under_tensor_parallelism_text_is_served_and_images_refused(llm, tiny_llava):
    text = llm.generate(["USER: Hello there ASSISTANT:"], GREEDY)[0].token_ids
    with LLM(tiny_llava, dtype="float32", tensor_parallel_size=2) as tp:
        assert tp.generate(["USER: Hello there ASSISTANT:"], GREEDY)[0].token_ids == text
        with pytest.raises(ValueError, match="under tensor parallelism"):
            tp.generate([{"prompt": PROMPT, "multi_modal_data": {"image": picture(0)}}], GREEDY)


def test_chat_page_sends_an_image(server, tmp_path):
    """The page at ``/`` in headless Chromium: an attached image goes with the next message (scaled down in the
    browser) and the LLaVA answers it."""
    from tests.test_chat_page import ARGS, CHROMIUM

    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing")
        pytest.skip(f"{CHROMIUM} is missing")
    from playwright.sync_api import sync_playwright

    picture(8, (900, 1200)).save(tmp_path / "photo.png")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(server.url + "/")
        page.fill("#max-tokens", "6")
        page.set_input_files("#image", str(tmp_path / "photo.png"))
        page.wait_for_function("() => !document.getElementById('attached').hidden", timeout=10_000)
        page.fill("#prompt", "What is in the picture?")
        page.press("#prompt", "Enter")
        page.wait_for_function("() => !document.querySelector('.msg.assistant').classList.contains('streaming')",
                               timeout=30_000)
        assert "6 tokens" in page.locator(".msg.assistant .meta").inner_text()
        assert not page.locator(".msg.error").count(), page.locator(".msg.error").all_inner_texts()
        size = page.evaluate("() => [document.querySelector('.msg.user img').naturalWidth,"
                             " document.querySelector('.msg.user img').naturalHeight]")
        assert size == [768, 576]  # (1200 x 900 scaled to 768 a side at most)
        assert page.locator("#attached").is_hidden() and not errors, errors
        # a second image, alone: only the latest image goes with the conversation
        picture(9, (40, 40), "RGBA").save(tmp_path / "icon.png")
        page.set_input_files("#image", str(tmp_path / "icon.png"))
        page.wait_for_function("() => !document.getElementById('attached').hidden", timeout=10_000)
        page.click("#send")
        page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length == 2 && !document"
                               ".querySelectorAll('.msg.assistant')[1].classList.contains('streaming')", timeout=30_000)
        assert "6 tokens" in page.locator(".msg.assistant .meta").nth(1).inner_text()
        assert page.evaluate("() => history.map((m) => Array.isArray(m.content) ? m.content.length : 0)") == \
            [0, 0, 1, 0]  # (the first turn's image dropped, its text kept; the second: the image alone)
        assert not errors, errors
        browser.close()


def test_the_gpu_checks_llava_test_holds_on_the_cpu(tmp_path):
    from tests.test_cuda import llava_parity

    llava_parity(tmp_path, "cpu")
