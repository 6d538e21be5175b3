"""Engine configuration: what the user asked for (frozen, validated once).

What is found at start-up (the device and dtype picked for "auto", the number
of KV blocks that fit, the model's real max length) lives apart, in
``engine.runtime.RuntimeFacts``. Torch-free, so the launcher can build and
validate it before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.speculative import NgramConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority", "short-first", "fair")  # engine.request_queue has one queue for each
FAIR_CLIENTS = ("address", "key", "user")  # who a client is for the fair policy (frontends' OpenAIApi.client_of)
ASYNC_SCHEDULING = ("auto", "on", "off")
# the int4 checkpoints engine.quant reads (vLLM's names; its Marlin kernels' names mean the same files here)
QUANTIZATIONS = ("awq", "gptq", "awq_marlin", "gptq_marlin")
POOLING_TYPES = ("last", "mean", "cls")  # how an embedding is pooled from a prompt's hidden states (engine.pooling)
# what the KV cache holds (vLLM's names): auto = the model's dtype; fp8 = fp8_e4m3 (engine.runtime.pick_kv_dtype)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MAX_IMAGES = 16  # images one prompt may hold unless limit_mm_per_prompt says otherwise
# vLLM's switch for loading LoRA adapters while serving (max_loras), and the free slots it gives by default
RUNTIME_LORA_ENV, SPARE_LORA_SLOTS = "VLLM_ALLOW_RUNTIME_LORA_UPDATING", 4


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value ("1", "true", "yes", "on"; any case), as
    vLLM reads its switches (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, ``VLLM_SERVER_DEV_MODE``)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None  # defaults to the model's folder/file name
    tokenizer: str | None = None  # vLLM's --tokenizer: a folder or .gguf whose tokenizer serves; None = the model's
    generation_config: str = "auto"  # default sampling: auto (the model's generation_config.json), vllm, a folder
    hf_overrides: dict | None = None  # vLLM's --hf-overrides: config.json values replaced before it is read
    override_generation_config: dict | None = None  # sampling defaults on top of those (temperature, top_p...)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    quantization: str | None = None  # vLLM's --quantization: the checkpoint must be this; None = what it says
    device: str = "auto"
    block_size: int = 16  # tokens per KV block
    max_model_len: int | None = None  # None = the model's own, capped at 8192 on CPU
    max_num_seqs: int = 64  # sequence budget per step
    max_num_batched_tokens: int = 2048  # token budget per step (chunked prefill)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = 1 GiB on CPU, gpu_memory_utilization's on CUDA
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: fp8 holds twice bf16's tokens in the same memory, rounded
    enable_prefix_caching: bool = True  # share the KV blocks of common prompt prefixes
    # sliding-window layers keep every block, as the others (vLLM's flag): no pool of their own (engine.window_blocks)
    disable_hybrid_kv_cache_manager: bool = False
    num_kv_blocks: int | None = None  # override the computed number of KV blocks (tests, tuning)
    max_num_waiting_requests: int = 1024  # bounded waiting queue; more is refused (HTTP 429)
    scheduling_policy: str = "fcfs"  # fcfs | priority | short-first | fair (engine.request_queue)
    scheduling_aging_seconds: float = 30.0  # waiting this long is worth one rank step (no starvation); inf: off
    # vLLM's: beside decodes, waiting prompts join once the oldest has waited this many times the last step
    # with prompt tokens took (fewer, larger such steps); 0: at once; None: 1 on CUDA with graphs (measured
    # while such steps ran eagerly), 0 elsewhere
    scheduler_delay_factor: float | None = None
    long_prefill_token_threshold: int | None = None  # a request's prompt tokens per step beside decodes; None = measured
    request_timeout: float | None = None  # seconds; a request without its own timeout gets this one
    log_stats_interval: float = 10.0  # seconds between the engine's stats lines while it works (engine.stats_log); 0: none
    seed: int = 0
    # embeddings: {"pooling_type": "last" | "mean", "normalize": bool} over the model's own (vLLM's --pooler-config)
    pooler_config: dict | None = None
    enforce_eager: bool = False  # no CUDA (or CPU) graphs, every decode step runs eagerly (vLLM's --enforce-eager)
    # CUDA: steps with prompt tokens of up to this many tokens (and max_num_batched_tokens) replay graphs; 0: none
    prompt_graph_tokens: int = 2048
    # a token's logits the same bits in any batch (kernels.set_batch_invariant; vLLM's VLLM_BATCH_INVARIANT): CPU only
    batch_invariant: bool = False
    # schedule step N+1 while step N runs (engine.engine); auto = on CUDA, off on the CPU
    async_scheduling: str = "auto"
    # LoRA adapters (engine.lora), name -> PEFT folder: a request whose model is the name runs with it (vLLM's
    # --lora-modules); every one is kept on the device. max_lora_rank: the largest rank they may have
    lora_modules: dict[str, str] | None = None
    max_lora_rank: int = 16
    # slots on the device for adapters: those of lora_modules, and the others take adapters loaded while serving
    # (Engine.load_lora), every attention and MLP projection ready for them, at max_lora_rank; None: one slot
    # per adapter of lora_modules, and none loaded while serving
    max_loras: int | None = None
    # speculative decoding (engine.speculative), vLLM's --speculative-config: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": n, "prompt_lookup_max": m}; None: off
    speculative_config: dict | None = None
    # vLLM's --limit-mm-per-prompt: {"image": n}, the most images one prompt may hold (a LLaVA model's)
    limit_mm_per_prompt: dict | None = None
    tensor_parallel_size: int = 1  # ranks the model is split over (engine.parallel); rank 0 is the engine
    # tensor parallel across machines (torchrun's names): the ranks spread evenly over nnodes hosts;
    # node 0 runs the engine (rank 0), node k > 0 only its workers (engine.tp_worker.run_node)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's address (its rendezvous); None = 127.0.0.1, one node only
    master_port: int | None = None  # None = a free port on one node, 29500 (torchrun's) across nodes

    @property
    def max_images(self) -> int:
        """Images one prompt may hold (``limit_mm_per_prompt``'s, else ``DEFAULT_MAX_IMAGES``)."""
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_MAX_IMAGES)

    @property
    def speculative(self) -> NgramConfig | None:
        """``speculative_config`` read (None: off)."""
        return NgramConfig.of(self.speculative_config) if self.speculative_config is not None else None

    def overlapped(self, device_type: str) -> tuple[bool, str]:
        """Whether a step is scheduled and launched while the last one runs (asynchronous scheduling, the
        engine's) on a device of that type; and, where it was asked for but is off, why (else "")."""
        on = self.async_scheduling == "on" or (self.async_scheduling == "auto" and device_type == "cuda")
        if on and self.tensor_parallel_size > 1:
            return False, "not under tensor parallelism"
        if on and self.speculative_config is not None:
            return False, ("not with speculative decoding (a step's input is known only once the last step's "
                           "drafts are checked)")
        return on, ""

    @property
    def max_step_rows(self) -> int:
        """The most one-token sequences a step can hold: each request's token, and its drafts with speculative
        decoding (each a sequence of its own, ``engine.model_runner``)."""
        spec = self.speculative
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            bad(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.device not in DEVICES:
            bad(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            bad(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            bad(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        mm = self.limit_mm_per_prompt or {}
        if set(mm) - {"image", "video", "audio"} or not all(type(n) is int and n >= 0 for n in mm.values()):
            bad(f"limit_mm_per_prompt takes {{\"image\": n}} (n >= 0; video and audio are read nowhere here), got "
                f"{self.limit_mm_per_prompt!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_num_waiting_requests < 1:
            bad(f"max_num_waiting_requests must be positive, got {self.max_num_waiting_requests}")
        if self.scheduling_policy not in POLICIES:
            bad(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {self.scheduling_policy!r}")
        if not self.scheduling_aging_seconds > 0:  # inf turns aging off
            bad(f"scheduling_aging_seconds must be positive (or inf), got {self.scheduling_aging_seconds}")
        if self.scheduler_delay_factor is not None and not 0 <= self.scheduler_delay_factor < float("inf"):
            bad(f"scheduler_delay_factor must be 0 (none) or a positive number, got {self.scheduler_delay_factor}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            bad(f"long_prefill_token_threshold must be positive, got {self.long_prefill_token_threshold}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            bad(f"request_timeout must be a positive number of seconds, got {self.request_timeout}")
        if not 0 <= self.log_stats_interval < float("inf"):
            bad(f"log_stats_interval must be 0 (none) or a number of seconds, got {self.log_stats_interval}")
        if not isinstance(self.prompt_graph_tokens, int) or self.prompt_graph_tokens < 0:
            bad(f"prompt_graph_tokens must be 0 (none) or a positive number of tokens, got {self.prompt_graph_tokens!r}")
        if not isinstance(self.enforce_eager, bool):
            bad(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.batch_invariant, bool):
            bad(f"batch_invariant must be true or false, got {self.batch_invariant!r}")
        if self.async_scheduling not in ASYNC_SCHEDULING:
            bad(f"async_scheduling must be one of {', '.join(ASYNC_SCHEDULING)}, got {self.async_scheduling!r}")
        if self.pooler_config is not None:
            pc = self.pooler_config
            if not isinstance(pc, dict) or set(pc) - {"pooling_type", "normalize"}:
                bad(f"pooler_config must be a map of pooling_type and normalize, got {pc!r}")
            if "pooling_type" in pc and str(pc["pooling_type"]).lower() not in POOLING_TYPES:
                bad(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pc['pooling_type']!r}")
            if not isinstance(pc.get("normalize", True), bool):
                bad(f"pooler_config normalize must be true or false, got {pc['normalize']!r}")
        if self.lora_modules is not None and (not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items())):
            bad(f"lora_modules must map adapter names to their folders, got {self.lora_modules!r}")
        if not 1 <= self.max_lora_rank <= 512:
            bad(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_loras is not None and (isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int)
                                           or not max(1, len(self.lora_modules or ())) <= self.max_loras <= 256):
            bad(f"max_loras must be in [1, 256] and hold the {len(self.lora_modules or ())} adapters of lora_modules, "
                f"got {self.max_loras}")
        if self.speculative_config is not None:
            _ = self.speculative  # (raises ValueError with the reason)
        if self.tensor_parallel_size < 1:
            bad(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.nnodes < 1:
            bad(f"nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            bad(f"node_rank must be in [0, nnodes) = [0, {self.nnodes}), got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            bad(f"tensor_parallel_size {self.tensor_parallel_size} is not divisible by nnodes {self.nnodes}: "
                f"every node runs tensor_parallel_size / nnodes ranks")
        if self.nnodes > 1 and not self.master_addr:
            bad(f"nnodes {self.nnodes} needs master_addr (--master-addr): the address of node 0, where the "
                f"ranks meet")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            bad(f"master_port must be in [1, 65535], got {self.master_port}")
