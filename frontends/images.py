"""Images in chat prompts (a LLaVA model's): URLs decoded and turned into pixels as the model's image
processor would make them, without transformers or torch in the frontend (Pillow and NumPy).

``ImageProcessor`` reads the model's ``preprocessor_config.json`` (CLIP's and SigLIP's processors: resize
by the shortest edge or to a size, bicubic; a center crop; rescale; normalize) and gives float32 pixels,
channels first, equal to transformers' ``CLIPImageProcessor``'s (Pillow backend) to float32 rounding. Only
``data:`` URLs are read: the frontend fetches nothing from the network on a client's word.

``expand`` then puts each image's placeholder tokens in the prompt: the chat template writes the model's
image token once per image, which becomes the ``num_tokens`` copies the model reads the image's embeddings
into (as transformers' ``LlavaProcessor`` expands it).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re

import numpy as np

from engine.protocol import ImageInput

MAX_IMAGE_BYTES = 20 << 20  # an image's file, decoded from its data URL
MAX_IMAGE_PIXELS = 50_000_000  # width x height, read from the header before anything is decoded
MAX_REQUEST_PIXELS = 100_000_000  # all of a request's images together (about 3 s of decoding)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "SiglipImageProcessor", "SiglipImageProcessorFast")
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.ASCII)


class ImageError(ValueError):
    """An image the request holds cannot be read (the client's fault: a 400)."""


class ImageProcessor:
    """A model's image processor, from its ``preprocessor_config.json``."""

    def __init__(self, cfg: dict):
        kind = cfg.get("image_processor_type", "CLIPImageProcessor")
        if kind not in _PROCESSORS:
            raise ValueError(f"image processor {kind!r} is not supported ({', '.join(_PROCESSORS[::2])} are)")
        size = cfg.get("size") or {}
        self.resize_to: tuple[int, int] | None = None  # (height, width), or by the shortest edge:
        self.shortest_edge: int | None = None
        if cfg.get("do_resize", True):
            if "shortest_edge" in size:
                self.shortest_edge = int(size["shortest_edge"])
            elif "height" in size and "width" in size:
                self.resize_to = (int(size["height"]), int(size["width"]))
            else:
                raise ValueError(f"preprocessor_config.json: a size of {size!r} is not supported")
        crop = cfg.get("crop_size") or {}
        self.crop = (int(crop["height"]), int(crop["width"])) if cfg.get("do_center_crop") and crop else None
        if self.crop and self.shortest_edge is not None and self.shortest_edge < max(self.crop):
            raise ValueError("preprocessor_config.json crops more than it resizes to: not supported")
        if self.crop is None and self.resize_to is None:
            raise ValueError("preprocessor_config.json gives images no fixed size (no crop, no size to resize to)")
        self.resample = int(cfg.get("resample", 3))  # (Pillow's numbering: 3 bicubic)
        self.scale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None
        self.mean = self.std = None
        if cfg.get("do_normalize", True):
            self.mean = np.array(cfg.get("image_mean", [0.5] * 3), dtype=np.float32)
            self.std = np.array(cfg.get("image_std", [0.5] * 3), dtype=np.float32)

    @classmethod
    def load(cls, folder: str) -> ImageProcessor:
        path = os.path.join(folder, "preprocessor_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no preprocessor_config.json in {folder}: how the model wants its images is unknown")
        with open(path) as f:
            return cls(json.load(f))

    @property
    def side(self) -> tuple[int, int]:
        """(height, width) of the pixels made."""
        return self.crop or self.resize_to

    def pixels(self, image) -> np.ndarray:
        """A Pillow image (``open_image``'s: its pixels decoded here) -> (3, H, W) float32 pixels."""
        from PIL import Image

        try:
            image.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # a truncated file, say
            raise ImageError(f"cannot read the image: {e}") from None
        if "A" in image.getbands() or image.info.get("transparency") is not None:  # over white, as transformers
            image = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image)
        image = image.convert("RGB")
        if self.shortest_edge is not None:
            w, h = image.size
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.shortest_edge * long / short)
            image = image.resize((self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge),
                                 resample=self.resample)
        elif self.resize_to is not None:
            image = image.resize(self.resize_to[::-1], resample=self.resample)
        a = np.asarray(image).transpose(2, 0, 1)  # (3, H, W) uint8
        if self.crop is not None:
            top, left = (a.shape[1] - self.crop[0]) // 2, (a.shape[2] - self.crop[1]) // 2
            a = a[:, top:top + self.crop[0], left:left + self.crop[1]]
        a = (a.astype(np.float64) * self.scale).astype(np.float32) if self.scale is not None else a.astype(np.float32)
        if self.mean is not None:
            a = ((a.T - self.mean) / self.std).T
        return np.ascontiguousarray(a, dtype=np.float32)

    def from_url(self, url: str) -> np.ndarray:
        """A ``data:image/...;base64,`` URL's pixels; ``ImageError`` if it is none, or no image Pillow reads."""
        return self.pixels(open_image(url))


def open_image(url: str):
    """The Pillow image of a ``data:`` URL: its header read and its size checked, its pixels not decoded yet."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str):
        raise ImageError("an image's url must be a string")
    m = _DATA_URL.match(url)
    if m is None:
        what = "an http(s) URL" if url.startswith(("http://", "https://")) else f"{url[:24]!r}"
        raise ImageError(f"images come as data:image/...;base64, URLs here, got {what} (the server fetches "
                         f"nothing): read the file and send it as a data URL")
    if (len(url) - m.end()) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ImageError(f"an image may be at most {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's data URL is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ImageError(f"an image of {w}x{h} pixels: at most {MAX_IMAGE_PIXELS // 1_000_000} million")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise ImageError(f"cannot read the image ({', '.join(FORMATS)} are read): {e}") from None
    return image


def expand(prompt: list[int], count: int, token_id: int, num_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt with each image token (one per image, as the chat template wrote it) made ``num_tokens`` of
    them, and where each image's run begins; ``ImageError`` unless the template wrote ``count`` of them."""
    at = [i for i, t in enumerate(prompt) if t == token_id]
    if len(at) != count:
        raise ImageError(f"the prompt holds {len(at)} image placeholders for {count} images (the model's image "
                         f"token may not appear in text)")
    out: list[int] = []
    offsets = []
    start = 0
    for i in at:
        out.extend(prompt[start:i])
        offsets.append(len(out))
        out.extend([token_id] * num_tokens)
        start = i + 1
    out.extend(prompt[start:])
    return out, offsets


def inputs(offsets: list[int], pixels: list[np.ndarray], num_tokens: int) -> list[ImageInput]:
    """The images of ``expand``'s prompt, as the engine takes them."""
    return [ImageInput(o, num_tokens, list(p.shape), p.tobytes()) for o, p in zip(offsets, pixels, strict=True)]


def cost(pictures: list) -> int:
    """What decoding and resizing ``open_image``'s images costs, in the tokenizer thread's units (characters:
    about a microsecond each), for ``TextCodec.run``: about 30 pixels a microsecond (a 49-megapixel PNG, 1.4 s);
    ``ImageError`` past ``MAX_REQUEST_PIXELS`` in all."""
    pixels = sum(im.size[0] * im.size[1] for im in pictures)
    if pixels > MAX_REQUEST_PIXELS:
        raise ImageError(f"images of {pixels / 1e6:.0f} million pixels in all: at most "
                         f"{MAX_REQUEST_PIXELS // 1_000_000} million a request")
    return pixels // 30 + 1000 * len(pictures)


def lists_contents(template: str | None) -> bool:
    """Whether a chat template reads a message's content as a list of parts (llava-hf's, Qwen2-VL's), so an
    image is a part ``{"type": "image"}``; else the image's token is written into the text."""
    return bool(template) and re.search(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)",
                                        template) is not None
