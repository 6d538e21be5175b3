"""The offline API: ``LLM(model=None, **config).generate(prompts, sampling_params)``.

An in-process client of ``Engine``: it tokenizes, adds every prompt, steps the
engine until all are done and detokenizes, like a frontend without the sockets.

With ``tensor_parallel_size`` > 1 it starts worker processes (``engine.tp_worker``, spawned:
a script needs the ``if __name__ == "__main__":`` guard); ``close()``, or leaving a
``with LLM(...)`` block, stops them (so does exit).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field
from functools import cached_property

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.config import SPARE_LORA_SLOTS, EngineConfig
from engine.engine import Engine
from engine.model_path import generation_defaults
from engine.protocol import PoolingParams, SamplingParams, TokenLogprobs, embedding_floats
from frontends import images
from frontends.beam_search import beam_delta, end_ids, stop_finder
from frontends.embeddings import class_probs
from frontends.generation import Choice, one_token_each, text_ids
from frontends.media import data_bytes
from frontends.text import StopMatcher, TextCodec, bad_words_token_ids
from frontends.tokenizer import load_tokenizer  # the same as the HTTP frontends use


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "error" (could not run: out of memory)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_reason: int | str | None = None


@dataclass
class EmbeddingOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]  # the model's pooling of the prompt (engine.pooling)
    num_cached_tokens: int = 0


@dataclass
class ClassificationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    probs: list[float]  # each label's (softmax; a single label's sigmoid)
    logits: list[float]  # the raw scores
    label: str  # the most likely


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's sigmoid of its score; else the cosine similarity of the two embeddings


@dataclass
class ScoringRequestOutput:
    """vLLM's: one pair's score (``outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]  # the pair's, as a cross-encoder reads it (else the second text's)
    outputs: ScoringOutput


@dataclass
class BeamSearchSequence:
    """vLLM's: ``tokens`` and ``text`` are the prompt's and the output's; ``logprobs``: each output token's
    ``[logprob, [(token_id, logprob), ...]]``."""

    tokens: list[int]
    logprobs: list
    cum_logprob: float
    text: str
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first


class LLM:
    def __init__(self, model: str | None = None, **config):
        """``config``: ``EngineConfig``'s fields; and vLLM's ``enable_lora=True``: ``generate`` loads the adapter of
        a ``lora_request`` with a ``lora_path`` (vLLM's ``LoRARequest``), into ``max_loras`` slots (default: one
        per adapter of ``lora_modules``, and ``SPARE_LORA_SLOTS`` more)."""
        config.pop("trust_remote_code", None)  # (vLLM's: nothing from a model's folder runs here)
        if config.pop("enable_lora", False) and config.get("max_loras") is None:
            config["max_loras"] = len(config.get("lora_modules") or ()) + SPARE_LORA_SLOTS
        self.engine = Engine(EngineConfig(model=model, **config))
        self.config = self.engine.config  # (as the engine runs it: an encoder's budget raised)
        self._ids = itertools.count()
        self._adapter_use: dict[str, None] = {}  # LoRA adapters asked for, least recently first
        c = self.config
        self._sampling_defaults = generation_defaults(c.generation_config, self.engine.runner.facts.model_path,
                                                      c.override_generation_config)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the LLM is collected, and at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` and ``chat`` sample with when given no ``SamplingParams``, OpenAI's
        defaults but for the model's generation_config.json (``generation_config``, as the server's; its
        max_new_tokens is capped, prompt by prompt, by the room the context leaves)."""
        return SamplingParams(**self._sampling_defaults)

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.engine.tokenizer_path)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block, so that the next prompts find none (``Engine.reset_prefix_cache``;
        between ``generate`` calls no request holds one)."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        """vLLM's: the tokenizer prompts are encoded and outputs decoded with."""
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's: encode and decode with ``tokenizer`` from now on (its ``encode`` and ``decode``; chat templates,
        stop strings and pairs through a codec made anew from it)."""
        self.tokenizer = tokenizer
        self.__dict__.pop("_codec", None)  # (a cached_property)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order.

        ``priority``: one per prompt, lower first, for ``scheduling_policy="priority"`` (as vLLM's).
        ``lora_request``: the LoRA adapter (one of ``lora_modules``, by name, or anything with vLLM's
        ``LoRARequest.lora_name``) for every prompt, or a list of one per prompt (None: the model alone). One
        with a ``lora_path`` that is not loaded yet is loaded first (``enable_lora``).

        A prompt may also be vLLM's dict: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, and for a model
        that reads images ``"multi_modal_data": {"image": image or [images]}`` (Pillow images, or ``data:``
        URLs), the prompt holding the model's image token (``<image>``) once where each goes.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [
            sampling_params or self.get_default_sampling_params()]
        params = params * len(prompts) if len(params) == 1 else params
        # the model's max_new_tokens, as a default: fitted to each prompt's room, as the server fits it
        fit = sampling_params is None and "max_tokens" in self._sampling_defaults
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        self._load_adapters(loras)
        loras = [getattr(a, "lora_name", a) or "" for a in loras]

        outputs: dict[str, RequestOutput] = {}
        stopped: set[str] = set()  # ended by a stop string: their text is already cut
        keep_stop: set[str] = set()  # include_stop_str_in_output: the token that ends them stays in the text
        # requests with stop strings: matched as the HTTP frontends match them (the first stop
        # string completed in the detokenized text, never before min_tokens), the text cut before it
        choices: dict[str, tuple[Choice, list[str]]] = {}
        ends = frozenset(self.engine.eos_token_ids)
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, loras, strict=True):
                prompt, pictures = self._unpack(prompt)
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                image_inputs = []
                if pictures:
                    vision = self._vision
                    ids, offsets = images.expand(ids, len(pictures), vision.image_token_id, vision.num_tokens)
                    image_inputs = images.inputs(offsets, [self._image_processor.pixels(im) for im in pictures],
                                                 vision.num_tokens)
                if fit:
                    room = self.engine.max_model_len - len(ids)
                    p = dataclasses.replace(p, max_tokens=max(1, min(p.max_tokens, room)))
                if p.bad_words and p.bad_words_token_ids is None:  # (vLLM's words: the engine reads tokens)
                    p = dataclasses.replace(p, bad_words_token_ids=bad_words_token_ids(
                        p.bad_words, lambda w: self.tokenizer.encode(w, add_special_tokens=False)))
                if p.dry_breakers_as_text:  # (llama.cpp's DRY: likewise)
                    p = dataclasses.replace(p, dry_breaker_token_ids=self._codec.dry_breakers(tuple(p.dry_breakers)))
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, p, prio, lora=lora, images=image_inputs)
                if p.include_stop_str_in_output:
                    keep_stop.add(rid)
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                             logprobs=[] if p.logprobs is not None else None)
                if p.stop:
                    choices[rid] = (Choice(0, rid, ids, self._codec, StopMatcher(p.stop), p.min_tokens, ends,
                                           include_stop=p.include_stop_str_in_output), [])
            while self.engine.has_work():
                # (a delta of several tokens, speculative decoding's, one token at a time where a stop string
                # may end it: the output stops at the token that completes it, as without drafts)
                deltas = [part for d in self.engine.step() for part in
                          (one_token_each(d) if d.request_id in choices and len(d.token_ids) > 1 else (d,))]
                for d in deltas:
                    out = outputs.get(d.request_id)
                    if out is None or d.request_id in stopped:
                        continue
                    out.token_ids.extend(d.token_ids)
                    if d.logprobs is not None:
                        out.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
                    out.num_cached_tokens = d.num_cached_tokens
                    if d.request_id in choices:
                        choice, pieces = choices[d.request_id]
                        text, hit = choice.consume(d)
                        pieces.append(text)
                        if hit:
                            out.text, out.finish_reason, out.stop_reason = "".join(pieces), "stop", choice.stop_reason
                            stopped.add(d.request_id)
                            self.engine.abort(d.request_id)
        except BaseException:
            self.engine.abort(list(outputs))  # leave nothing behind for the next call
            raise
        for rid, out in outputs.items():
            if rid not in stopped:  # the EOS or stop token that ends it is never text (as the frontends have it)
                ids = out.token_ids if rid in keep_stop else text_ids(out.token_ids, out.finish_reason,
                                                                     out.stop_reason, ends)
                out.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return list(outputs.values())

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best sequences, best first, by
        transformers' rules (``engine.beam_search``). Prompts as ``generate`` takes them; every round of the
        searches (one token of each live beam) is one batch."""
        ends = end_ids(params, self.engine.eos_token_ids)
        params.check(len(ends))
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        stop = StopMatcher(params.stop) if params.stop else None
        searches, asked = [], []
        for prompt in prompts:
            text, pictures = self._unpack(prompt)
            ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
            # (each image's one token in the prompt becomes its placeholders)
            room = self.engine.max_model_len - len(ids) - len(pictures) * (self._vision.num_tokens - 1 if pictures else 0)
            p = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
            searches.append(BeamSearch(p, ends, stop_finder(self._codec, ids, stop, True) if stop else None))
            asked.append((ids, {"multi_modal_data": {"image": pictures}} if pictures else None))
        while live := [(s, a) for s, a in zip(searches, asked, strict=True) if not s.done]:
            round_prompts, owners = [], []
            for s, (ids, images_of) in live:
                for b in s.live:
                    ids_b = ids + b.tokens
                    round_prompts.append({"prompt_token_ids": ids_b, **images_of} if images_of else ids_b)
                    owners.append(s)
            k = max(s.num_logprobs for s, _ in live)
            outs = self.generate(round_prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=k),
                                 lora_request=lora_request)
            for s, _ in live:
                tops = [out.logprobs[0][1] for out, o in zip(outs, owners, strict=True) if o is s]
                s.advance(tops)
        results = []
        eos = frozenset(self.engine.eos_token_ids)
        for s, (ids, _) in zip(searches, asked, strict=True):
            prompt_text, sequences = self.tokenizer.decode(ids, skip_special_tokens=True), []
            for b in s.best():  # (the text as generate's: an end id dropped, cut before a stop string)
                c = Choice(0, "", ids, self._codec, stop, 0, eos, include_stop=params.include_stop_str_in_output)
                text, _ = c.consume(beam_delta("", b, params.stop_token_ids, len(ids), 0, None))
                sequences.append(BeamSearchSequence(ids + b.tokens, b.logprobs, b.cum_logprob, prompt_text + text,
                                                    c.finish_reason, c.stop_reason))
            results.append(BeamSearchOutput(sequences))
        return results

    @staticmethod
    def _unpack(prompt) -> tuple[str | list[int], list]:
        """A prompt as text or token ids, and its images (Pillow images), from vLLM's dict or as given."""
        if not isinstance(prompt, dict):
            return prompt, []
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict holds 'prompt' or 'prompt_token_ids' (one of them)")
        pictures = (prompt.get("multi_modal_data") or {}).get("image") or []
        pictures = pictures if isinstance(pictures, list) else [pictures]
        return prompt.get("prompt", prompt.get("prompt_token_ids")), [
            images.open_image(data_bytes(im)) if isinstance(im, str) else im for im in pictures]

    @property
    def _vision(self):
        if self.engine.vision is None:
            raise ValueError(self.engine.no_images)
        return self.engine.vision

    @cached_property
    def _image_processor(self) -> images.ImageProcessor:
        return images.ImageProcessor.load(self.engine.tokenizer_path)

    def _load_adapters(self, loras: list) -> None:
        """Load the adapters of vLLM ``LoRARequest`` s (those with a ``lora_path``) that are not loaded yet, or were
        loaded from another folder; as in vLLM, when every slot is taken, those that went unused longest make
        room (never one these prompts ask for)."""
        wanted = {a.lora_name: path for a in loras
                  if (path := getattr(a, "lora_path", None) or getattr(a, "lora_local_path", None))}  # (older name)
        asked = {getattr(a, "lora_name", a) for a in loras}
        for name, path in wanted.items():
            served = self.engine.adapters.get(name)
            if served is not None and os.path.realpath(served.path) == os.path.realpath(path):
                continue
            if not self.engine.config.max_loras:
                self.engine.check_lora(name)  # (refuses: no adapter is loaded while serving)
            adapter = self.engine.read_lora(name, path)  # (refused here, nothing has changed)
            if served is not None:
                self.engine.unload_lora(name)
            while self.engine.free_lora_slot() is None and (
                    idle := [n for n in self._adapter_use if n in self.engine.adapters and n not in asked]):
                self.engine.unload_lora(idle[0])
            self.engine.load_lora(name, path, adapter)
        for name in asked:  # (least recently asked for first)
            self._adapter_use.pop(name, None)
            self._adapter_use[name] = None

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             priority: list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: a conversation (a list of ``{"role", "content"}`` messages), or a list of
        them, each through the model's chat template (shown ``tools``, with ``chat_template_kwargs`` such
        as Qwen3's ``{"enable_thinking": False}``), then ``generate``; outputs in conversation order.
        ``continue_final_message`` (with ``add_generation_prompt=False``): the model goes on with the
        last message, an assistant's."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in conversations:
            c, pictures = _with_images(c)
            ids = self._codec.apply_chat_template(c, add_generation_prompt, tools, chat_template_kwargs,
                                                  continue_final_message)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}} if pictures else ids)
        return self.generate(prompts, sampling_params, priority, lora_request)

    def embed(self, prompts: str | list[int] | list[str] | list[list[int]], dimensions: int | None = None,
              normalize: bool | None = None) -> list[EmbeddingOutput]:
        """Each prompt's embedding (batched with each other as generations are); outputs in prompt order.

        ``dimensions``: keep the first this many (Matryoshka); ``normalize``: None = the model's default."""
        if self.engine.labels:
            raise ValueError("this model is a sequence classifier: it does not embed (LLM.classify)")
        return self._pool(prompts, PoolingParams(dimensions, normalize))

    def _pool(self, prompts, pooling: PoolingParams) -> list[EmbeddingOutput]:
        """Each prompt's pooled vector (an embedding, or a classifier's scores)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs: dict[str, EmbeddingOutput] = {}
        try:
            for prompt in prompts:
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, SamplingParams(max_tokens=1), pooling=pooling)
                outputs[rid] = EmbeddingOutput(rid, prompt if isinstance(prompt, str) else None, ids, [])
            while self.engine.has_work():
                for d in self.engine.step():
                    out = outputs.get(d.request_id)
                    if out is None:
                        continue
                    if d.embedding is None:  # only "error" (out of memory) or "timeout" end one without it
                        raise RuntimeError(f"embedding {d.request_id} ended with {d.finish_reason!r}")
                    out.embedding = embedding_floats(d.embedding)
                    out.num_cached_tokens = d.num_cached_tokens
        except BaseException:
            self.engine.abort(list(outputs))
            raise
        return list(outputs.values())

    def classify(self, prompts: str | list[int] | list[str] | list[list[int]]) -> list[ClassificationOutput]:
        """vLLM's ``LLM.classify``, for a sequence classifier (``*ForSequenceClassification``): each prompt's
        label probabilities; outputs in prompt order."""
        labels = self.engine.labels
        if not labels:
            raise ValueError("this model does not classify: it has no sequence-classification head")
        out = []
        for e in self._pool(prompts, PoolingParams(None, False)):
            best = max(range(len(labels)), key=e.embedding.__getitem__)
            out.append(ClassificationOutput(e.request_id, e.prompt, e.prompt_token_ids, class_probs(e.embedding),
                                            e.embedding, labels[best]))
        return out

    def score(self, text_1: str | list[str], text_2: str | list[str],
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: each pair's relevance, as ``/score`` answers it. One ``text_1`` against each of
        ``text_2``, or pair by pair when both are lists of one length. A cross-encoder (a one-label classifier:
        bge-reranker, ms-marco) reads each pair as one prompt, the two texts as its tokenizer pairs them
        (``truncate_prompt_tokens``: at most that many tokens, the longer text cut first; -1: as many as the
        context holds), and scores the sigmoid of its score; an embedding model, the cosine similarity of the two
        texts' embeddings (each cut to its last ``truncate_prompt_tokens``)."""
        first, second = _texts(text_1, "text_1"), _texts(text_2, "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                             "as text_2")
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
        if truncate_prompt_tokens == -1:
            truncate_prompt_tokens = self.engine.max_model_len
        elif truncate_prompt_tokens is not None and (type(truncate_prompt_tokens) is not int
                                                     or not 1 <= truncate_prompt_tokens <= self.engine.max_model_len):
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.engine.max_model_len}], got "
                             f"{truncate_prompt_tokens!r}")
        labels = self.engine.labels
        if len(labels) > 1:
            raise ValueError(f"this model classifies into {len(labels)} labels: it neither embeds nor scores pairs")
        if labels:
            ids = [self._codec.encode_pair(a, b, truncate_prompt_tokens) for a, b in pairs]
            scores = [class_probs(e.embedding)[0] for e in self._pool(ids, PoolingParams(None, False))]
        else:
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            ids = [self.tokenizer.encode(t) for t in texts]
            if truncate_prompt_tokens is not None:
                ids = [i[-truncate_prompt_tokens:] for i in ids]  # (the last tokens, as /v1/embeddings keeps)
            vectors = dict(zip(texts, (e.embedding for e in self._pool(ids, PoolingParams(None, True))), strict=True))
            scores = [sum(x * y for x, y in zip(vectors[a], vectors[b], strict=True)) for a, b in pairs]
            of = dict(zip(texts, ids, strict=True))
            ids = [of[b] for _, b in pairs]
        return [ScoringRequestOutput(str(next(self._ids)), i, ScoringOutput(s))
                for i, s in zip(ids, scores, strict=True)]

    @cached_property
    def _codec(self) -> TextCodec:
        codec = TextCodec(self.tokenizer)
        if self.engine.vision is not None:
            codec.use_images(self.engine.vision.image_token_id)
        return codec


def _texts(value, name: str) -> list[str]:
    """``LLM.score``'s ``text_1`` or ``text_2``: a text or a list of texts, none empty (as ``/score`` takes them)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r:.80}")
    return list(texts)


def _with_images(conversation: list[dict]) -> tuple[list[dict], list]:
    """A conversation whose messages' content parts hold images (OpenAI's ``image_url`` parts with ``data:`` URLs,
    or vLLM's ``{"type": "image_pil", "image_pil": image}``) as the chat template gets it (each message's text, its
    images named in ``images``), and the images, in order; one without any as it is."""
    if not any(isinstance(m.get("content"), list) and any(p.get("type") in ("image_url", "image_pil")
                                                           for p in m["content"]) for m in conversation):
        return conversation, []
    out, pictures = [], []
    for m in conversation:
        parts = m.get("content")
        if not isinstance(parts, list):
            out.append(m)
            continue
        found, order = [], []
        for p in parts:
            if p.get("type") == "image_url":
                url = p["image_url"]
                found.append(images.open_image(data_bytes(url["url"] if isinstance(url, dict) else url)))
                order.append({"type": "image"})
            elif p.get("type") == "image_pil":
                found.append(p["image_pil"])
                order.append({"type": "image"})
            elif p.get("type") == "text":
                order.append(p)
        text = "".join(p["text"] for p in parts if p.get("type") == "text")
        out.append({**m, "content": text, **({"images": found, "parts": order} if found else {})})
        pictures += found
    return out, pictures
