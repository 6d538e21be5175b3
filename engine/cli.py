"""The ``tokenmill`` console script: ``tokenmill serve``, ``tokenmill engine`` and ``tokenmill generate``.

``tokenmill engine --listen tcp://HOST:PORT`` is a headless engine for frontends on
other machines (``tokenmill serve --engine tcp://HOST:PORT``); both sides hold the
same engine key, from which the ZMQ CURVE keys are derived (``protocol.curve_keys``).
``tokenmill engine --node-rank K`` (K > 0, with ``--nnodes``, ``--master-addr``) runs no
engine: only this host's share of node 0's tensor-parallel ranks (``tp_worker.run_node``).

Flags are named as vLLM's. Engine flags left out keep ``EngineConfig``'s
defaults (one source of truth); the config is validated before any process
starts, and a bad value exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from urllib.parse import urlsplit

from engine import vllm_flags
from engine.config import (
    ASYNC_SCHEDULING,
    DEVICES,
    DTYPES,
    FAIR_CLIENTS,
    KV_CACHE_DTYPES,
    POLICIES,
    QUANTIZATIONS,
    RUNTIME_LORA_ENV,
    SPARE_LORA_SLOTS,
    EngineConfig,
    env_flag,
)
from engine.config_file import Parser

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``1073741824``, ``512M``, ``4GiB``, ``1.5G`` (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4G, 512MiB or a number of bytes)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


def _json_map(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _mm_limits(text: str) -> dict:
    """vLLM's ``--limit-mm-per-prompt``: a JSON object, or its older ``image=4,video=0``."""
    if text.lstrip().startswith("{"):
        return _json_map(text)
    try:
        return {k.strip(): int(v) for k, v in (pair.split("=") for pair in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected '{{\"image\": 4}}' or image=4, got {text!r}") from None


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's two spellings of an adapter: ``name=path``, or ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        value = _json_map(text)
        name, path = value.get("name"), value.get("path")
    else:
        name, _, path = text.partition("=")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise argparse.ArgumentTypeError(f"not an adapter: {text!r} (NAME=PATH, or '{{\"name\": NAME, \"path\": "
                                         f"PATH}}')")
    return name, path


def _engine_flags(p: argparse.ArgumentParser, generate: bool = False) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("model and engine")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="read flags from a YAML file, as vLLM's --config: their long names as keys "
                        "(model: DIR, max-num-seqs: 8, enforce-eager: true, api-key: [k1, k2]); the command "
                        "line wins over the file")
    g.add_argument("--model", default=None,
                   help="a local Hugging Face model folder or a .gguf file "
                        "(default: the bundled SmolLM2-135M-Instruct Q4_1 GGUF)")
    g.add_argument("--tokenizer", default=None,
                   help="a local folder (tokenizer.json or tokenizer_config.json) or .gguf file whose tokenizer and "
                        "chat template serve instead of the model's: a GGUF's original model folder, say, as vLLM "
                        "suggests for GGUF files (default: the model's)")
    g.add_argument("--dtype", type=lambda v: {"half": "float16", "float": "float32"}.get(v, v), choices=DTYPES,
                   default=None,
                   help="weight and activation dtype (vLLM's half and float too); auto = bfloat16 on CUDA and on "
                        f"CPUs with native bf16 (AVX512-BF16, AMX), else float32 (default: {d['dtype']})")
    g.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="the checkpoint's int4 method, checked against its quantization_config (default: read "
                        "from it; AWQ and GPTQ 4-bit load without this flag)")
    g.add_argument("--device", choices=DEVICES, default=None,
                   help=f"where the model runs; auto = cuda when available (default: {d['device']})")
    g.add_argument("--max-model-len", type=parse_length, default=None,
                   help="longest prompt + completion in tokens, as vLLM's also 32k (x1000) or 32K (x1024) "
                        "(default: the model's own, capped at 8192 on CPU)")
    g.add_argument("--seed", type=int, default=None, help=f"engine random seed (default: {d['seed']})")
    g.add_argument("--disable-hybrid-kv-cache-manager", "--swa-full", action="store_true", default=None,
                   help="keep every block of a sequence in a model's sliding-window layers too (Gemma 2 and 3, "
                        "Mistral-7B-v0.1), as in its full-attention layers; by default those layers keep only "
                        "the blocks their window still sees, in a pool of their own, and the rest of the KV "
                        "memory goes to the full layers (llama.cpp's --swa-full says the same)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every step eagerly, without replaying decode steps as CUDA graphs (or on the CPU "
                        "as recorded kernel calls): slower decode; quicker start-up, a little less memory "
                        "(default: graphs)")
    g.add_argument("--prompt-graph-tokens", type=int, default=None, metavar="N",
                   help="CUDA: steps that carry prompt tokens (with decodes beside them or not) of up to N tokens "
                        "replay CUDA graphs captured at start-up for padded token counts, as decode-only steps "
                        "do; longer ones run eagerly; 0: only decode-only steps replay graphs (default: "
                        f"{d['prompt_graph_tokens']}, at most --max-num-batched-tokens)")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="make greedy output independent of batching (CPU only): every linear layer and every "
                        "prompt's attention run through the kernels that compute a row alone, so a request's "
                        "tokens never depend on what else its step holds, a cached prefix or a recomputation; "
                        "prompts are slower (see the README) (default: off, as vLLM's VLLM_BATCH_INVARIANT)")
    g.add_argument("--async-scheduling", choices=ASYNC_SCHEDULING, nargs="?", const="on", default=None,
                   help="schedule and prepare the next step while the current one runs on the device; auto = on "
                        "CUDA, off on the CPU (nothing to overlap there); always off under tensor parallel "
                        f"(default: {d['async_scheduling']})")
    g.add_argument("--speculative-config", type=_json_map, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                        "4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' drafts up to 4 tokens a step from "
                        "where the last 4..2 tokens occurred earlier in the prompt or output, and keeps those the "
                        "model agrees with: the same output, sooner where the text repeats its context (editing "
                        "code, quoting a document)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="what the KV cache holds: auto = the model's dtype; fp8 (= fp8_e4m3: 3 mantissa bits, "
                        "values up to 448) or fp8_e5m2 (2 bits, up to 57344) hold twice bf16's tokens, four times "
                        "fp32's, in the same memory, each K and V value rounded (no scales: as vLLM's fp8 "
                        f"without a checkpoint's) (default: {d['kv_cache_dtype']})")
    if generate:
        return
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name clients use and /v1/models lists; several (vLLM's): requests may name "
                        "any, responses name the first (default: the folder or file name)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most sequences in one step (default: {d['max_num_seqs']})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one step; longer prompts are prefilled in chunks "
                        f"(default: {d['max_num_batched_tokens']})")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV cache block: 8, 16, 32, 64 or 128 (default: {d['block_size']})")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help=f"CUDA: fraction of device memory for weights and KV cache "
                        f"(default: {d['gpu_memory_utilization']})")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_size, default=None,
                   help="memory for the KV cache (of each rank, under tensor parallel), e.g. 2G or 512MiB; on CUDA "
                        "in place of --gpu-memory-utilization's share, as vLLM's --kv-cache-memory-bytes "
                        "(default: 1GiB on the CPU)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV cache blocks of prompts that start alike (a system prompt, earlier "
                        "turns of a chat); --no-enable-prefix-caching turns it off (default: on)")
    g.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="default sampling values for requests that leave them out (temperature, top_p, top_k, "
                        "min_p, repetition_penalty; a chat's max_tokens from max_new_tokens): auto reads the "
                        "model's generation_config.json, as vLLM does; vllm: none (OpenAI's defaults); DIR: that "
                        "folder's generation_config.json (default: auto)")
    g.add_argument("--override-generation-config", type=_json_map, default=None, metavar="JSON",
                   help="sampling defaults on top of --generation-config's, e.g. '{\"temperature\": 0.5}'")
    g.add_argument("--hf-overrides", type=_json_map, default=None, metavar="JSON",
                   help="config.json values to replace before the model is built, as vLLM's flag: "
                        "'{\"sliding_window\": null}', '{\"max_position_embeddings\": 65536, \"rope_scaling\": "
                        "{...}}' (a nested map key by key; a GGUF file's as a config.json names them)")
    g.add_argument("--pooler-config", type=_json_map, default=None, metavar="JSON",
                   help="how /v1/embeddings pools a prompt: '{\"pooling_type\": \"MEAN\", \"normalize\": false}'; "
                        "pooling_type LAST or MEAN (default: the model's sentence-transformers or GGUF setting, "
                        "else LAST, normalized)")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None, metavar="JSON",
                   help="the most images one prompt may hold, for a model that reads them (LLaVA), as vLLM's "
                        "flag: '{\"image\": 4}' (or image=4); 0: images refused (default: 16)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks to split the model over (tensor parallel): one process per rank, one GPU "
                        "each on CUDA, an equal share of the CPU threads each on the CPU (default: 1)")
    a = p.add_argument_group("LoRA adapters")
    a.add_argument("--enable-lora", action="store_true", help="serve the adapters of --lora-modules")
    a.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served beside the model, as vLLM's flag: a request whose "
                        "'model' is NAME runs with that adapter; each is kept on the device, and one step mixes "
                        "them with the model alone (also '{\"name\": NAME, \"path\": PATH}')")
    a.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help=f"the largest rank an adapter may have (default: {d['max_lora_rank']})")
    a.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help=f"with {RUNTIME_LORA_ENV}=true (vLLM's: POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter while serving): the adapters the device holds at once, those of "
                        f"--lora-modules and those loaded (default: --lora-modules' and {SPARE_LORA_SLOTS} more); "
                        "without it every adapter of --lora-modules has a slot and no more are loaded")
    m = p.add_argument_group("tensor parallel across machines (torchrun's names; a private network only: "
                             "the rendezvous and gloo/NCCL traffic are unauthenticated)")
    m.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="hosts the -tp ranks spread over, -tp / N on each (default: 1)")
    m.add_argument("--node-rank", type=int, default=None, metavar="K",
                   help="this host's place, 0..N-1: node 0 runs the engine (`serve` or `engine --listen`), "
                        "node K > 0 only its ranks K*T/N..(K+1)*T/N-1 (`tokenmill engine` without --listen) "
                        "(default: 0)")
    m.add_argument("--master-addr", default=None, metavar="HOST",
                   help="node 0's address, where the ranks meet (torch.distributed's TCPStore); "
                        "required with --nnodes > 1")
    m.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="the rendezvous port on node 0 (default: 29500 across nodes, a free port on one)")
    q = p.add_argument_group("scheduling")
    q.add_argument("--scheduling-policy", choices=POLICIES, default=None,
                   help="the order waiting requests start in: fcfs (arrival), priority (the request's "
                        "'priority', lower first; a more urgent request preempts a less urgent running one), "
                        "short-first (least expected work first) or fair (the seats shared equally between "
                        "clients, then the client served the fewest tokens first: see --fair-client) "
                        f"(default: {d['scheduling_policy']})")
    q.add_argument("--scheduling-aging-seconds", type=float, default=None, metavar="SECONDS",
                   help="no starvation: every this many seconds a request has waited count as one priority "
                        "level (priority) or as halving its work (short-first); inf turns aging off, as in vLLM "
                        f"(default: {d['scheduling_aging_seconds']:g})")
    q.add_argument("--scheduler-delay-factor", type=float, default=None, metavar="F",
                   help="in a step that carries decodes, waiting prompts join only once the oldest has waited F "
                        "times as long as the last step with prompt tokens took: fewer, larger such steps (on "
                        "CUDA those run eagerly, decode-only ones replay graphs) (vLLM's flag; 0: at once) "
                        "(default: 1 on CUDA with graphs, 0 elsewhere)")
    q.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="most prompt tokens of one request in a step that also carries decodes, so that "
                        "running streams do not stall behind a long prompt (default: measured online, so that "
                        "one prompt's chunk makes such a step cost about twice a decode-only one; set it to "
                        "--max-num-batched-tokens for no cap)")
    q.add_argument("--max-num-waiting-requests", "--max-waiting", type=int, default=None, metavar="N",
                   dest="max_num_waiting_requests",
                   help=f"queued requests before new ones get HTTP 429 with Retry-After "
                        f"(default: {d['max_num_waiting_requests']})")
    q.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request without its own 'timeout' ends after this long with finish_reason "
                        "'timeout' (HTTP 408 if it produced nothing) (default: none)")
    if not generate:
        q.add_argument("--log-stats-interval", type=float, default=None, metavar="SECONDS",
                       help="while the engine works, a log line this often with its prompt and generation "
                            "throughput, requests running and waiting, KV cache use, and its steps' median times "
                            f"(decode-only and with prompt tokens, apart) (default: {d['log_stats_interval']:g})")
        q.add_argument("--disable-log-stats", action="store_true", default=None,
                       help="no such lines (vLLM's flag; GET /metrics still has the figures)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tokenmill", description="A small, fast LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,engine,generate}")

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, /health).")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `serve MODEL` names it (or --model)")
    _engine_flags(s)
    h = s.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; :: for IPv6 and IPv4, 0.0.0.0 for IPv4)")
    h.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    h.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY'; repeat for several keys (each value is one key, "
                        "commas and all); a blank key is an error (default: $TOKENMILL_API_KEY, comma-separated; "
                        "none = no auth)")
    h.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins besides the server's own that may call it, comma-separated "
                        "(https://app.example.com), or * for any; without API keys other origins get 403 "
                        "(default: none)")
    h.add_argument("--fair-client", choices=FAIR_CLIENTS, default="address",
                   help="who a client is for --scheduling-policy fair: the caller's address, the API key it gave "
                        "(one client per --api-key), or the body's 'user' (OpenAI's; safety_identifier, Anthropic's "
                        "metadata.user_id), which any caller may name as it likes: only for a gateway in front "
                        "that sets it (default: address)")
    h.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="proxies (addresses or networks, comma-separated; * for any; '' for none) whose "
                        "X-Forwarded-For names the client, for the access log and --fair-client address, as "
                        "uvicorn's flag (default: $FORWARDED_ALLOW_IPS, else 127.0.0.1)")
    h.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches, as vLLM's flag (* for any: a URL can "
                        "make the server call its own network); default: none, images come as data: URLs")
    h.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image URLs are read from under this folder, as vLLM's flag (default: none)")
    h.add_argument("--responses-store", default=None, metavar="FILE",
                   help="the SQLite file where Responses and conversations are kept (the Responses API's store, "
                        "previous_response_id and the Conversations API; shared by the frontends), kept across "
                        "restarts (default: one of the server's own, removed when it stops)")
    h.add_argument("--responses-store-mib", type=int, default=256, metavar="MIB",
                   help="what the kept Responses and conversations may take, in MiB; past it the API key that holds "
                        "the most gives back first, its least recently used first; one thing may take a sixteenth; "
                        "0 keeps none (store is false, previous_response_id and conversation 400s) (default: 256)")
    h.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    h.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    h.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="frontend processes sharing the port (default: 1)")
    h.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up if the model and frontends are not ready by then (default: 300)")
    h.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM or Ctrl-C, how long the requests under way get to finish before each is "
                        "answered a 503 saying so (vLLM's flag; its default, 0, ends them at once) (default: 10)")
    h.add_argument("--engine-liveness-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="an engine that ends no step and answers no ping for this long is taken for hung: "
                        "its requests fail with 503 until it answers again; after a sixth of it (or four times its "
                        "longest step within it, if more), /health says it is stalled and new calls go to other "
                        "engines; a longer step (a huge prefill on a slow CPU) needs more (default: 60, as vLLM's "
                        "engine iteration timeout)")
    h.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections (HTTP and WebSocket) per frontend process; one more closes the one "
                        "that has waited longest for a request (1 s or more), or else gets 503 (default: 1024)")
    h.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request's line and headers must arrive within this, else 408 (default: 30)")
    h.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request body that stalls this long gets 408 (default: 30)")
    h.add_argument("--write-timeout", type=float, default=None, metavar="SECONDS",
                   help="cut a response (an SSE stream, say) whose client reads nothing for this long "
                        "(default: 30)")
    h.add_argument("--max-body-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="largest request body; bigger gets 413 (default: 8MiB: a data: URL image of 6MiB; "
                        "32M takes one of 20MiB, the most an image may have, at the cost of memory a client "
                        "sending slowly may hold)")
    h.add_argument("--max-header-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="largest request line + headers; bigger gets 431 (default: 64KiB)")
    h.add_argument("--socket-send-buffer", type=parse_size, default=None, metavar="SIZE",
                   help="SO_SNDBUF of each client connection: bounds what a client that does not read "
                        "parks in the kernel (default: the kernel's autotuning)")
    t = s.add_argument_group("tool calling and reasoning")
    t.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "mistral", "openai", "none"),
                   default="auto",
                   help="how tool calls are read out of a chat answer when a request's tool_choice is 'auto': "
                        "hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.x), "
                        "mistral ([TOOL_CALLS]...: Mistral, Mixtral), openai (GPT-OSS's harmony messages), or none; "
                        "auto reads it off the chat "
                        "template, and a template that shows no tools "
                        "gets none (default: auto)")
    t.add_argument("--chat-template", default=None,
                   help="the chat template to use instead of the model's: a Jinja file, or the template itself "
                        "(as vLLM's flag; default: the model's)")
    t.add_argument("--reasoning-parser", choices=("auto", "qwen3", "deepseek_r1", "openai_gptoss", "none"),
                   default="auto",
                   help="split a thinking model's <think>...</think> off into reasoning_content (qwen3 and "
                        "deepseek_r1 are one rule: thinking from an opening <think> in the prompt or the answer "
                        "to </think>), or GPT-OSS's analysis channel (openai_gptoss); auto: wherever the chat "
                        "template knows </think>, or writes harmony's <|channel|>; none: all is content "
                        "(default: auto)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is on here wherever a "
                        "tool-call format is known")
    e = s.add_argument_group("embeddings (/v1/embeddings; --pooler-config above)")
    e.add_argument("--runner", choices=("auto", "generate", "pooling"), default=None,
                   help="accepted for vLLM's command lines: every model serves /v1/embeddings beside its "
                        "generations here (a checkpoint without an LM head only embeds)")
    e.add_argument("--task", choices=("auto", "generate", "embed", "embedding"), default=None,
                   help="accepted for older vLLM command lines, as --runner")
    e.add_argument("--convert", choices=("auto", "none", "embed"), default=None,
                   help="accepted for vLLM's command lines, as --runner")
    w = s.add_argument_group("WebSocket (/v1/stream)")
    w.add_argument("--ws-max-buffer", type=parse_size, default=None, metavar="SIZE",
                   help="unsent bytes a connection may hold before a client that does not read is "
                        "closed with 1008 (default: 4MiB)")
    w.add_argument("--ws-max-message", type=parse_size, default=None, metavar="SIZE",
                   help="largest message a client may send; bigger closes with 1009 (default: 1MiB)")
    w.add_argument("--ws-ping-interval", type=float, default=None, metavar="SECONDS",
                   help="keepalive ping period; no pong within as long again closes with 1011 (default: 20)")
    w.add_argument("--ws-idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection with no generation and no message for this long (default: 300)")
    w.add_argument("--ws-max-frames-per-second", type=int, default=None, metavar="N",
                   help="messages (and pings) a connection may send per second, as many again in a burst; "
                        "more closes it with 1008 (default: 1000)")

    dp = s.add_argument_group("data parallel and remote engines")
    dp.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="D",
                    help="independent engines, each a whole model (of -tp ranks) with its own share of the CPU "
                         "threads (or its own GPUs when there are D x T); every frontend sends each request "
                         "to the least-loaded one (default: 1)")
    dp.add_argument("--engine", action="append", default=None, metavar="tcp://HOST:PORT", dest="engines",
                    help="start no engine: serve with the engine started by `tokenmill engine --listen` at "
                         "this address; repeat for several (data parallel across machines)")
    _engine_key_flag(dp)
    o = s.add_argument_group("observability")
    o.add_argument("--metrics-no-auth", action="store_true",
                   help="serve GET /metrics (Prometheus) without an API key, for a scraper on a private "
                        "network; by default it needs a key like every endpoint but /health")
    o.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines of every process as text or as one JSON object per line (default: text)")
    o.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with its usage chunk, as if each request asked for it with "
                        "stream_options.include_usage (vLLM's flag: for metering)")
    o.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:N' instead of its text (vLLM's flag; a request may ask "
                        "with the field of the same name): texts that are no valid UTF-8 alone stay exact")
    o.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per finished request (request id, endpoint, status, tokens, "
                        "time to first token, total time, finish reason); metrics still count them")
    o.add_argument("--log-prompts", action="store_true",
                   help="put the prompt (or chat messages, up to 2000 characters) in the access log; off by "
                        "default: prompts are user data")

    vllm_flags.add(s)

    e = sub.add_parser("engine", help="a headless engine that frontends on other machines use",
                       description="Start an engine alone, listening for `tokenmill serve --engine` frontends. "
                                   "Over tcp:// its traffic is authenticated and encrypted (ZMQ CURVE) with "
                                   "keys derived from --engine-key, which both sides must share. With "
                                   "--nnodes N --node-rank K > 0 (no --listen) it runs only this host's share "
                                   "of node 0's tensor-parallel ranks.")
    _engine_flags(e)
    e.add_argument("--listen", default=None, metavar="tcp://HOST:PORT",
                   help="where frontends reach it, e.g. tcp://0.0.0.0:5555 (or ipc://PATH on this host); "
                        "required, except on a node with --node-rank > 0, which runs only tensor-parallel "
                        "ranks")
    _engine_key_flag(e)
    e.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="after SIGTERM or Ctrl-C, how long the requests under way get to finish, no new one taken "
                        "(its frontends send theirs to other engines); a second signal, or the end of it, fails "
                        "the rest with 503 (vLLM's flag) (default: 0, at once)")
    e.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as one JSON object per line (default: text)")

    g = sub.add_parser("generate", help="generate text for one prompt, offline (no server)",
                       description="Generate text for one prompt with the offline LLM API and print it.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    _engine_flags(g, generate=True)
    return parser


def _engine_key_flag(p) -> None:
    p.add_argument("--engine-key", default=None, metavar="SECRET",
                   help="shared secret of a tcp:// engine and its frontends (at least 16 characters, e.g. "
                        "`openssl rand -hex 32`); the ZMQ CURVE keys that authenticate and encrypt their "
                        "traffic derive from it (default: $TOKENMILL_ENGINE_KEY)")


def engine_key(flag_value: str | None, env: dict[str, str] = os.environ) -> str | None:
    """``--engine-key``, else $TOKENMILL_ENGINE_KEY; a blank one is an error."""
    key = flag_value if flag_value is not None else env.get("TOKENMILL_ENGINE_KEY")
    if key is not None and not key.strip():
        raise ValueError("the engine key is blank: give one (`openssl rand -hex 32`)")
    return key


def chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself; one Jinja cannot read is refused at
    start, with Jinja's reason."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file (nor a template: it has no '{{')")
    from frontends.tokenizer import compile_chat_template

    try:
        compile_chat_template(value)
    except Exception as e:  # noqa: BLE001 - jinja2's syntax errors, whatever their class
        raise ValueError(f"--chat-template: not a template Jinja can read: {e}") from None
    return value


def _config_kwargs(args: argparse.Namespace) -> dict:
    kw = {k: v for k, v in vars(args).items() if k in _DEFAULTS and v is not None}
    if kw.get("served_model_name"):  # the first of its names (the others: ServeOptions.model_aliases)
        kw["served_model_name"] = kw["served_model_name"][0]
    if kw.get("lora_modules"):
        if not getattr(args, "enable_lora", False):
            raise ValueError("--lora-modules needs --enable-lora, as in vLLM")
        names = [name for name, _ in kw["lora_modules"]]
        if len(set(names)) < len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        kw["lora_modules"] = dict(kw["lora_modules"])
    if getattr(args, "disable_log_stats", None):
        kw["log_stats_interval"] = 0.0
    kw.pop("max_loras", None)
    if env_flag(RUNTIME_LORA_ENV):
        if getattr(args, "enable_lora", False):
            kw["max_loras"] = args.max_loras if args.max_loras is not None else \
                len(kw.get("lora_modules") or ()) + SPARE_LORA_SLOTS
        else:
            print(f"tokenmill: {RUNTIME_LORA_ENV} is set, but not --enable-lora: no LoRA adapter is loaded while "
                  "serving", file=sys.stderr)
    return kw


def api_keys(flag_values: list[str] | None, env: dict[str, str] = os.environ) -> list[str]:
    """The keys of ``--api-key`` (repeatable, each value one key, commas and all: a generated key may hold
    one, and split it would open the server to its pieces), else of $TOKENMILL_API_KEY (comma-separated).

    A value with no key in it (``--api-key ""``, a blank variable) is an error, not an open API:
    whoever wrote it meant to lock the server.
    """
    if flag_values:
        keys, source = [v.strip() for v in flag_values], "--api-key"
    elif "TOKENMILL_API_KEY" in env:
        keys, source = [k.strip() for k in env["TOKENMILL_API_KEY"].split(",") if k.strip()], "TOKENMILL_API_KEY"
    else:
        return []
    if not keys or not all(keys):
        raise ValueError(f"{source} is blank: give a key, or leave it out to serve without keys")
    from frontends.auth import Auth

    Auth(keys)  # (keys it could not tell apart: refused here, before anything starts)
    return keys


def parse_length(text: str) -> int:
    """A token count: ``4096``, or as vLLM writes them ``32k`` (x1000) and ``32K`` (x1024), ``1m``, ``1M``."""
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    try:
        return int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (4096, 32k, 32K)") from None


def allowed_origins(text: str | None) -> list[str]:
    """``--allowed-origins``: ``*``, or comma-separated origins (``scheme://host[:port]``, no path), or
    vLLM's JSON list of them."""
    out = []
    items = (text or "").split(",")
    if (text or "").lstrip().startswith("["):
        try:
            items = [str(o) for o in json.loads(text)]
        except ValueError:
            raise ValueError(f"--allowed-origins: {text!r} is not a JSON list of origins") from None
    for item in items:
        origin = item.strip().rstrip("/")
        if not origin:
            continue
        parts = urlsplit(origin)
        if origin != "*" and not (parts.scheme and parts.netloc and not parts.path and not parts.query):
            raise ValueError(f"--allowed-origins: {item.strip()!r} is not an origin "
                             "(like https://app.example.com:8443, or *)")
        out.append(origin)
    return out


def serve_options(args: argparse.Namespace):
    """The launcher's ``ServeOptions`` from ``tokenmill serve`` flags (``ValueError`` for a bad value)."""
    from engine.launcher import ServeOptions

    return ServeOptions(
        host=args.host, port=args.port, api_keys=api_keys(args.api_key),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        api_server_count=args.api_server_count, startup_timeout=args.startup_timeout,
        engine_liveness_timeout=args.engine_liveness_timeout, shutdown_grace=args.shutdown_timeout,
        ws=_ws_overrides(args), http=_http_overrides(args),
        allowed_origins=allowed_origins(args.allowed_origins), metrics_no_auth=args.metrics_no_auth,
        force_include_usage=args.enable_force_include_usage, tokens_as_ids=args.return_tokens_as_token_ids,
        log_format=args.log_format, log_requests=not args.disable_log_requests, log_prompts=args.log_prompts,
        data_parallel_size=args.data_parallel_size, engine_addresses=list(args.engines or []),
        engine_key=engine_key(args.engine_key), tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, chat_template=chat_template(args.chat_template),
        model_aliases=list(args.served_model_name or [])[1:], media_domains=media_domains(args.allowed_media_domains),
        media_path=media_path(args.allowed_local_media_path), fair_client=args.fair_client,
        responses_store=args.responses_store, responses_store_mib=args.responses_store_mib)


def media_domains(hosts: list[str] | None) -> list[str]:
    """``--allowed-media-domains``: host names (or ``*``); a URL, a port or a wildcard would never match one."""
    import ipaddress

    out = []
    for host in hosts or []:
        try:
            host = str(ipaddress.ip_address(host.strip("[]")))  # (an IPv6 address as URLs' hosts read)
        except ValueError:
            if host != "*" and (not host or any(c in host for c in ":/*@ ") or host.endswith(".")):
                raise ValueError(f"--allowed-media-domains {host!r}: give host names alone (cdn.example.com, "
                                 f"127.0.0.1; any port of theirs is allowed), or * for any") from None
        out.append(host.lower())
    return out


def media_path(path: str | None) -> str | None:
    """``--allowed-local-media-path``: an existing folder, absolute."""
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"--allowed-local-media-path {path!r}: no such folder")
    return os.path.abspath(path) if path is not None else None


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine.launcher import serve

    try:
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                raise ValueError(f"two models: {args.model_tag} and --model {args.model}")
            args.model = args.model_tag
        # flags that do not combine, before either's own checks (which would name only a part of the fault)
        if (args.node_rank or 0) > 0:
            raise ValueError(f"--node-rank {args.node_rank} runs only tensor-parallel ranks: start it with "
                             f"`tokenmill engine` (no --listen); `tokenmill serve` is node 0")
        if args.engines and (args.tensor_parallel_size or 1) > 1:
            raise ValueError("--tensor-parallel-size is the remote engine's (`tokenmill engine --listen ... -tp N`): "
                             "with --engine no engine starts here")
        if (args.nnodes or 1) > 1 and (args.data_parallel_size > 1 or args.engines):
            raise ValueError("--nnodes spreads one local engine's ranks over hosts; it does not combine with "
                             "--data-parallel-size or --engine")
        config = EngineConfig(**_config_kwargs(args))
        options = serve_options(args)
        clash = sorted(set(config.lora_modules or ()) & {config.served_model_name, *options.model_aliases})
        if clash:
            raise ValueError(f"--lora-modules: {', '.join(clash)} is also a name of the model (--served-model-name): "
                             "a request could not say which it means")
    except ValueError as e:
        parser.error(str(e))  # exit 2
    return serve(config, options)


def _ws_overrides(args: argparse.Namespace) -> dict:
    given = {"max_buffered_bytes": args.ws_max_buffer, "max_message_bytes": args.ws_max_message,
             "ping_interval": args.ws_ping_interval, "ping_timeout": args.ws_ping_interval,
             "idle_timeout": args.ws_idle_timeout, "max_frames_per_second": args.ws_max_frames_per_second}
    return {k: v for k, v in given.items() if v is not None}


def _http_overrides(args: argparse.Namespace) -> dict:
    given = {"max_connections": args.max_connections, "header_timeout": args.header_timeout,
             "body_timeout": args.body_timeout, "write_timeout": args.write_timeout,
             "max_header_bytes": args.max_header_bytes, "max_body_bytes": args.max_body_bytes,
             "socket_send_buffer": args.socket_send_buffer}
    trusted = args.forwarded_allow_ips if args.forwarded_allow_ips is not None else os.environ.get("FORWARDED_ALLOW_IPS")
    if trusted is not None:
        given["forwarded_allow_ips"] = tuple(ip.strip() for ip in trusted.split(",") if ip.strip())
    return {k: v for k, v in given.items() if v is not None}


def _engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import logging

    from engine.launcher import _setup_logging, check_address, check_shutdown_timeout
    from engine.model_path import model_name, resolve_model_path
    from engine.protocol import curve_keys

    key = None
    try:
        config = EngineConfig(**_config_kwargs(args))
        if config.node_rank > 0:
            if args.listen is not None:
                raise ValueError(f"--listen is for node 0 (the engine); --node-rank {config.node_rank} runs only "
                                 f"tensor-parallel ranks")
        elif args.listen is None:
            raise ValueError("--listen is required (or --node-rank K > 0, for a node that runs only "
                             "tensor-parallel ranks)")
        else:
            key = engine_key(args.engine_key)
            if key is not None:
                curve_keys(key)  # too short, or no CURVE in this libzmq: say so before the model loads
            elif args.listen.startswith("tcp://"):
                raise ValueError(f"--listen {args.listen} needs --engine-key (or $TOKENMILL_ENGINE_KEY): an open "
                                 "engine port would take work from anyone")
            check_address("--listen", args.listen, listen=True)
        check_shutdown_timeout(args.shutdown_timeout)
    except ValueError as e:
        parser.error(str(e))
    if config.node_rank > 0:
        return _node(config, args.log_format)
    _setup_logging(args.log_format)
    log = logging.getLogger("tokenmill.engine")
    try:
        path = resolve_model_path(config.model)
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    config = dataclasses.replace(config, model=path, served_model_name=config.served_model_name or model_name(path))
    from engine.server import run_engine

    def ready() -> None:
        t = config.tensor_parallel_size
        print(f"tokenmill engine serving {config.served_model_name} on {args.listen} "
              f"({t} rank{'s' if t != 1 else ''}{', CURVE' if key else ''})", flush=True)

    try:
        run_engine(config, args.listen, ready=ready, engine_key=key, shutdown_grace=args.shutdown_timeout)
    except ValueError as e:
        log.error("%s", e)
        return 1
    return 0


def _node(config: EngineConfig, log_format: str) -> int:
    """``tokenmill engine --node-rank K`` (K > 0): this host's tensor-parallel ranks of node 0's engine."""
    import logging

    from engine.launcher import _setup_logging
    from engine.model_path import resolve_model_path

    _setup_logging(log_format)
    try:
        path = resolve_model_path(config.model)
    except FileNotFoundError as e:
        logging.getLogger("tokenmill.engine").error("%s", e)
        return 2
    from engine.tp_worker import run_node, span

    t, n, k = config.tensor_parallel_size, config.nnodes, config.node_rank
    local = t // n
    return run_node(config, path, ready=lambda: print(
        f"tokenmill engine node {k} of {n}: started {span('rank', k * local, (k + 1) * local - 1)} of {t}, "
        f"joining {config.master_addr}", flush=True))


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import logging

    from engine.launcher import LOG_FORMAT
    from engine.protocol import SamplingParams

    # quiet by default: stdout is the text; TOKENMILL_LOG_LEVEL=INFO shows what start-up found
    logging.basicConfig(level=os.environ.get("TOKENMILL_LOG_LEVEL", "WARNING"), format=LOG_FORMAT, stream=sys.stderr)

    try:
        kwargs = _config_kwargs(args)
        EngineConfig(**kwargs)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        args.prompt.encode()
    except UnicodeEncodeError:
        parser.error("--prompt is not valid UTF-8")
    except ValueError as e:
        parser.error(str(e))
    from engine import LLM
    from engine.engine import RequestError

    llm = LLM(**kwargs)
    try:  # (what the engine refuses, an empty prompt or one past the context, said as a server says it)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
    except RequestError as e:
        parser.error(e.message)
    print(out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # for errors that name the subcommand
    if extra:  # (the top-level parser's error would print its own usage, not the subcommand's)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "serve":
            return _serve(args, sub)
        if args.command == "engine":
            return _engine(args, sub)
        return _generate(args, sub)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
