"""Images in chat prompts (a LLaVA model's): files (``frontends.media`` reads them) turned into pixels as the
model's image processor would make them, without transformers or torch in the frontend (Pillow and NumPy).

``ImageProcessor`` reads the model's ``preprocessor_config.json`` (CLIP's and SigLIP's processors: resize
by the shortest edge or to a size, bicubic; a center crop; rescale; normalize) and gives float32 pixels,
channels first, equal to transformers' ``CLIPImageProcessor``'s (Pillow backend) to float32 rounding.

``expand`` then puts each image's placeholder tokens in the prompt: the chat template writes the model's
image token once per image, which becomes the ``num_tokens`` copies the model reads the image's embeddings
into (as transformers' ``LlavaProcessor`` expands it).
"""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np

from engine.protocol import ImageInput

MAX_IMAGE_BYTES = 20 << 20  # an image's file (frontends.media reads it)
MAX_IMAGE_PIXELS = 50_000_000  # width x height, read from the header before anything is decoded
MAX_REQUEST_PIXELS = 100_000_000  # all of a request's images together (about 3 s of decoding)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "SiglipImageProcessor", "SiglipImageProcessorFast")


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

    def resized(self, w: int, h: int) -> tuple[int, int]:
        """The (width, height) an image of ``w`` x ``h`` is resized to (before its crop)."""
        if self.shortest_edge is not None:
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.shortest_edge * long / short)
            return (self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge)
        return (self.resize_to[1], self.resize_to[0]) if self.resize_to is not None else (w, h)

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
        if self.shortest_edge is not None or self.resize_to is not None:
            image = image.resize(self.resized(*image.size), resample=self.resample)
        a = np.asarray(image).transpose(2, 0, 1)  # (3, H, W) uint8
        if self.crop is not None:
            top, left = (a.shape[1] - self.crop[0]) // 2, (a.shape[2] - self.crop[1]) // 2
            a = a[:, top:top + self.crop[0], left:left + self.crop[1]]
        a = (a.astype(np.float64) * self.scale).astype(np.float32) if self.scale is not None else a.astype(np.float32)
        if self.mean is not None:
            a = ((a.T - self.mean) / self.std).T
        return np.ascontiguousarray(a, dtype=np.float32)


def open_image(raw: bytes):
    """The Pillow image of an image file's bytes (``frontends.media``'s): its header read and its size checked,
    its pixels not decoded yet (``ImageProcessor.pixels`` does that)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw), formats=FORMATS)
        w, h = image.size
    except UnidentifiedImageError:
        raise ImageError(f"cannot read the image: not a {', '.join(FORMATS)} file") from None
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise ImageError(f"cannot read the image ({', '.join(FORMATS)} are read): {e}") from None
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"an image of {w}x{h} pixels: at most {MAX_IMAGE_PIXELS // 1_000_000} million")
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


def cost(pictures: list, processor: ImageProcessor) -> int:
    """What decoding and resizing ``open_image``'s images costs, in the tokenizer thread's units (characters:
    about a microsecond each), for ``TextCodec.run``: about 30 pixels a microsecond (a 49-megapixel PNG, 1.4 s),
    of the larger of each image and what it is resized to (a 1x200000 image resized by its shortest edge to
    336 would be 336x67200000); ``ImageError`` past ``MAX_IMAGE_PIXELS`` resized, or ``MAX_REQUEST_PIXELS``
    in all."""
    pixels = 0
    for im in pictures:
        w, h = processor.resized(*im.size)
        if w * h > MAX_IMAGE_PIXELS:
            raise ImageError(f"an image of {im.size[0]}x{im.size[1]} pixels is resized to {w}x{h} for this model: "
                             f"at most {MAX_IMAGE_PIXELS // 1_000_000} million (its sides are too unequal)")
        pixels += max(w * h, im.size[0] * im.size[1])
    if pixels > MAX_REQUEST_PIXELS:
        raise ImageError(f"images of {pixels / 1e6:.0f} million pixels in all: at most "
                         f"{MAX_REQUEST_PIXELS // 1_000_000} million a request")
    return pixels // 30 + 1000 * len(pictures)


def lists_contents(template: str | None) -> bool:
    """Whether a chat template reads a message's content as a list of parts (llava-hf's, Qwen2-VL's), so an
    image is a part ``{"type": "image"}``; else the image's token is written into the text."""
    return bool(template) and re.search(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)",
                                        template) is not None
