"""Compile every Triton kernel here for a CUDA target, ahead of time and without
a GPU (Triton ships ptxas): what the interpreter accepts but the compiler
rejects (a ``tl.dot`` under 16 wide, a loop-carried value changing type, a
non-power-of-two range) fails here on a CPU-only machine.

Run ``python -m kernels.triton.compile_check [--all] [--resources]`` with ``TRITON_INTERPRET``
unset. By default one variant of each kernel, in each dtype for attention; the packed kernels' every
format in bf16, and in each dtype and launch shape for ``COMMON``'s (the format's code is its own
branch of ``_expand``, the same in every dtype); ``--all`` adds head sizes 8, 64, 128, fp16 and every
format in every variant. ``--resources`` prints each variant's registers a thread and spilled bytes
(``cuobjdump --dump-resource-usage`` of its cubin, the tool Triton ships beside ptxas), compiled as a
launch specializes it (pointers aligned, strides multiples of 16; unspecialized, the decode kernel takes
255 registers, specialized 66): what bounds how many programs share a multiprocessor, known without a GPU.
The variants compile in a process a core (with a cold Triton cache on 2 cores: 149 s one by one, 71 s).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.reference import PACKED_BLOCKS
from kernels.triton.activation import _act_and_mul_kernel
from kernels.triton.attention_decode import _decode_kernel, _merge_splits_kernel
from kernels.triton.attention_prefill import _prefill_kernel
from kernels.triton.kv_store import _store_kvcache_kernel
from kernels.triton.launch import next_pow2
from kernels.triton.linear_packed import BLOCK_N, FORMATS, _dequantize_kernel, _linear_packed_kernel, _quants
from kernels.triton.moe import _moe_gemm_kernel
from kernels.triton.norm import _rms_norm_kernel
from kernels.triton.rope import _rope_kernel, _rope_store_kernel, heads_per_program
from kernels.triton.sample import BLOCK as SAMPLE_BLOCK
from kernels.triton.sample import ROUNDS, _sample_race_kernel

TARGET = GPUTarget("cuda", 90, 32)  # Hopper; any recent arch catches the same errors
COMMON = ("q4_z", "q4_k")  # the packed formats compiled in every dtype and launch shape (the others: once)
_SCORES = ("qk_scale", "inv_cap", "cap_log2")  # the attention kernels' float arguments


def compile_one(fn, pointers: dict[str, str], constexprs: dict, floats: tuple[str, ...] = (),
                aligned: bool = False) -> tuple[float, bytes]:
    """Compile ``fn`` with the given pointer types; other arguments are i32 (``floats``: fp32). Every constexpr
    must be given (one left out would compile as an i32 argument, and check nothing). ``aligned``: as a launch
    specializes it for torch's tensors, every pointer 16-byte aligned and every ``stride_*`` a multiple of 16
    (vectorized and asynchronous loads: far fewer registers than the general case). Seconds taken, and the
    cubin."""
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr {', '.join(missing)}")
    start = time.perf_counter()
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if aligned and (name in pointers or name.startswith("stride_"))}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options={"num_warps": 4})
    return time.perf_counter() - start, compiled.asm["cubin"]


def resources(cubin: bytes) -> dict[str, int]:
    """A cubin's registers a thread (``REG``) and spilled bytes a thread (``LOCAL``), by Triton's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|LOCAL):(\d+)", out))
    return {"registers": int(found["REG"]), "spilled": int(found["LOCAL"])}


def variants(everything: bool):
    """(kernel, pointer types, constexprs, float args) for each variant to compile."""
    dtypes = ["fp32", "bf16", "fp16"] if everything else ["fp32", "bf16"]
    shapes = [(8, 1, 8), (64, 3, 16), (128, 4, 32)] if everything else [(128, 4, 32)]
    # (q's dtype, the cache's format: 0 the same dtype, 1 e4m3 and 2 e5m2 as their bytes)
    for dt, fmt in [(dt, 0) for dt in dtypes] + [("bf16", 1), ("fp32", 2)]:
        p = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        c = "*u8" if fmt else p
        cache = {"k_cache_ptr": c, "v_cache_ptr": c, "seq_lens_ptr": "*i64"}
        for d, g, page in shapes:
            for split in (False, True):  # (softcap and sinks each both ways: one with the split, one without)
                yield (_decode_kernel,
                       {**cache, "q_ptr": p, "out_ptr": p, "block_tables_ptr": "*i32", "part_acc_ptr": "*fp32",
                        "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "sinks_ptr": "*fp32"},
                       dict(G=g, D=d, PAGE=page, BLOCK_G=16, BLOCK_D=max(16, d), TILE_N=32 if dt == "fp32" else 64,
                            SPLIT=split, SOFTCAP=split, PRECISION=precision, DOT_F32=False, KV_FP8=fmt,
                            SINKS=not split),
                       _SCORES)
            block = 32 if dt == "fp32" else 64
            # (and Qwen2-0.5B's grouping of 7, a program's rows not filled by whole queries)
            for softcap, group in ((False, g), (True, g), *([(False, 7)] if dt == "bf16" and not fmt else [])):
                yield (_prefill_kernel,
                       {**cache, "q_ptr": p, "out_ptr": p, "block_tables_ptr": "*i64", "query_start_ptr": "*i64",
                        "sinks_ptr": "*fp32"},
                       dict(G=group, D=d, PAGE=page, BLOCK_M=block, BLOCK_Q=block // group, BLOCK_D=max(16, d),
                            TILE_N=block, SOFTCAP=softcap, PRECISION=precision, DOT_F32=False, KV_FP8=fmt,
                            SINKS=not softcap), _SCORES)
    p = "*bf16"
    for sinks in (False, True):
        yield (_merge_splits_kernel, {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                                      "out_ptr": p, "sinks_ptr": "*fp32"},
               dict(H=12, D=128, BLOCK_S=8, BLOCK_D=128, SINKS=sinks), ())
    for fmt in (0, 1, 2):
        c = "*u8" if fmt else p
        yield (_store_kvcache_kernel, {"k_ptr": p, "v_ptr": p, "k_cache_ptr": c, "v_cache_ptr": c, "slot_ptr": "*i64"},
               dict(HKV=1, D=64, BLOCK_H=1, BLOCK_D=64, FMT=fmt), ())
    for residual, round_first in itertools.product((False, True), (False, True)):  # (a float32 weight: Gemma's)
        yield (_rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p if round_first else "*fp32", "out_ptr": p,
                                  "res_out_ptr": p},
               dict(HAS_RESIDUAL=residual, ROUND_FIRST=round_first, BLOCK=1024), ("eps",))
    yield (_rope_kernel, {"q_ptr": p, "k_ptr": p, "cos_ptr": p, "sin_ptr": p},
           dict(H=9, HKV=3, HALF=32, BLOCK_H=16, BLOCK_HALF=32), ())
    # (24 of 64 dims a half: partial rotary, Phi-4-mini's; NORM 1 Qwen3's q/k norms, 2 Gemma 3's float32 weights)
    # (and 64 query heads of 128, Qwen3-32B's, four programs a token for them)
    for fmt, half, norm, h, d in ((0, 32, 0, 14, 64), (1, 32, 0, 14, 64), (0, 24, 0, 14, 64), (0, 32, 1, 14, 64),
                                  (1, 32, 2, 14, 64), (0, 24, 2, 14, 64), (0, 64, 1, 64, 128)):
        c = "*u8" if fmt else p
        w = "*fp32" if norm == 2 else p
        yield (_rope_store_kernel, {"q_ptr": p, "k_ptr": p, "v_ptr": p, "cos_ptr": p, "sin_ptr": p, "k_cache_ptr": c,
                                    "v_cache_ptr": c, "slot_ptr": "*i64", "qw_ptr": w, "kw_ptr": w},
               dict(H=h, HKV=h // 8 + 1, D=d, HALF=half, BLOCK_H=heads_per_program(h, h // 8 + 1, d),
                    BLOCK_HALF=next_pow2(half), BLOCK_REST=next_pow2(max(d - 2 * half, 1)), BLOCK_D=d, NORM=norm,
                    FMT=fmt), ("eps",))
    for dt in ("bf16", "fp32"):  # (the model's logits, or processed ones)
        yield (_sample_race_kernel, {"logits_ptr": f"*{dt}", "temp_ptr": "*fp32", "k_floor_ptr": "*fp32",
                                     "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "keys_ptr": "*i64", "out_ptr": "*i64"},
               dict(BLOCK=SAMPLE_BLOCK, ROUNDS=ROUNDS), ())
    for gelu in (False, True):
        yield (_act_and_mul_kernel, {"x_ptr": p, "out_ptr": p}, dict(GELU=gelu, BLOCK=1024), ())
    for dt, block_m, weighted in itertools.product(dtypes, (16, 64), (False, True)):
        yield (_moe_gemm_kernel, {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": "*fp32" if weighted else f"*{dt}",
                                  "weight_ptr": "*fp32", "pairs_ptr": "*i32", "experts_ptr": "*i32",
                                  "total_ptr": "*i64"},
               dict(A_ROWS_PER=1 if weighted else 8, MUL_WEIGHT=weighted, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
                    PRECISION="ieee" if dt == "fp32" else "tf32", DOT_F32=False, FMT=-1, BLOCK_BYTES=0, QUANTS=0), ())
    # packed experts: GPT-OSS's MXFP4 in bf16 as it runs (gate|up, down weighted, down with its bias: weighted
    # after), both block sizes, and in fp32; a GGUF file's formats in bf16 (a prompt's down, a decode's gate|up)
    runs = [("bf16", "mxfp4", rows_per, weighted, block_m) for rows_per, weighted in ((4, False), (1, True), (1, False))
            for block_m in (16, 64)] + [("fp32", "mxfp4", 1, True, 16)]
    runs += [("bf16", f, *run) for f in FORMATS if f != "mxfp4" for run in ((1, True, 64), (4, False, 16))
             if everything or f in COMMON or run[1]]
    for dt, fmt, rows_per, weighted, block_m in runs:
        yield (_moe_gemm_kernel, {"a_ptr": f"*{dt}", "b_ptr": "*u8", "c_ptr": "*fp32" if weighted else f"*{dt}",
                                  "weight_ptr": "*fp32", "pairs_ptr": "*i32", "experts_ptr": "*i32",
                                  "total_ptr": "*i64"},
               dict(A_ROWS_PER=rows_per, MUL_WEIGHT=weighted, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
                    PRECISION="ieee" if dt == "fp32" else "tf32", DOT_F32=False, FMT=FORMATS[fmt],
                    BLOCK_BYTES=PACKED_BLOCKS[fmt][1], QUANTS=_quants(fmt)), ())
    for dt in dtypes:  # (each format with each block_m and split, but not every pair of them)
        for (fmt, number), (block_m, split) in itertools.product(FORMATS.items(), ((16, False), (32, True))):
            if not everything and fmt not in COMMON and (dt != "bf16" or split):
                continue
            yield (_linear_packed_kernel, {"x_ptr": f"*{dt}", "w_ptr": "*u8", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                                           "part_ptr": "*fp32"},
                   dict(FMT=number, BLOCK_BYTES=PACKED_BLOCKS[fmt][1], QUANTS=_quants(fmt),
                        HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                        PRECISION="ieee" if dt == "fp32" else "tf32", DOT_F32=False, SPLIT=split), ())
            if block_m == 16 and not split:
                yield (_dequantize_kernel, {"w_ptr": "*u8", "out_ptr": f"*{dt}"},
                       dict(FMT=number, BLOCK_BYTES=PACKED_BLOCKS[fmt][1], QUANTS=_quants(fmt), BLOCK_N=BLOCK_N), ())


def compiled(i: int, everything: bool, measure: bool) -> str:
    """The ``i``-th variant compiled (by its place: a kernel does not pickle), as its line of the report."""
    fn, pointers, constexprs, floats = next(itertools.islice(variants(everything), i, None))
    seconds, cubin = compile_one(fn, pointers, constexprs, floats)
    used = ""
    if measure:  # (compiled again, as launches specialize it)
        r = resources(compile_one(fn, pointers, constexprs, floats, aligned=True)[1])
        used = f": {r['registers']} registers, {r['spilled']} bytes spilled a thread"
    return f"{fn.__name__} {constexprs} compiled in {seconds:.1f}s{used}"


def main(argv: list[str]) -> int:
    if not isinstance(_decode_kernel, triton.runtime.JITFunction):
        print("TRITON_INTERPRET is set: kernels are interpreted, nothing to compile", file=sys.stderr)
        return 2
    everything, measure = "--all" in argv, "--resources" in argv
    count = sum(1 for _ in variants(everything))
    # one process a core: each compile is one thread's work (LLVM, then ptxas), and Triton's cache takes
    # writers side by side
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(compiled, range(count), itertools.repeat(everything), itertools.repeat(measure)):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
