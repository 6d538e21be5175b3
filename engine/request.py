"""A request's life inside the engine: its tokens, how far the KV cache has
caught up with them (``num_computed_tokens``), its blocks and its sampling state.

Torch-free. The scheduler moves requests between waiting and running; the
block manager fills ``block_table``; the engine appends sampled tokens.

Under asynchronous scheduling a token can be sampled and not yet known to the host: a step
still in flight has it on the device (``num_in_flight``). The request is then already
scheduled for its next token, whose input that in-flight token is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.protocol import SamplingParams


@dataclass
class PromptImage:
    """An image of the prompt (``engine.models.vision``): its ``length`` placeholder tokens from ``offset``, its
    pixels (the wire's: float32, channels first) and their hash, which names the blocks holding it."""

    offset: int
    length: int
    shape: tuple[int, ...]
    pixels: bytes
    hash: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


class RequestError(Exception):
    """A request the engine refuses; carries what an HTTP frontend should answer."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.param = status, type, message, param


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "params", "priority", "deadline",
        "status", "num_computed_tokens", "block_table",
        "finish_reason", "stop_reason", "sampling_state", "num_cached_tokens", "num_preemptions",
        "prompt_logprobs", "all_token_ids", "num_prompt_tokens", "stop_token_ids", "arrival_time", "queued_at", "waited",
        "num_output_at_preemption", "cache_salt", "block_hashes", "num_cached_blocks", "num_in_flight",
        "num_prompt_logprobs_in_flight", "pool", "window_from", "lora", "lora_slot", "draft_token_ids",
        "draft_history", "images", "image_embeds", "client", "__weakref__",  # (the scheduler's heaps hold weak references)
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, deadline: float | None = None, sampling_state: Any = None,
                 cache_salt: str = "", pool: Any = None, lora: str = "", lora_slot: int = -1,
                 images: list[PromptImage] | None = None, client: str = ""):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, kept in step with both (read, never set)
        self.params = params
        # Looked up once per sampled token: a set, so the cost does not grow with the list.
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.priority = priority
        self.client = client  # who asked (the fair policy's unit): the caller's address, API key or user (--fair-client)
        self.deadline = deadline
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or on their way: a step in flight)
        self.num_in_flight = 0  # tokens sampled by a step still in flight, not in output_token_ids yet
        self.block_table: list[int] = []
        self.window_from = 0  # first block of block_table whose window block it holds (engine.window_blocks)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token that ended it; or why it failed ("error")
        self.sampling_state = sampling_state
        self.pool = pool  # an embedding request's engine.pooling.PoolState: pooled, never sampled
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.cache_salt = cache_salt  # blocks are shared only between requests with the same salt
        # its LoRA adapter's key (engine.engine.ServedAdapter: the prefix cache's) and slot (engine.lora); "", -1: none
        self.lora, self.lora_slot = lora, lora_slot
        # speculative decoding (engine.speculative): the drafts its latest decode was scheduled with, and
        # the proposer's copy of its tokens
        self.draft_token_ids: list[int] = []
        self.draft_history: Any = None
        self.images = images or []  # in the prompt, in order
        self.image_embeds: dict[int, Any] = {}  # image index -> its embeddings, while a prompt chunk still needs them
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks (block manager's, kept)
        self.num_cached_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_preemptions = 0
        self.num_output_at_preemption = -1  # output tokens when last preempted
        self.arrival_time = 0.0  # unix seconds, set when first queued; kept across preemptions
        self.queued_at = 0.0  # when last queued (first arrival, or preemption)
        self.waited = 0.0  # seconds spent waiting before the last admission, in total
        self.prompt_logprobs: list | None = None
        # positions whose prompt logprobs a step in flight computes: they follow prompt_logprobs' own
        self.num_prompt_logprobs_in_flight = 0

    @property
    def prompt_logprobs_end(self) -> int:
        """Prompt logprobs known or on their way: the next position to compute is this minus one (the
        first token has none: it sits at index 0 as None)."""
        return (len(self.prompt_logprobs) if self.prompt_logprobs else 1) + self.num_prompt_logprobs_in_flight

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_sampled(self) -> int:
        """Output tokens, counting those still in flight."""
        return len(self.output_token_ids) + self.num_in_flight

    @property
    def just_preempted(self) -> bool:
        """Preempted and not one token further since: not to be preempted again (no thrash)."""
        return self.num_sampled <= self.num_output_at_preemption

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
