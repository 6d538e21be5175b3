"""The offline API: ``LLM(model=None, **config).generate(prompts, sampling_params)``.

An in-process client of ``Engine``: it tokenizes, adds every prompt, steps the
engine until all are done and detokenizes, like a frontend without the sockets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

from engine.config import EngineConfig
from engine.engine import Engine
from engine.protocol import SamplingParams, TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None


class LLM:
    def __init__(self, model: str | None = None, **config):
        self.config = EngineConfig(model=model, **config)
        self.engine = Engine(self.config)
        self._ids = itertools.count()

    @cached_property
    def tokenizer(self):
        from frontends.text import load_tokenizer  # the same loader the HTTP frontends use

        return load_tokenizer(self.engine.runner.facts.model_path)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()]
        params = params * len(prompts) if len(params) == 1 else params
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")

        outputs: dict[str, RequestOutput] = {}
        params_of: dict[str, SamplingParams] = {}
        stopped: set[str] = set()  # ended by a stop string: their text is already cut
        seen: dict[str, int] = {}  # text length at the previous stop-string check
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, p)
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                             logprobs=[] if p.logprobs is not None else None)
                params_of[rid] = p
            while self.engine.has_work():
                for d in self.engine.step():
                    out = outputs.get(d.request_id)
                    if out is None or d.request_id in stopped:
                        continue
                    out.token_ids.extend(d.token_ids)
                    if d.logprobs is not None:
                        out.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
                    p = params_of[d.request_id]
                    if p.stop and self._hit_stop(out, p, seen):
                        stopped.add(d.request_id)
                        self.engine.abort(d.request_id)
        except BaseException:
            self.engine.abort(list(outputs))  # leave nothing behind for the next call
            raise
        for rid, out in outputs.items():
            if rid not in stopped:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return list(outputs.values())

    def _hit_stop(self, out: RequestOutput, p: SamplingParams, seen: dict[str, int]) -> bool:
        """Stop strings, offline, as vLLM checks them: only in text new since the last check
        (plus room for a match straddling it), never before ``min_tokens``; the text is cut
        before the match, which is not returned."""
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        since = seen.get(out.request_id, 0)
        seen[out.request_id] = len(text)
        if len(out.token_ids) < p.min_tokens:
            return False
        hits = [(i, s) for s in p.stop if (i := text.find(s, max(0, since - len(s) + 1))) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        out.text, out.finish_reason, out.stop_reason = text[:i], "stop", s
        return True
