"""Kernels: tensors in, tensors out. Each call goes to the Triton kernel
(``kernels.triton``), the CPU kernel (``kernels.cpu``) or its pure-torch reference
twin (``kernels.reference``, which is also the spec the others are tested against).

Which one: ``TOKENMILL_KERNELS`` (read once, at import; ``set_backend`` changes
it later):
  - ``auto`` (default): Triton for CUDA tensors, ``kernels.cpu`` for CPU tensors;
  - ``triton``: Triton for every tensor; on the CPU that is Triton's interpreter
    (slow: for tests and debugging);
  - ``reference``: the reference everywhere.
Where triton cannot be imported, everything falls back to the reference, with
one warning if Triton was asked for or a CUDA tensor came by; where the CPU
kernels cannot be compiled, ``kernels.cpu`` itself falls back to the reference
(one warning).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import cpu, reference

log = logging.getLogger("tokenmill.kernels")

BACKENDS = ("auto", "triton", "reference")
_backend = "auto"
_triton: ModuleType | None = None
_triton_failed = False
_batch_invariant = False


def set_backend(name: str) -> None:
    """Pick the kernels for later calls: ``auto``, ``triton`` or ``reference``."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"TOKENMILL_KERNELS must be one of {', '.join(BACKENDS)}, got {name!r}")
    _backend = name


def backend() -> str:
    return _backend


def _load_triton() -> ModuleType | None:
    """``kernels.triton``, imported on first use (importing triton costs ~1 s), or None."""
    global _triton, _triton_failed
    if _triton is None and not _triton_failed:
        try:
            import kernels.triton as t
            _triton = t
        except ImportError as e:  # no triton on this platform: the references serve
            _triton_failed = True
            log.warning("Triton kernels unavailable (%s); using the reference kernels", e)
    return _triton


def _pick(t: torch.Tensor) -> ModuleType:
    if _backend == "reference":
        return reference
    if _backend == "auto" and t.device.type != "cuda":
        return cpu if t.device.type == "cpu" else reference
    return _load_triton() or reference


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    _pick(k).store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (``reference.paged_decode_attention``); ``sinks`` (H,) float32: GPT-OSS's
    attention sinks (None: none)."""
    return _pick(q).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, window,
                                           softcap, sinks)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            q_index: torch.Tensor, out_index: torch.Tensor, max_seq_len: int,
                            scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (``reference.paged_prefill_attention``); ``window``: a sliding window's length
    (0: none); ``softcap``: Gemma 2's cap on the scores (0: none); ``sinks``: as decode's."""
    return _pick(q).paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, q_index,
                                            out_index, max_seq_len, scale, window, softcap, sinks)


UNSPLIT_CONTEXT = 4096  # (prefill_takes_decodes) a prefill program streams this many keys in a few microseconds


def prefill_takes_decodes(device: torch.device, longest: int = 0, streamed: int = 0) -> bool:
    """Whether a step's one-token sequences go to ``paged_prefill_attention`` with its prompt chunks (one launch a
    layer, no rows split apart and put back): Triton's, whose prefill kernel costs a one-token sequence what its
    decode kernel does, while no sequence's context is the step's critical path. One program streams a sequence's
    context (``longest``: the most tokens one has cached) for each KV head: at most ``UNSPLIT_CONTEXT`` keys, or
    no more than each multiprocessor streams anyway (``streamed``: the cached tokens of every sequence times the
    KV heads, spread over the device's multiprocessors), as when many long sequences fill the device. Past that
    the decode kernel splits a long context over the device, where the prefill one would stream it alone. The
    CPU's and the reference's take them to ``paged_decode_attention``."""
    if _backend == "reference" or (_backend == "auto" and device.type != "cuda"):
        return False
    if _load_triton() is None:
        return False
    return longest <= UNSPLIT_CONTEXT or longest * multiprocessors(device) <= streamed


def races(device: torch.device) -> bool:
    """Whether ``sample_race`` runs Triton's kernel for tensors on ``device`` (CUDA, or any device with the
    ``triton`` backend); elsewhere the sampler's torch operators sort each row instead."""
    if _backend == "reference" or (_backend == "auto" and device.type != "cuda"):
        return False
    return _load_triton() is not None


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """One token a row by the exponential race over what top-k, top-p and min-p keep (``reference.sample_race``);
    ``max_k``: the largest of ``top_k`` where the caller knows it without asking the device (0: no row has one)."""
    m = _pick(logits)
    return (m if hasattr(m, "sample_race") else reference).sample_race(logits, temperature, top_k, top_p, min_p,
                                                                       keys, max_k)


def multiprocessors(device: torch.device) -> int:
    """How many programs run at once, roughly: CUDA's streaming multiprocessors; elsewhere (Triton's
    interpreter) one."""
    return _load_triton().launch.sm_count(device) if device.type == "cuda" else 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: str | None = None) -> torch.Tensor:
    """``F.linear``; for CPU tensors (``auto``) ``kernels.cpu.linear``, which takes the steps of few
    rows where ``tune_linear`` measured its C kernel faster. ``packed``: ``weight`` is uint8 rows of
    blocks in that format (``reference.PACKED_BLOCKS``), multiplied as they are by the CPU's C
    kernel or Triton's (``_pick``), on the exact weights (``reference.linear_packed``)."""
    if packed is not None:
        return _pick(x).linear_packed(x, weight, packed, bias)
    if _backend == "auto" and x.device.type == "cpu":
        return cpu.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def packed_formats(device: torch.device) -> frozenset[str]:
    """The block formats (``reference.PACKED_BLOCKS``) the kernels for ``device`` multiply as they are, so that
    a loader keeps weights in them packed: Triton's (all of them) on CUDA or with ``TOKENMILL_KERNELS=triton``; on
    the CPU the C kernel's (all of them too), unless turned off
    (``TOKENMILL_CPU_LINEAR_ROWS=0``); none with the reference kernels or where Triton cannot be imported."""
    if _backend == "reference":
        return frozenset()
    if _backend == "auto" and device.type == "cpu":
        from kernels.cpu import matmul

        return frozenset(matmul.FORMATS) if matmul.keep_packed() else frozenset()
    t = _load_triton() if device.type == "cuda" or _backend == "triton" else None
    return frozenset(t.PACKED_FORMATS) if t is not None else frozenset()


def embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, packed: str | None = None) -> torch.Tensor:
    """Rows ``ids`` of ``weight`` in ``dtype``; ``packed`` as for ``linear``: only those rows expanded (by Triton
    on the device, with no host copy: a captured decode step holds it)."""
    if packed is None:
        return F.embedding(ids, weight).to(dtype)
    weights, size = reference.PACKED_BLOCKS[packed]
    shape = (*ids.shape, weight.shape[1] // size * weights)  # (no ids: no rows, still this wide)
    if _backend == "auto" and weight.device.type == "cpu":
        return cpu.dequantize(weight, packed, ids.reshape(-1)).view(shape).to(dtype)
    module = _pick(weight)
    rows = weight[ids.reshape(-1)]
    if module is _triton and packed in module.PACKED_FORMATS:
        return module.dequantize(rows, packed, dtype).view(shape)
    return reference.dequantize(rows, packed).view(shape).to(dtype)


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode (vLLM's ``VLLM_BATCH_INVARIANT``), for CPU tensors and the ``auto`` kernels
    (``kernels.cpu.set_batch_invariant``): a token's logits come out the same bits whatever else its step
    holds (other requests, a prompt's chunk, a cached prefix, a recomputation), so greedy output never
    depends on the batch. ValueError for other kernels; RuntimeError where the CPU kernels do not build."""
    global _batch_invariant
    if on and _backend != "auto":
        raise ValueError(f"batch-invariant mode runs on the CPU's own kernels (TOKENMILL_KERNELS=auto), not {_backend}")
    cpu.set_batch_invariant(on)
    _batch_invariant = on


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (``set_batch_invariant``)."""
    return _batch_invariant


def tune_linear(weights: list[torch.Tensor]) -> None:
    """Decide which CPU linear serves each of these weights' shapes (``kernels.cpu.matmul.tune``);
    nothing for CUDA tensors or other backends."""
    if _backend == "auto":
        cpu.tune_linear(weights)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _pick(x).rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _pick(x).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _pick(x).silu_and_mul(x)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return by_rows(_pick(x).gelu_and_mul, x)


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, for torch's elementwise operators with a tanh, a sigmoid or an exp in them, over x (T, ...); in
    batch-invariant mode a row at a time. Torch computes most of a tensor in vector code, and the elements after
    its last whole vector (and after each thread's) in scalar code whose last bits differ: which path a row's
    numbers take depends on the rows beside it. A row at a time, never."""
    if not (_batch_invariant and x.is_cpu and x.dim() >= 2 and x.shape[0] > 1):
        return fn(x)
    return torch.cat([fn(row) for row in x.split(1)])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, packed: str | None = None, packed_down: str | None = None,
              bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
              act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The routed experts of a mixture of experts (``reference.fused_moe``). ``packed``: the experts'
    weights are uint8 rows of blocks in that format (w2's in ``packed_down``, default the same): Triton's
    fused MoE expands them in its GEMMs where it reads both formats; elsewhere each expert's (E, N, bytes)
    slice is multiplied as ``linear`` multiplies a packed weight, in the reference's loop over experts.
    GPT-OSS's: ``bias13``, ``bias2`` and ``act`` (None: SiLU-and-mul), the reference's."""
    extra = {"bias13": bias13, "bias2": bias2} | ({"act": act} if act is not None else {})
    if packed is None and packed_down is not None:
        raise ValueError("packed_down needs packed (gate|up's format) too")
    if packed is not None:
        down = packed_down or packed
        module = _pick(x)
        if module is _triton and {packed, down} <= module.PACKED_FORMATS.keys():
            return module.fused_moe(x, w13, w2, topk_weights, topk_ids, packed=packed, packed_down=down, **extra)
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids,
                                   linear=lambda a, w: _pick(a).linear_packed(a, w, packed),
                                   linear_down=lambda a, w: _pick(a).linear_packed(a, w, down), **extra)
    return _pick(x).fused_moe(x, w13, w2, topk_weights, topk_ids, **extra)


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU (``reference.swiglu_oai``): a few torch operators on every backend."""
    return by_rows(lambda rows: reference.swiglu_oai(rows, alpha, limit), x)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _pick(q).apply_rope_(q, k, cos, sin)


def rope_and_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rot: int,
                    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """A layer's new q, k (T, heads, D) and v made ready and k, v stored: with ``norms`` (q's (D,) weight, k's,
    eps) ``rms_norm`` of each head first, in place; ``apply_rope_`` on the first ``rot`` dims of each head; then
    ``store_kvcache``. Triton's in one launch; elsewhere these, one after the other (the spec)."""
    m = _pick(q)
    if hasattr(m, "rope_and_store_"):
        m.rope_and_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, rot, norms)
        return
    if norms is not None:
        for x, w in zip((q, k), norms[:2], strict=True):
            x.copy_(m.rms_norm(x.reshape(-1, x.shape[-1]), w, norms[2]).view(x.shape))
    m.apply_rope_(q[..., :rot], k[..., :rot], cos, sin)
    m.store_kvcache(k, v, k_cache, v_cache, slot_mapping)


set_backend(os.environ.get("TOKENMILL_KERNELS", "auto"))

__all__ = ["BACKENDS", "apply_rope_", "backend", "embedding", "fused_add_rms_norm", "fused_moe", "gelu_and_mul",
           "linear", "paged_decode_attention", "paged_prefill_attention", "prefill_takes_decodes", "rms_norm", "rope_and_store_",
           "set_backend", "silu_and_mul", "store_kvcache", "swiglu_oai", "tune_linear"]
