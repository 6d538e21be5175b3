"""The engine: requests in, token deltas out, one ``step()`` at a time.

``step()`` is schedule → run → postprocess and does no I/O; the actor in
``engine.server`` (or ``LLM`` offline) drives it.

A step that runs out of device memory is rolled back and the engine keeps serving:
its requests wait again and come back one at a time; a request that is in a second
failing step (or alone in one) ends with finish reason "error", so one request too
big for the memory can neither loop forever nor take the others down.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_path import model_name, resolve_model_path
from engine.model_runner import ModelRunner, StepResult
from engine.prefill_cap import PrefillCap
from engine.protocol import Delta, Ready, SamplingParamError, SamplingParams, Stats
from engine.request import Request, Status
from engine.runtime import kv_block_bytes
from engine.sampler import SamplingState
from engine.scheduler import PromptTooLong, QueueFull, ScheduledBatch, Scheduler

log = logging.getLogger("tokenmill.engine")

OOM_RECOVERY_STEPS = 64  # steps after an out-of-memory step before admissions are back to normal regardless


class RequestError(Exception):
    """A request the engine refuses; carries what an HTTP frontend should answer."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.param = status, type, message, param


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve_model_path(config.model)
        self.model_name = config.served_model_name or model_name(path)
        self.runner = ModelRunner(config, path)
        facts = self.runner.facts
        capacity = facts.num_kv_blocks * config.block_size
        if capacity < facts.max_model_len:  # never advertise a length the cache cannot hold
            log.warning("max_model_len lowered from %d to %d: the KV cache holds only %d blocks of %d tokens "
                        "(give it more memory with --kv-cache-memory on CPU or --gpu-memory-utilization on "
                        "CUDA, or ask for a smaller --max-model-len)", facts.max_model_len, capacity,
                        facts.num_kv_blocks, config.block_size)
        self.max_model_len = min(facts.max_model_len, capacity)
        self.vocab_size = self.runner.model_cfg.vocab_size
        self.eos_token_ids = list(self.runner.model_cfg.eos_token_ids)
        self._eos_set = frozenset(self.eos_token_ids)  # looked up once per sampled token
        # the cache is this process's: the model and dtype are the same for every block, named for clarity
        self.block_manager = BlockManager(facts.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          f"{facts.model_path}|{facts.dtype}".encode())
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_num_waiting_requests, config.scheduling_policy, config.scheduling_aging_seconds,
            PrefillCap(config.max_num_batched_tokens, config.long_prefill_token_threshold))
        self.requests: dict[str, Request] = {}
        # id -> (request, its output length then) for the requests of a step that ran out of memory, until
        # they sample a token: while there are any, the scheduler admits one at a time
        self._oom_suspects: dict[str, tuple[Request, int]] = {}
        self._steps_since_oom = 0
        per_token = kv_block_bytes(self.runner.model_cfg, 1, facts.dtype)
        log.info("engine ready: %s on %s (%s); KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, "
                 "%d bytes per token), prefix caching %s; max_model_len %d: at most %.1f requests of that "
                 "length at once", self.model_name, facts.device, str(facts.dtype).removeprefix("torch."),
                 facts.num_kv_blocks, config.block_size, capacity, capacity * per_token / 2**20, per_token,
                 "on" if config.enable_prefix_caching else "off", self.max_model_len,
                 capacity / self.max_model_len)

    # ------------------------------------------------------------------ the actor's interface

    def ready_info(self) -> Ready:
        return Ready(self.model_name, self.max_model_len, self.vocab_size, self.eos_token_ids,
                     self.config.max_num_seqs, self.block_manager.num_blocks, self.config.block_size,
                     self.config.max_num_waiting_requests)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, deadline: float | None = None, cache_salt: str = "") -> None:
        self._check(request_id, prompt_token_ids, params)
        if deadline is None and self.config.request_timeout is not None:
            deadline = time.time() + self.config.request_timeout
        req = Request(request_id, prompt_token_ids, params, priority, deadline, SamplingState(params),
                      cache_salt)
        try:
            self.scheduler.add(req)
        except QueueFull as e:
            raise RequestError(429, "rate_limit_error", f"server busy: {e}; retry later") from e
        except PromptTooLong as e:
            raise RequestError(400, "invalid_request_error", str(e), "prompt") from e
        self.requests[request_id] = req

    def abort(self, request_ids: list[str] | str) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> Stats:
        bm, s = self.block_manager, self.scheduler
        return Stats(len(s.waiting), len(s.running), bm.usage, bm.num_free_blocks, bm.num_blocks,
                     s.num_preemptions, s.num_timeouts, s.prefix_cache_hit_rate, bm.num_evictions,
                     s.kv_fragmentation)

    def step(self) -> list[Delta]:
        if self.scheduler.one_at_a_time:
            self._forget_cleared_suspects()
        batch = self.scheduler.schedule()
        result, errored = self._run(batch)
        return self._postprocess(batch, result, errored)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit)."""
        self.runner.close()

    # ------------------------------------------------------------------ internals

    def _check(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        def bad(msg: str, param: str | None = None) -> None:
            raise RequestError(400, "invalid_request_error", msg, param)

        if request_id in self.requests:
            bad(f"request id {request_id!r} is already in use")
        if not prompt:
            bad("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            bad(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        try:  # the sampler would ignore them, but a client asking for them has a bug to hear about
            params.check_vocab(self.vocab_size)
        except SamplingParamError as e:
            bad(str(e), e.param)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            bad(f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({len(prompt)} in the prompt + {params.max_tokens} max_tokens)",
                "max_tokens")

    def _run(self, batch: ScheduledBatch) -> tuple[StepResult, list[Request]]:
        """The step's result, and the requests it ended with "error" (out of memory)."""
        if not batch:
            return StepResult([], None), []
        start = time.perf_counter()
        try:
            result = self.runner.execute(batch)
        except BaseException as e:  # (an interrupt, out of memory): leave nothing half-done for the next step
            failed = list(batch.requests)
            self.scheduler.rollback(batch)
            # Under tensor parallelism the other ranks may be inside a collective of the failed step: only
            # a single rank can go on.
            if not isinstance(e, torch.OutOfMemoryError) or self.runner.tp.size > 1:
                raise
        else:
            self.scheduler.update_from_output(batch, time.perf_counter() - start)
            return result, []
        # (out here, the exception's traceback, which holds the failed step's tensors, is gone)
        return StepResult([], None), self._recover_from_oom(failed)

    def _recover_from_oom(self, failed: list[Request]) -> list[Request]:
        """After a step of ``failed`` ran out of memory (and was rolled back): free what the allocator
        caches, end the requests that failed alone or for the second time, and let the others come back
        one at a time. Returns the requests ended."""
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self._steps_since_oom = 0
        log.warning("out of memory in a step of %d requests (%d tokens): rolled back", len(failed),
                    sum(r.num_tokens for r in failed))
        ended = []
        for req in failed:
            if len(failed) == 1 or req.request_id in self._oom_suspects:
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
        """Drop the suspects that have finished or sampled a token since their out-of-memory step; with
        none left, or ``OOM_RECOVERY_STEPS`` steps after the last failure (a suspect that better-ranked
        arrivals keep waiting must not hold the whole server at one admission per step), the scheduler
        admits as many requests at once as it likes again."""
        self._steps_since_oom += 1
        self._oom_suspects = {k: (r, n) for k, (r, n) in self._oom_suspects.items()
                              if r.status is not Status.FINISHED and len(r.output_token_ids) == n
                              and self._steps_since_oom <= OOM_RECOVERY_STEPS}
        if not self._oom_suspects:
            self.scheduler.one_at_a_time = False
            log.info("out-of-memory recovery over: up to %d requests run at once again",
                     self.scheduler.max_num_seqs)

    def _postprocess(self, batch: ScheduledBatch, result: StepResult, errored: list[Request]) -> list[Delta]:
        deltas = []
        for req in [*batch.timed_out, *errored]:  # finished by the scheduler already
            del self.requests[req.request_id]
            deltas.append(Delta(req.request_id, [], req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                                num_cached_tokens=req.num_cached_tokens))
        if result.output is None:
            return deltas
        out = result.output
        for i, req in enumerate(result.sampled):
            token = out.token_ids[i]
            first = not req.output_token_ids
            req.append_token(token)
            reason = self._stop_reason(req, token)
            delta = Delta(req.request_id, [token], reason,
                          logprobs=[out.logprobs[i]] if out.logprobs and out.logprobs[i] is not None else None,
                          num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                          prompt_logprobs=req.prompt_logprobs if first else None,
                          stop_reason=req.stop_reason)
            deltas.append(delta)
            if reason is not None:
                self.scheduler.finish(req, reason)
                del self.requests[req.request_id]
        return deltas

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self._eos_set:
                return "stop"
            if token in req.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if n >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
