"""vLLM's ``serve`` flags that tokenmill takes only so that the usual vLLM command lines (a compose file,
a Kubernetes manifest) start unchanged. Each one either holds here already or cannot apply here, and its
``--help`` says which; a value tokenmill cannot honour is refused as argparse refuses any bad value
(exit 2, naming the flag and the values it takes). None of them sets anything. (vLLM's spellings of
flags tokenmill has, ``serve MODEL``, ``--dtype half``, ``--max-model-len 32k``, ``-asc``, are in
``engine.cli``.)
"""

from __future__ import annotations

import argparse

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _at_most_20(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 20:
        raise argparse.ArgumentTypeError(f"{n}: a token's top logprobs are at most 20 here")
    return n


def add(parser: argparse.ArgumentParser) -> None:
    v = parser.add_argument_group("accepted from vLLM command lines (each holds here already, or cannot apply)")
    v.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                   help="no code from a model's folder runs here: every architecture is tokenmill's own")
    v.add_argument("--enable-chunked-prefill", action="store_true",
                   help="prompts are always prefilled in chunks here (--max-num-batched-tokens a step)")
    v.add_argument("--enable-log-requests", action="store_true",
                   help="finished requests are logged by default here (--disable-log-requests)")
    v.add_argument("--disable-uvicorn-access-log", action="store_true", dest="disable_log_requests",
                   help="as --disable-log-requests (the HTTP server is tokenmill's own)")
    v.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                   help="the log level is $TOKENMILL_LOG_LEVEL's here")
    v.add_argument("--max-logprobs", type=_at_most_20, default=None, metavar="N",
                   help="a token's top logprobs are at most 20 here, chats and completions alike (vLLM's "
                        "default; more is refused)")
    v.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens is always reported here")
    v.add_argument("--enable-reasoning", action="store_true",
                   help="reasoning is split off wherever the chat template shows it (--reasoning-parser)")
    v.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor-parallel ranks all-reduce through torch.distributed (NCCL, gloo) here")
    v.add_argument("--compilation-config", "-O", default=None, metavar="JSON_OR_LEVEL",
                   help="no torch.compile settings here: decode steps replay as CUDA (or CPU) graphs, "
                        "--enforce-eager turns that off")
    v.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="a preempted request is recomputed (its prefix from the cache), never swapped out")
    v.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                   help="decode steps replay as graphs whatever their context's length")
    v.add_argument("--download-dir", default=None, metavar="DIR",
                   help="nothing is downloaded here: --model is a local folder or .gguf file")
    v.add_argument("--revision", default=None, metavar="REV", help="as --download-dir")
    v.add_argument("--load-format", choices=("auto", "safetensors", "gguf"), default=None,
                   help="read off --model: safetensors in a folder, or a .gguf file")
    v.add_argument("--tokenizer-mode", choices=("auto", "hf"), default=None,
                   help="tokenizers are transformers' here (--tokenizer for another one)")
    v.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="structured output is tokenmill's own automaton here, whatever backend is named: JSON "
                        "schemas, choices, regexes and GBNF grammars")
    v.add_argument("--guided-decoding-backend", default=None, metavar="NAME", help="as --structured-outputs-config")
    v.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="every adapter is kept on the device here, in a slot of its own (--max-loras): one step "
                        "mixes them all, none waits for a slot")
    v.add_argument("--lora-dtype", choices=("auto",), default=None, help="adapters are kept in the model's dtype")
    v.add_argument("--fully-sharded-loras", action="store_true",
                   help="under tensor parallel each rank keeps its share of every adapter here")
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, choices=(1,), default=None,
                   help="no pipeline parallelism here: --tensor-parallel-size and --data-parallel-size split "
                        "the work")
    v.add_argument("--distributed-executor-backend", choices=("mp", "uni"), default=None,
                   help="tensor-parallel ranks are processes here, over torch.distributed (as mp)")
