"""The engine: requests in, token deltas out, one ``step()`` at a time.

``step()`` is schedule → run → postprocess and does no I/O; the actor in
``engine.server`` (or ``LLM`` offline) drives it.

Asynchronous scheduling (``async_scheduling``, ``--async-scheduling``; ``auto``: on CUDA, not on
the CPU, where the host has nothing to overlap with) hides the host's work behind the device's,
as vLLM v1 and SGLang's overlap loop do: ``step()`` schedules and launches step N+1 while step N
runs, then waits for N's tokens and returns N's deltas; N+1 stays in flight across the call
(``has_work()`` stays true while it does). A request that samples in N is scheduled in N+1 for
one more token, whose input is N's token, taken on the device. One that N finishes (stop token,
or an abort or timeout meanwhile) has its N+1 token dropped, never emitted; its blocks are freed
at once (one stream: later steps run after N+1). Where N+1's sampling needs N's tokens on the
host (a request in N with bad words, DRY, mirostat or a grammar), N is collected between N+1's
forward and its sampling: the device runs the forward while the host advances the grammars.
Under tensor parallelism steps are always synchronous: the workers get each step's token ids
from the host; so are they with speculative decoding.

Speculative decoding (``--speculative-config``, ``engine.speculative``): a step's decodes may carry
drafts; ``_check_drafts`` compares each request's sampled tokens with its drafts before the scheduler
counts the step's tokens as computed, and ``_postprocess`` emits, per request, the tokens up to and
including the first that differs from its draft (one delta, several tokens), or up to a stop.

A step that runs out of device memory is rolled back and the engine keeps serving:
its requests wait again and come back one at a time; a request that is in a second
failing step (or alone in one) ends with finish reason "error", so one request too
big for the memory can neither loop forever nor take the others down.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.json_schema import SchemaError
from engine.lora import Adapter, AdapterError, read_adapter
from engine.model_path import model_name, resolve_model_path
from engine.model_runner import Launched, ModelRunner, StepResult
from engine.models.config import VisionConfig
from engine.pooling import PoolerConfig, PoolState
from engine.prefill_cap import PrefillCap
from engine.protocol import (
    MAX_ADAPTER_NAME,
    ImageInput,
    Outputs,
    PoolingParams,
    Ready,
    SamplingParamError,
    SamplingParams,
    Stats,
)
from engine.request import PromptImage, Request, RequestError, Status
from engine.runtime import kv_block_bytes
from engine.sampler import SamplingState
from engine.scheduler import PromptTooLong, QueueFull, ScheduledBatch, Scheduler
from engine.speculative import NgramProposer
from engine.structured import Grammars
from engine.token_bytes import VocabularyError

log = logging.getLogger("tokenmill.engine")

_EMBEDDING = SamplingParams(max_tokens=1)  # an embedding request's sampling params: it samples nothing
OOM_RECOVERY_STEPS = 64  # steps after an out-of-memory step before admissions are back to normal regardless


@dataclass
class InFlight:
    """A step launched and not yet collected (asynchronous scheduling)."""

    batch: ScheduledBatch
    launched: Launched

    @property
    def sampling_waits(self) -> bool:
        """Whether the next step's sampling waits for this step's tokens on the host (its forward does not):
        a request sampling in it has bad words, DRY or mirostat (the sampler reads the host's lists or state
        for them) or a grammar (its next mask depends on this token): ``SamplingState.waits``."""
        return any(r.sampling_state.waits for r in self.launched.sampled)


@dataclass
class ServedAdapter:
    """A LoRA adapter requests may ask for by name."""

    slot: int  # its slot on the device (engine.lora)
    path: str  # its PEFT folder
    key: str  # its name and which load of it: the prefix cache's root (a reloaded adapter shares no blocks)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_path(config.model)
        self.model_name = config.served_model_name or model_name(path)
        self.runner = ModelRunner(config, path)
        config = self.config = self.runner.config
        if self.model_name in self.runner.initial_adapters:
            raise ValueError(f"LoRA adapter {self.model_name!r} has the served model's name: a request could not "
                             "ask for the model alone")
        self._adapter_loads = itertools.count()
        self.adapters = {name: ServedAdapter(slot, config.lora_modules[name], f"{next(self._adapter_loads)}:{name}")
                         for name, slot in self.runner.initial_adapters.items()}  # LoRA adapters by name (load_lora)
        facts = self.runner.facts
        capacity = facts.num_kv_blocks * config.block_size
        if capacity < facts.max_model_len:  # never advertise a length the cache cannot hold
            log.warning("max_model_len lowered from %d to %d: the KV cache holds only %d blocks of %d tokens "
                        "(give it more memory with --kv-cache-memory, or on CUDA --gpu-memory-utilization, or "
                        "ask for a smaller --max-model-len)", facts.max_model_len, capacity,
                        facts.num_kv_blocks, config.block_size)
        self.max_model_len = min(facts.max_model_len, capacity)
        self.encoder = self.runner.model_cfg.encoder is not None  # its prompts are computed whole, in one step
        self.vocab_size = self.runner.model_cfg.vocab_size
        self.eos_token_ids = list(self.runner.model_cfg.eos_token_ids)
        self._eos_set = frozenset(self.eos_token_ids)  # looked up once per sampled token
        # (not checked here: offline, a model without a tokenizer runs on token ids; ``serve`` checks it)
        self.tokenizer_path = config.tokenizer or facts.model_path
        self.grammars = Grammars(self.tokenizer_path, self.vocab_size, self.eos_token_ids)  # structured output
        self.can_generate = self.runner.model_cfg.lm_head  # a bare backbone (an embedding model) only embeds
        self.pooler: PoolerConfig | None = None  # embeddings (engine.pooling); None: refused, for this reason:
        self._no_pooler = ""
        self.labels = self.runner.model_cfg.labels  # a sequence classifier's: it classifies, nothing else
        try:
            # (a classifier scores its last token's state, raw, as transformers' *ForSequenceClassification)
            # (an encoder's [CLS]: its embeddings' by default, and its classifier's unless ModernBERT's says mean)
            enc = self.runner.model_cfg.encoder
            self.pooler = PoolerConfig(enc.pooling if enc else "last", False) if self.labels else \
                PoolerConfig.of(facts.model_path, config.pooler_config, "cls" if enc else "last")
        except ValueError as e:
            if config.pooler_config is not None:
                raise
            self._no_pooler = str(e)
            log.warning("embeddings off: %s", e)
        # the cache is this process's: the model and dtype are the same for every block, named for clarity
        self.block_manager = BlockManager(facts.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          f"{facts.model_path}|{facts.dtype}|{facts.kv_dtype}".encode(), facts.kv_window,
                                          facts.num_window_blocks)
        self.speculative = config.speculative
        delay = config.scheduler_delay_factor
        if delay is None:  # CUDA graphs: a step with prompts costs several decode-only steps (measured when eager)
            delay = 1.0 if self.runner.device.type == "cuda" and self.runner.graphs is not None else 0.0
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_num_waiting_requests, config.scheduling_policy, config.scheduling_aging_seconds,
            PrefillCap(config.max_num_batched_tokens, config.long_prefill_token_threshold),
            proposer=NgramProposer(self.speculative, self.max_model_len) if self.speculative else None,
            delay_factor=delay)
        self.requests: dict[str, Request] = {}
        # id -> (request, its output length then) for the requests of a step that ran out of memory, until
        # they sample a token: while there are any, the scheduler admits one at a time
        self._oom_suspects: dict[str, tuple[Request, int]] = {}
        self._steps_since_oom = 0
        self.async_scheduling, off_because = config.overlapped(self.runner.device.type)  # (the runner's graphs know)
        if off_because:
            log.info("asynchronous scheduling off: %s", off_because)
        if self.speculative:
            log.info("speculative decoding: up to %d drafts a step, from earlier occurrences of the last %d..%d "
                     "tokens (n-gram lookup)", self.speculative.num_speculative_tokens,
                     self.speculative.prompt_lookup_min, self.speculative.prompt_lookup_max)
        self._in_flight: InFlight | None = None
        self.step_batch = (0, 0)  # the requests and prompt tokens the last step() scheduled (engine.stats_log)
        # called with a step's prompt tokens as it is scheduled (the actor tells its frontends of a step unlike the
        # last ones: ``engine.server``)
        self.on_prompt_step: Callable[[int], None] | None = None
        if self.runner.model_cfg.vision is not None and self.vision is None:
            log.warning("images refused: %s", self.no_images)
        cfg = self.runner.model_cfg
        in_pool = len(self.runner.window_layers)  # sliding-window layers with a pool of their own
        per_token = kv_block_bytes(cfg, 1, facts.kv_dtype) * (cfg.num_layers - in_pool) // cfg.num_layers
        moe = self.runner.model_cfg.moe
        if moe is not None:
            log.info("a mixture of experts: %d experts, %d a token, in %d of its %d layers%s", moe.num_experts,
                     moe.top_k, len(moe.layers), self.runner.model_cfg.num_layers,
                     ", and a shared expert" if moe.shared_intermediate_size else "")
        if self.encoder:
            log.info("engine ready: %s on %s (%s), an encoder (%s): no KV cache, each input computed whole in one "
                     "step; it %s; max_model_len %d", self.model_name, facts.device,
                     str(facts.dtype).removeprefix("torch."), cfg.model_type,
                     "classifies" if self.labels else "embeds", self.max_model_len)
            return
        log.info("engine ready: %s on %s (%s); KV cache%s: %d blocks of %d tokens (%d tokens, %.1f MiB, "
                 "%d bytes per token), prefix caching %s; max_model_len %d: at most %.1f requests of that "
                 "length at once", self.model_name, facts.device, str(facts.dtype).removeprefix("torch."),
                 f" in {str(facts.kv_dtype).removeprefix('torch.')}" if facts.kv_dtype != facts.dtype else "",
                 facts.num_kv_blocks, config.block_size, capacity, capacity * per_token / 2**20, per_token,
                 "on" if config.enable_prefix_caching else "off", self.max_model_len,
                 capacity / self.max_model_len)
        if in_pool:
            window_bytes = kv_block_bytes(cfg, config.block_size, facts.kv_dtype) * in_pool // cfg.num_layers
            log.info("its %d sliding-window layers (window %d) keep only the blocks their window sees, in a pool "
                     "of their own: %d blocks (%.1f MiB); the bytes per token above are the %d others' "
                     "(--disable-hybrid-kv-cache-manager: every layer keeps every block)", in_pool, facts.kv_window,
                     facts.num_window_blocks, facts.num_window_blocks * window_bytes / 2**20,
                     cfg.num_layers - in_pool)

    # ------------------------------------------------------------------ the actor's interface

    def ready_info(self) -> Ready:
        return Ready(self.model_name, self.max_model_len, self.vocab_size, self.eos_token_ids,
                     self.config.max_num_seqs, self.block_manager.num_blocks, self.config.block_size,
                     self.config.max_num_waiting_requests, [[name, a.path] for name, a in self.adapters.items()],
                     self.config.max_loras or 0, *((self.vision.image_token_id, self.vision.num_tokens,
                                                     self.config.max_images) if self.vision else ()),
                     labels=list(self.labels), request_timeout=self.config.request_timeout)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: every cached block forgotten (``BlockManager.reset_prefix_cache``), if no request holds a block;
        else False."""
        done = self.block_manager.reset_prefix_cache()
        if done:
            log.info("prefix cache reset")
        else:
            log.info("prefix cache not reset: %d blocks are in use", self.block_manager.num_used_blocks)
        return done

    def load_lora(self, name: str, path: str, adapter: Adapter | None = None) -> None:
        """vLLM's ``/v1/load_lora_adapter``: LoRA adapter ``name`` from PEFT folder ``path`` (``adapter``: as
        ``read_lora`` read it) into a free slot of ``max_loras`` (one no adapter holds and no running or waiting
        request still reads); ``RequestError`` if it cannot be."""
        slot = self.check_lora(name)
        try:
            self.runner.load_adapter(slot, name, path, adapter)
        except AdapterError as e:
            raise RequestError(400, "invalid_request_error", str(e), "lora_path") from None
        self.adapters[name] = ServedAdapter(slot, path, f"{next(self._adapter_loads)}:{name}")
        log.info("LoRA adapter %r loaded from %s into slot %d", name, path, slot)

    def check_lora(self, name: str) -> int:
        """The slot ``load_lora`` would load adapter ``name`` into; ``RequestError`` if it would refuse the name
        or find no free slot."""
        def bad(message: str) -> None:
            raise RequestError(400, "invalid_request_error", message, "lora_name")

        slots = self.config.max_loras
        if not slots:
            bad("LoRA adapters are not loaded while serving here: start with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (--max-loras: how many at once)")
        if not name or len(name) > MAX_ADAPTER_NAME or not name.isprintable() or name != name.strip():
            bad(f"an adapter's name must be 1 to {MAX_ADAPTER_NAME} printable characters, with no space at either "
                "end (\"tiny \" would pass for the model \"tiny\" in a list)")
        if name == self.model_name:
            bad(f"'{name}' is the served model's name: a request could not ask for the model alone")
        if name in self.adapters:
            bad(f"The LoRA adapter '{name}' is already loaded (unload it first to load another under its name)")
        slot = self.free_lora_slot()
        if slot is None:
            taken = {a.slot for a in self.adapters.values()}
            held = [f"{len(taken)} held by {', '.join(sorted(self.adapters))}"] if taken else []
            if len(taken) < slots:
                held.append(f"{slots - len(taken)} by unloaded adapters whose requests still run")
            bad(f"no free LoRA slot: of the {slots} of --max-loras, {' and '.join(held)}; unload one, or start "
                "with a larger --max-loras")
        return slot

    def read_lora(self, name: str, path: str) -> Adapter:
        """Adapter ``name``'s folder read and checked, for ``load_lora``: touches nothing of the engine's, so
        another thread may do it while the engine steps; ``RequestError`` if it cannot be served."""
        try:
            return read_adapter(name, path, self.config.max_lora_rank, self.runner.dtype)
        except AdapterError as e:
            raise RequestError(400, "invalid_request_error", str(e), "lora_path") from None

    def free_lora_slot(self) -> int | None:
        """The first LoRA slot no adapter holds and no running or waiting request reads (None: all are busy)."""
        busy = {a.slot for a in self.adapters.values()} | {r.lora_slot for r in self.requests.values()}
        return next((slot for slot in range(self.config.max_loras or 0) if slot not in busy), None)

    def unload_lora(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``: new requests cannot ask for ``name`` any more; those running or
        waiting with it finish with it, and its slot is free once they have."""
        if self.adapters.pop(name, None) is None:
            raise RequestError(404, "not_found_error", f"The LoRA adapter '{name}' is not loaded", "lora_name")
        log.info("LoRA adapter %r unloaded", name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, deadline: float | None = None, cache_salt: str = "",
                    pooling: PoolingParams | None = None, lora: str = "",
                    images: list[ImageInput] | None = None, admitted: bool = False, client: str = "") -> None:
        """A generation, or with ``pooling`` an embedding (``params`` unused: nothing is sampled); ``lora``: the
        LoRA adapter it runs with ("": none); ``images``: what the prompt's image placeholders stand for;
        ``admitted``: a later part of work already taken (a beam search's next round), which a full waiting
        queue does not refuse; ``client``: who asked (``--scheduling-policy fair`` shares the engine between
        clients)."""
        self._check(request_id, prompt_token_ids, params, pooling)
        prompt_images = self._images(prompt_token_ids, images or [], pooling is not None)
        adapter = self.adapters.get(lora) if lora else None
        if lora and adapter is None:
            raise RequestError(404, "not_found_error", f"The model '{lora}' does not exist", "model")
        if deadline is None and self.config.request_timeout is not None:
            deadline = time.time() + self.config.request_timeout
        grammar = pool = None
        if pooling is not None:
            pool = PoolState(self.pooler.pooling_type, pooling.dimensions,
                             self.pooler.normalize if pooling.normalize is None else pooling.normalize, self.encoder)
            params = _EMBEDDING  # nothing is sampled: whatever came with it must not ask for logits
        elif params.structured:
            try:
                grammar = self.grammars.matcher(params)
            except (SchemaError, VocabularyError) as e:
                raise RequestError(400, "invalid_request_error", f"response_format: {e}", "response_format") from e
        req = Request(request_id, prompt_token_ids, params, priority, deadline, SamplingState(params, grammar),
                      cache_salt, pool, adapter.key if adapter else "", adapter.slot if adapter else -1,
                      prompt_images, client)
        try:
            self.scheduler.add(req, bounded=not admitted)
        except QueueFull as e:
            raise RequestError(429, "rate_limit_error", f"server busy: {e}; retry later") from e
        except PromptTooLong as e:
            raise RequestError(400, "invalid_request_error", str(e), "prompt" if pool is None else "input") from e
        self.requests[request_id] = req

    def abort(self, request_ids: list[str] | str) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def worker_fds(self) -> list[int]:
        """What becomes readable once a tensor-parallel worker is gone (none without one): the actor's idle wait
        watches them, so that an idle engine fails then (its frontends' ``/health`` with it), not at its next step."""
        driver = self.runner.tp.driver
        return driver.fds() if driver is not None else []

    def check_workers(self) -> None:
        """Raise ``TensorParallelError`` if a tensor-parallel worker is gone."""
        if self.runner.tp.driver is not None:
            self.runner.tp.driver.check()

    def stats(self) -> Stats:
        bm, s = self.block_manager, self.scheduler
        return Stats(len(s.waiting), len(s.running), bm.usage, *bm.fuller_pool,
                     s.num_preemptions, s.num_timeouts, s.prefix_cache_hit_rate, bm.num_evictions,
                     s.kv_fragmentation, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)

    def step(self) -> Outputs:
        """One step: its deltas, in columns (iterating gives each one's ``Delta``)."""
        if self.scheduler.one_at_a_time:
            self._forget_cleared_suspects()
        self.grammars.new_step()
        out = Outputs()
        if self.async_scheduling:
            self._step_overlapped(out)
            return out
        batch = self._schedule()
        result, errored = self._run(batch)
        self._postprocess(out, [*batch.timed_out, *errored], result)
        return out

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit)."""
        self.runner.close()

    # ------------------------------------------------------------------ internals

    def _check(self, request_id: str, prompt: list[int], params: SamplingParams,
               pooling: PoolingParams | None) -> None:
        def bad(msg: str, param: str | None = None) -> None:
            raise RequestError(400, "invalid_request_error", msg, param)

        if request_id in self.requests:
            bad(f"request id {request_id!r} is already in use")
        if not prompt:
            bad("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            bad(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if pooling is not None:
            if self.pooler is None:
                bad(f"this model cannot embed: {self._no_pooler}", "input")
            hidden = len(self.labels) or self.runner.model_cfg.hidden_size
            if pooling.dimensions is not None and pooling.dimensions > hidden:
                bad(f"dimensions must be at most the model's {hidden}, got {pooling.dimensions}", "dimensions")
            if len(prompt) > self.max_model_len:
                bad(f"this model's maximum context length is {self.max_model_len} tokens, but the input has "
                    f"{len(prompt)}", "input")
            return
        if self.labels:
            bad(f"{self.model_name} is a sequence classifier: it can only classify (/classify)", "model")
        if not self.can_generate:
            bad(f"{self.model_name} has no language-model head (an embedding model's checkpoint): it can only "
                "embed (/v1/embeddings)", "model")
        if params.bad_words and params.bad_words_token_ids is None:
            bad("bad_words must come as token ids here (bad_words_token_ids: LLM and the frontends tokenize them)",
                "bad_words")
        if params.dry_breakers_as_text:
            bad("dry_sequence_breakers must come as token ids here (dry_breaker_token_ids: LLM and the frontends "
                "tokenize them)", "dry_sequence_breakers")
        try:  # the sampler would ignore them, but a client asking for them has a bug to hear about
            params.check_vocab(self.vocab_size)
        except SamplingParamError as e:
            bad(str(e), e.param)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            bad(f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({len(prompt)} in the prompt + {params.max_tokens} max_tokens)",
                "max_tokens")

    def _images(self, prompt: list[int], images: list[ImageInput], pooling: bool) -> list[PromptImage]:
        """``images`` checked against the prompt and the model: each covers a run of the model's placeholder
        tokens, in order, and every placeholder is covered; pixels of the image processor's shape."""
        def bad(msg: str) -> None:
            raise RequestError(400, "invalid_request_error", msg, "messages" if images else "prompt")

        vision = self.vision
        placeholders = prompt.count(vision.image_token_id) if vision is not None else 0
        if not images and not placeholders:
            return []
        if vision is None:
            bad(self.no_images)
        if pooling:  # (an embedding's field is its input)
            raise RequestError(400, "invalid_request_error", "images cannot be embedded here, only generated from",
                               "input")
        if len(images) > self.config.max_images:
            bad(f"at most {self.config.max_images} images per prompt (--limit-mm-per-prompt), got {len(images)}")
        side = vision.image_size
        out, end = [], 0
        for i, im in enumerate(images):
            if im.length != vision.num_tokens or im.shape != [3, side, side] or len(im.pixels) != 4 * 3 * side * side:
                bad(f"image {i}: {im.length} placeholders of pixels {im.shape}, but this model's images are "
                    f"{vision.num_tokens} placeholders of pixels [3, {side}, {side}]")
            if im.offset < end or im.offset + im.length > len(prompt) or any(
                    t != vision.image_token_id for t in prompt[im.offset:im.offset + im.length]):
                bad(f"image {i} is not on a run of its placeholder tokens in the prompt")
            end = im.offset + im.length
            out.append(PromptImage(im.offset, im.length, tuple(im.shape), im.pixels,
                                   hashlib.blake2b(im.pixels, digest_size=16).digest()))
        if placeholders != len(images) * vision.num_tokens:
            bad(f"the prompt holds the model's image token {placeholders} times where its {len(images)} images "
                f"take {len(images) * vision.num_tokens} (the token stands for an image: not in text)")
        return out

    @property
    def vision(self) -> VisionConfig | None:
        """The model's eyes (None: it reads no images, or not here: under tensor parallelism)."""
        return self.runner.model_cfg.vision if self.runner.model.vision is not None else None

    @property
    def no_images(self) -> str:
        """Why a prompt with images is refused (where ``vision`` is None)."""
        return f"{self.model_name} does not read images" + (
            " under tensor parallelism (its vision tower is not split)" if self.runner.model_cfg.vision else "")

    def _run(self, batch: ScheduledBatch) -> tuple[StepResult, list[Request]]:
        """The step's result, and the requests it ended with "error" (out of memory)."""
        if not batch:
            return StepResult([], None), []
        start = time.perf_counter()
        try:
            result = self.runner.execute(batch)
        except BaseException as e:  # (an interrupt, out of memory): leave nothing half-done for the next step
            failed, drafted = list(batch.requests), batch.num_drafts > 0
            self.scheduler.rollback(batch)
            # Under tensor parallelism the other ranks may be inside a collective of the failed step: only
            # a single rank can go on.
            if not isinstance(e, torch.OutOfMemoryError) or self.runner.tp.size > 1:
                raise
        else:
            self.scheduler.update_from_output(batch, time.perf_counter() - start, self._check_drafts(result))
            return result, []
        # (out here, the exception's traceback, which holds the failed step's tensors, is gone)
        return StepResult([], None), self._recover_from_oom(failed, drafted)

    @staticmethod
    def _check_drafts(result: StepResult) -> dict[str, int] | None:
        """How many of each request's drafts its sampled tokens reject (request id -> that many, the last
        ones), for every request that had drafts."""
        if result.drafts is None:
            return None
        return {req.request_id: len(drafts) - kept for req, drafts, kept in
                zip(result.sampled, result.drafts, result.accepted, strict=True) if drafts}

    def _step_overlapped(self, out: Outputs) -> None:
        """Schedule and launch step N+1 while step N (launched by the last call) runs, then collect N:
        N's deltas into ``out`` (and those of the requests N+1's scheduling or failure ended)."""
        prev = self._in_flight
        batch = self._schedule()
        self._in_flight = None
        failed = self._launch(out, batch, prev)
        # recovered only now: a request that failed with a token in flight has it, and counts it
        errored = self._recover_from_oom(failed) if failed else []
        self._postprocess(out, [*batch.timed_out, *errored], StepResult([], None))

    def _schedule(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.step_batch = (len(batch), batch.num_prompt_tokens)
        if batch.num_prompt_tokens and self.on_prompt_step is not None:
            self.on_prompt_step(batch.num_prompt_tokens)
        return batch

    def _launch(self, out: Outputs, batch: ScheduledBatch, prev: InFlight | None) -> list[Request]:
        """Launch ``batch`` behind ``prev`` (the step in flight, if any), then collect ``prev`` (its deltas
        into ``out``). Returns ``batch``'s requests if it ran out of memory (rolled back, for
        ``_recover_from_oom``). Where ``batch``'s sampling needs ``prev``'s tokens on the host
        (``InFlight.sampling_waits``), ``prev`` is collected between ``batch``'s forward and its sampling:
        the device runs the forward meanwhile."""
        failed = []
        try:
            if batch:
                launched = self.runner.launch_forward(batch)
                self.scheduler.launched(batch)  # (before prev's requests finish: batch's blocks are computed)
            if prev is not None and prev.sampling_waits:
                result, prev = self._collect(prev), None  # (should the collect raise, prev stays in flight)
                self._postprocess(out, [], result)
            if batch:
                launched = self.runner.launch_sampling(launched)
        except BaseException as e:  # as in _run; the step in flight, if not collected, is still to be
            failed = list(batch.requests)
            self.scheduler.rollback(batch)
            if not isinstance(e, torch.OutOfMemoryError):
                self._in_flight = prev
                raise
        else:
            if batch:
                for req in launched.sampled:
                    req.num_in_flight += 1
                self._in_flight = InFlight(batch, launched)
        if prev is not None:
            self._postprocess(out, [], self._collect(prev))
        return failed

    def _collect(self, flight: InFlight) -> StepResult:
        """Wait for the step in flight's tokens (they are no longer in flight)."""
        result = self.runner.collect(flight.launched)
        # the step's own time, not launch to collect: that span holds the next step's launch (on the CPU,
        # its whole forward) and, on CUDA, the wait for the step queued ahead
        self.scheduler.observe(flight.batch, flight.launched.seconds())
        for req in result.sampled:
            req.num_in_flight -= 1
        return result

    def _recover_from_oom(self, failed: list[Request], drafted: bool = False) -> list[Request]:
        """After a step of ``failed`` ran out of memory (and was rolled back): free what the allocator
        caches, end the requests that failed alone (in a step without drafts: ``drafted`` says it had
        some) or for the second time, and let the others come back one at a time, without drafts (the
        scheduler takes none meanwhile). Returns the requests ended."""
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self._steps_since_oom = 0
        self.step_batch = (self.step_batch[0], 0)  # (no prompt token computed)
        log.warning("out of memory in a step of %d requests (%d tokens): rolled back", len(failed),
                    sum(r.num_tokens for r in failed))
        ended = []
        for req in failed:
            if req.status is Status.FINISHED:  # (asynchronous scheduling) by the token it had in flight
                continue
            if (len(failed) == 1 and not drafted) or req.request_id in self._oom_suspects:
                log.error("request %s ends with finish_reason 'error': out of memory in %s (%d tokens)",
                          req.request_id, "a step of its own" if len(failed) == 1 else "a second step",
                          req.num_tokens)
                self._oom_suspects.pop(req.request_id, None)
                self.scheduler.finish(req, "error")
                ended.append(req)
            else:
                self._oom_suspects[req.request_id] = (req, len(req.output_token_ids))
                self.scheduler.one_at_a_time = True
        return ended

    def _forget_cleared_suspects(self) -> None:
        """Drop the suspects that have finished or sampled a token since their out-of-memory step (or have
        one in flight: under asynchronous scheduling a step that launched has its memory); with
        none left, or ``OOM_RECOVERY_STEPS`` steps after the last failure (a suspect that better-ranked
        arrivals keep waiting must not hold the whole server at one admission per step), the scheduler
        admits as many requests at once as it likes again."""
        self._steps_since_oom += 1
        self._oom_suspects = {k: (r, n) for k, (r, n) in self._oom_suspects.items()
                              if r.status is not Status.FINISHED and len(r.output_token_ids) + r.num_in_flight == n
                              and self._steps_since_oom <= OOM_RECOVERY_STEPS}
        if not self._oom_suspects:
            self.scheduler.one_at_a_time = False
            log.info("out-of-memory recovery over: up to %d requests run at once again",
                     self.scheduler.max_num_seqs)

    def _postprocess(self, out: Outputs, ended: list[Request], result: StepResult) -> None:
        """Into ``out``, the deltas of the requests ``ended`` (timed out or errored: finished already) and of
        ``result``'s."""
        for req in ended:
            del self.requests[req.request_id]
            out.add(req.request_id, [], req.num_prompt_tokens, req.num_cached_tokens, req.finish_reason)
        for req, vector in result.pooled:
            if req.status is Status.FINISHED:  # (asynchronous scheduling) aborted or timed out meanwhile
                continue
            self.scheduler.finish(req, "stop")
            del self.requests[req.request_id]
            out.add(req.request_id, [], req.num_prompt_tokens, req.num_cached_tokens, "stop", embedding=vector)
        if result.output is None:
            return
        ids = result.output.token_ids
        spans = None  # each request's row: its token
        if result.drafts is not None:  # its rows: its last position's and its drafts'; it takes the token
            # sampled at the first, then one per draft kept (the token sampled at a draft that was kept: the
            # last of them differs from its draft, or follows the last draft)
            spans, row = [], 0
            for drafts, kept in zip(result.drafts, result.accepted, strict=True):
                spans.append((row, 1 + kept))
                row += 1 + len(drafts)
        lps, finished = result.output.logprobs, Status.FINISHED
        # (the columns appended to in place: most deltas are one token of a running request)
        rids, token_lists = out.request_ids.append, out.token_ids.append
        prompt_counts, cached_counts = out.num_prompt_tokens.append, out.num_cached_tokens.append
        watched, max_model_len = self._eos_set, self.max_model_len
        for i, req in enumerate(result.sampled):
            if req.status is finished:  # (asynchronous scheduling) ended while this token was in flight
                continue
            output = req.output_token_ids
            prompt_logprobs = None if output else req.prompt_logprobs  # (with its first delta)
            if spans is None:
                start, token = i, ids[i]
                tokens = [token]
                output.append(token)
                req.all_token_ids.append(token)
                n, reason = len(output), None  # (most tokens stop nothing: only their length is checked here)
                if req.sampling_state.grammar is not None or token in watched or token in req.stop_token_ids:
                    reason = self._stop_reason(req, token)
                elif n >= req.params.max_tokens or n + req.num_prompt_tokens >= max_model_len:
                    reason = "length"
            else:
                (start, take), tokens, reason = spans[i], [], None
                for token in ids[start:start + take]:
                    tokens.append(token)
                    req.append_token(token)
                    reason = self._stop_reason(req, token)
                    if reason is not None:
                        break
            logprobs = None
            if lps and lps[start] is not None:
                logprobs = lps[start:start + len(tokens)]
            if reason is None and logprobs is None and prompt_logprobs is None:  # (no rare row: Outputs.add's test)
                rids(req.request_id)
                token_lists(tokens)
                prompt_counts(req.num_prompt_tokens)
                cached_counts(req.num_cached_tokens)
                continue
            out.add(req.request_id, tokens, req.num_prompt_tokens, req.num_cached_tokens, reason, logprobs,
                    prompt_logprobs, req.stop_reason)
            if reason is not None:
                self.scheduler.finish(req, reason, cache_computed=len(tokens) > 1)
                del self.requests[req.request_id]

    def _stop_reason(self, req: Request, token: int) -> str | None:
        n = len(req.output_token_ids)
        length = n >= req.params.max_tokens or n + req.num_prompt_tokens >= self.max_model_len
        if req.sampling_state.grammar is not None or token in self._eos_set or token in req.stop_token_ids:
            reason = self._stop_at(req, token, n, length)  # (few tokens: most only count against the length)
            if reason is not None:
                return reason
        return "length" if length else None

    def _stop_at(self, req: Request, token: int, n: int, length: bool) -> str | None:
        """Whether ``token``, the ``n``-th of ``req``'s output, ends it by its grammar or as a stop token
        (``length``: it is the last the request may have)."""
        p, state = req.params, req.sampling_state
        grammar = state.grammar
        if grammar is not None:
            grammar.advance(token)
            if grammar.failed is not None:  # (the token was the end of sequence its mask gave it)
                return self._grammar_failed(req)
        allowed = state.allowed
        if allowed is not None and token in self._eos_set and token not in allowed:
            return "stop"  # allowed_token_ids and bad words (or a grammar) left it nothing else
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self._eos_set:
                return "stop"
            if token in req.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if grammar is not None:
            complete = grammar.finished  # (the next state's mask, most often made here: it may cost too much)
            if grammar.failed is None:
                return "stop" if complete else None  # complete: the JSON value has ended, nothing may follow
            if not length:  # (the output so far is in the grammar, unfinished; at its length, it ends so)
                return self._grammar_failed(req)
        return None

    @staticmethod
    def _grammar_failed(req: Request) -> str:
        log.warning("request %s ends with finish_reason 'error': %s", req.request_id, req.sampling_state.grammar.failed)
        req.stop_reason = req.sampling_state.grammar.failed
        return "error"
