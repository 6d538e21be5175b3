"""The ``tokenmill`` console script: flags, validation, start-up failures, ``generate``.

Failures must be quick and say what to fix: a bad flag or a missing model exits 2
before any process starts; a busy port or a start-up timeout exits 1, and the
runtime dir never outlives the launcher.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from engine.cli import allowed_origins, api_keys, build_parser, parse_size, serve_options
from engine.config import EngineConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_server_e2e import CMD, ROOT  # noqa: E402

SERVE_FLAGS = ["--model", "--tokenizer", "--generation-config", "--override-generation-config", "--hf-overrides",
               "--chat-template", "--served-model-name", "--host", "--port", "--api-key", "--ssl-keyfile",
               "--ssl-certfile", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
               "--gpu-memory-utilization", "--kv-cache-memory", "--dtype", "--device", "--block-size", "--seed",
               "--api-server-count", "--tensor-parallel-size", "--ws-max-buffer", "--ws-max-message",
               "--ws-ping-interval", "--ws-idle-timeout", "--max-connections", "--header-timeout",
               "--body-timeout", "--write-timeout", "--max-header-bytes", "--allowed-origins",
               "--socket-send-buffer", "--ws-max-frames-per-second", "--engine-liveness-timeout",
               "--scheduling-policy", "--scheduling-aging-seconds", "--long-prefill-token-threshold",
               "--max-num-waiting-requests", "--request-timeout", "--enable-prefix-caching",
               "--metrics-no-auth", "--log-format", "--disable-log-requests", "--log-prompts",
               "--enable-force-include-usage", "--return-tokens-as-token-ids"]


def tokenmill(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, TOKENMILL_LOG_LEVEL="INFO"))


def test_serve_help_documents_every_flag():
    r = tokenmill("serve", "--help", timeout=30)
    assert r.returncode == 0
    for flag in SERVE_FLAGS:
        m = re.search(rf"^\s+{re.escape(flag)}\b.*?(?=^\s+--|\Z)", r.stdout, re.M | re.S)
        assert m, f"{flag} missing from --help"
        assert len(m.group(0).split()) > 2, f"{flag} has no help text"
    gen = tokenmill("generate", "--help", timeout=30)
    for flag in ("--prompt", "--max-tokens", "--temperature", "--model", "--chat"):
        assert flag in gen.stdout


def test_flags_map_to_engine_config():
    from engine.cli import _config_kwargs

    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--kv-cache-memory", "256M", "--dtype",
                                      "float32", "-tp", "1", "--api-key", "a", "--api-key", "b,c"])
    assert _config_kwargs(args) == {"max_num_seqs": 8, "kv_cache_memory": 256 << 20, "dtype": "float32",
                                    "tensor_parallel_size": 1}
    assert api_keys(args.api_key) == ["a", "b,c"]  # (a key may hold a comma: never split into "b" and "c")
    assert api_keys(None, {"TOKENMILL_API_KEY": "a, b,,c"}) == ["a", "b", "c"]
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority", "--max-waiting", "5",
                                      "--long-prefill-token-threshold", "64", "--request-timeout", "2.5",
                                      "--scheduling-aging-seconds", "4"])
    assert _config_kwargs(args) == {"scheduling_policy": "priority", "max_num_waiting_requests": 5,
                                    "long_prefill_token_threshold": 64, "request_timeout": 2.5,
                                    "scheduling_aging_seconds": 4.0}
    args = build_parser().parse_args(["serve", "--max-num-waiting-requests", "7", "--quantization", "gptq"])
    assert _config_kwargs(args) == {"max_num_waiting_requests": 7, "quantization": "gptq"}
    # vLLM's embedding command lines: the runner flags change nothing, the pooler config reaches the engine
    args = build_parser().parse_args(["serve", "--runner", "pooling", "--task", "embed", "--convert", "embed",
                                      "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'])
    assert _config_kwargs(args) == {"pooler_config": {"pooling_type": "MEAN", "normalize": False}}
    # vLLM's LoRA flags: NAME=PATH or its JSON, repeatable; --max-loras and --lora-dtype set nothing
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                      '{"name": "b", "path": "/y", "base_model_name": "m"}', "--lora-modules",
                                      "c=/z", "--max-lora-rank", "64", "--max-loras", "2", "--lora-dtype", "auto"])
    assert _config_kwargs(args) == {"lora_modules": {"a": "/x", "b": "/y", "c": "/z"}, "max_lora_rank": 64}
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert _config_kwargs(args) == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 4}}


def test_runtime_lora_updating_gives_the_engine_slots(monkeypatch, capsys):
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING with --enable-lora: --max-loras slots, by default one per adapter
    of --lora-modules and 4 more; without --enable-lora it says so and changes nothing (a vLLM command line that
    sets the variable everywhere still starts)."""
    from engine.cli import _config_kwargs

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x"])
    assert _config_kwargs(args) == {"lora_modules": {"a": "/x"}, "max_loras": 5}
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "2"])
    assert _config_kwargs(args) == {"max_loras": 2}
    assert _config_kwargs(build_parser().parse_args(["serve", "--max-loras", "2"])) == {}
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, but not --enable-lora" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "false")
    assert _config_kwargs(build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "2"])) == {}
    with pytest.raises(ValueError, match="max_loras must be in"):
        EngineConfig(lora_modules={"a": "/x", "b": "/y"}, max_loras=1)


def test_a_config_file_gives_flags_and_the_command_line_wins(tmp_path, capsys):
    """vLLM's --config: a YAML map of long flag names (either spelling) to values, each parsed as the
    command line parses it; the command line over the file over the defaults."""
    from engine.cli import _config_kwargs

    path = tmp_path / "config.yaml"
    path.write_text("model: /models/gemma\nmax_num_seqs: 8\nkv-cache-memory: 512M\nenforce-eager: true\n"
                    "enable-prefix-caching: false\napi-key: [k1, k2]\nhf-overrides: {sliding_window: null}\n"
                    "served-model-name: [a, b]\nasync-scheduling: 'off'\nport: 9001\nmax-model-len: 32k\n"
                    "enable-lora: true\nlora-modules: [a=/x, b=/y]\nbatch-invariant: true\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--port", "9000", "--max-num-seqs", "4"])
    assert (args.model_tag, args.port, args.api_key, args.served_model_name) == ("/models/gemma", 9000,
                                                                                 ["k1", "k2"], ["a", "b"])
    assert _config_kwargs(args) == {"max_num_seqs": 4, "kv_cache_memory": 512 << 20, "enforce_eager": True,
                                    "enable_prefix_caching": False, "hf_overrides": {"sliding_window": None},
                                    "served_model_name": "a", "async_scheduling": "off", "max_model_len": 32000,
                                    "lora_modules": {"a": "/x", "b": "/y"}, "batch_invariant": True}
    # a model on the command line, either way, wins over the file's
    assert build_parser().parse_args(["serve", "other", f"--config={path}"]).model_tag == "other"
    args = build_parser().parse_args(["serve", "--config", str(path), "--model", "/m2"])
    assert (args.model_tag, args.model) == (None, "/m2")
    # a repeatable flag on the command line replaces the file's values; an abbreviated --config is read;
    # vLLM's boolean async-scheduling; a required flag from the file; the parser is left as it was
    parser = build_parser()
    args = parser.parse_args(["serve", "--conf", str(path), "--api-key", "k3"])
    assert args.api_key == ["k3"] and args.max_num_seqs == 8
    assert parser.parse_args(["serve"]).max_num_seqs is None
    path.write_text("async-scheduling: true\nprompt: hi\nmax-tokens: 3\n")
    gen = build_parser().parse_args(["generate", "--config", str(path)])
    assert (gen.prompt, gen.async_scheduling) == ("hi", "on")
    path.write_text("log-stats-interval: 5\ndisable-log-stats: false\n")  # (a false switch leaves the interval)
    assert _config_kwargs(build_parser().parse_args(["serve", "--config", str(path)])) == {"log_stats_interval": 5.0}
    path.write_text("async-scheduling: false\n")
    assert build_parser().parse_args(["serve", "--config", str(path)]).async_scheduling == "off"
    path.write_text("disable-log-requests: true\ndisable-uvicorn-access-log: true\n")  # (two flags, one dest: review)
    assert build_parser().parse_args(["serve", "--config", str(path)]).disable_log_requests is True
    path.write_text("allowed-origins: [https://a.example, https://b.example]\n")  # (vLLM's JSON list, as YAML)
    assert allowed_origins(build_parser().parse_args(["serve", "--config", str(path)]).allowed_origins) == [
        "https://a.example", "https://b.example"]
    for text, why in [("max-num-seqz: 8\n", "'max-num-seqz' is no flag"),
                      ("dtype: float8\n", "invalid choice: 'float8'"),
                      ("port: [1, 2]\n", "port: one value, not a list"),
                      ("enforce-eager: 1\n", "enforce-eager: 1 is not true or false"),
                      ("- a list\n", "not a map"), ("port: [\n", "while parsing"),
                      ("api-key:\n", "api-key: no value"), ("api-key: ~\n", "api-key: no value"),
                      ("api-key: [~]\n", "api-key: a list item with no value"),
                      ("api-key: [k1, null]\n", "api-key: a list item with no value"),
                      ("port: 80\xff\n", "can't decode"),
                      ("api-key: k1\napi-key: k2\n", "'api-key' is given twice"),  # (the last kept, silently)
                      ("api_key: k1\napi-key: k2\n", "api-key and api_key are one flag, given twice"),
                      ("hf-overrides: {a: 1, a: 2}\n", "'a' is given twice")]:
        path.write_bytes(text.encode("latin-1"))
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--config", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"--config {path}" in err and why in err, err


def test_websocket_flags_reach_the_frontends():
    from engine.cli import _ws_overrides
    from frontends.websocket import WsConfig

    args = build_parser().parse_args(["serve", "--ws-max-buffer", "1M", "--ws-idle-timeout", "60"])
    ws = WsConfig(**_ws_overrides(args))
    assert (ws.max_buffered_bytes, ws.idle_timeout) == (1 << 20, 60.0)
    assert ws.ping_interval == WsConfig().ping_interval  # flags not given keep the defaults


def test_observability_flags_reach_the_frontends(tmp_path):
    from engine.cli import serve_options
    from engine.launcher import Launcher

    def frontend_args(*argv):
        launcher = Launcher(EngineConfig(), serve_options(build_parser().parse_args(["serve", *argv])))
        launcher.runtime_dir = str(tmp_path)
        return launcher._frontend_args(0)

    fa = frontend_args()
    assert (fa.metrics_no_auth, fa.log_format, fa.log_requests, fa.log_prompts) == (False, "text", True, False)
    fa = frontend_args("--metrics-no-auth", "--log-format", "json", "--disable-log-requests", "--log-prompts")
    assert (fa.metrics_no_auth, fa.log_format, fa.log_requests, fa.log_prompts) == (True, "json", False, True)
    assert fa.shutdown_grace == 10.0 and frontend_args("--shutdown-timeout", "0").shutdown_grace == 0.0  # (vLLM's)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])


def test_api_keys_from_environment():
    assert api_keys(None, {"TOKENMILL_API_KEY": "k1, k2,"}) == ["k1", "k2"]
    assert api_keys(None, {}) == []
    assert api_keys(["flag"], {"TOKENMILL_API_KEY": "env"}) == ["flag"]


@pytest.mark.parametrize("text,n", [("1024", 1024), ("4k", 4096), ("512M", 512 << 20), ("2GiB", 2 << 30),
                                    ("1.5G", 3 << 29), ("1gb", 1 << 30)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_bad_size_is_a_usage_error():
    r = tokenmill("serve", "--kv-cache-memory", "lots", timeout=30)
    assert r.returncode == 2 and "not a size" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--block-size", "7"], "block_size must be one of"),
    (["--max-num-seqs", "0"], "max_num_seqs must be positive"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be positive"),
    (["--scheduling-policy", "lifo"], "invalid choice: 'lifo' (choose from 'fcfs', 'priority', 'short-first', 'fair')"),
    (["--request-timeout", "0"], "request_timeout must be a positive number of seconds"),
    (["--request-timeout", "-1"], "request_timeout must be a positive number of seconds"),
    (["--long-prefill-token-threshold", "0"], "long_prefill_token_threshold must be positive"),
    (["--scheduling-aging-seconds", "0"], "scheduling_aging_seconds must be positive (or inf)"),
    (["--max-num-waiting-requests", "0"], "max_num_waiting_requests must be positive"),
    (["--api-server-count", "0"], "api_server_count must be at least 1"),
    (["--ssl-keyfile", "/nonexistent.key"], "go together"),
    (["--pooler-config", "{mean}"], "not JSON"),
    (["--pooler-config", '{"pooling_type": "MAX"}'], "pooler_config pooling_type must be one of last, mean, cls"),
    (["--pooler-config", '{"normalise": true}'], "pooler_config must be a map of pooling_type and normalize"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice: ['a']"),
    (["--enable-lora", "--lora-modules", "a"], "not an adapter: 'a'"),
    (["--max-lora-rank", "0"], "max_lora_rank must be in [1, 512]"),
    (["--speculative-config", "ngram"], "not JSON"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method must be one of ngram"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens is required"),
    (["--served-model-name", "m", "a", "--enable-lora", "--lora-modules", "a=/x"], "a is also a name of the model"),
    (["--engine", "tcp://127.0.0.1:5555", "--engine-key", "k" * 16, "-tp", "2"], "is the remote engine's"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be 0 or more seconds, got -1"),
])
def test_invalid_config_exits_2_before_starting_anything(args, message):
    r = tokenmill("serve", *args, timeout=30)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert r.stdout == ""


def test_missing_model_exits_2():
    r = tokenmill("serve", "--model", "/nonexistent/model", timeout=30)
    assert r.returncode == 2
    assert "not found" in r.stderr


def test_a_vllm_command_line_starts_unchanged():
    """vLLM's flags that hold here already or cannot apply are taken and set nothing (each says which in
    --help); a value tokenmill cannot honour is refused, naming the flag."""
    from engine.cli import _config_kwargs

    vllm = ["--trust-remote-code", "--enable-chunked-prefill", "--max-logprobs", "20",
            "-pp", "1", "--swap-space", "4", "--download-dir", "/tmp/x", "--revision",
            "main", "--load-format", "safetensors", "--tokenizer-mode", "auto", "--distributed-executor-backend",
            "mp", "--uvicorn-log-level", "info", "--max-seq-len-to-capture", "8192", "--enable-log-requests",
            "--structured-outputs-config", '{"backend": "xgrammar"}', "--guided-decoding-backend", "outlines"]
    args = build_parser().parse_args(["serve", "--model", "m", *vllm, "--max-model-len", "4096",
                                      "--disable-uvicorn-access-log"])
    assert _config_kwargs(args) == {"model": "m", "max_model_len": 4096}
    assert args.disable_log_requests  # (as --disable-log-requests)
    # vLLM's spellings of flags tokenmill has: the model as an argument, dtype and length aliases, -asc...
    args = build_parser().parse_args(["serve", "Qwen3-8B", "--dtype", "half", "--max-model-len", "32k", "-asc", "2",
                                      "--async-scheduling", "--no-trust-remote-code", "-O3",
                                      "--allowed-origins", '["https://a.example"]'])
    assert (args.model_tag, args.api_server_count) == ("Qwen3-8B", 2)
    assert _config_kwargs(args) == {"dtype": "float16", "max_model_len": 32000, "async_scheduling": "on"}
    # vLLM's --disable-log-stats: no stats lines (engine.stats_log)
    assert _config_kwargs(build_parser().parse_args(["serve", "--disable-log-stats"])) == {"log_stats_interval": 0.0}
    assert _config_kwargs(build_parser().parse_args(["engine", "--log-stats-interval", "5"])) == {
        "log_stats_interval": 5.0}
    assert allowed_origins(args.allowed_origins) == ["https://a.example"]
    args = build_parser().parse_args(["serve", "--served-model-name", "qwen", "qwen3-8b", "gpt-4o"])
    assert _config_kwargs(args) == {"served_model_name": "qwen"}
    assert serve_options(args).model_aliases == ["qwen3-8b", "gpt-4o"]
    # images: vLLM's --limit-mm-per-prompt (JSON or key=value), media hosts and folder
    args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", "image=2,video=0", "--allowed-media-domains",
                                      "CDN.example.com", "[::1]", "--allowed-local-media-path", "/tmp"])
    assert _config_kwargs(args) == {"limit_mm_per_prompt": {"image": 2, "video": 0}}
    options = serve_options(args)
    assert (options.media_domains, options.media_path) == (["cdn.example.com", "::1"], "/tmp")
    for bad in ("https://cdn.example.com", "cdn.example.com:8080", "*.example.com"):
        with pytest.raises(ValueError, match="host names alone"):
            serve_options(build_parser().parse_args(["serve", "--allowed-media-domains", bad]))
    assert build_parser().parse_args(["serve", "--max-model-len", "32K"]).max_model_len == 32768
    help_text = tokenmill("serve", "--help", timeout=30).stdout
    for flag in [f for f in vllm if f.startswith("--")]:
        assert re.search(rf"^\s+{re.escape(flag)}\b.*?\S.*?(?=^\s+-|\Z)", help_text, re.M | re.S), flag
    for bad in (["--kv-cache-dtype", "fp4"], ["-pp", "2"], ["--distributed-executor-backend", "ray"]):
        r = tokenmill("serve", *bad, timeout=30)
        assert r.returncode == 2 and re.search(rf"invalid choice: '?{bad[1]}'?", r.stderr), r.stderr
    for bad, message in ((["--max-logprobs", "30"], "30: a token's top logprobs are at most 20 here"),
                         (["--max-model-len", "4x"], "not a token count: '4x'"),
                         (["m1", "--model", "m2"], "two models: m1 and --model m2")):
        r = tokenmill("serve", *bad, timeout=30)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_generation_config_flags(tmp_path, tiny_llama):
    """--generation-config / --override-generation-config reach the config; a folder without the file, or a
    value that is no sampling number, stops the server at start (exit 2)."""
    from engine import LLM, SamplingParams
    from engine.cli import _config_kwargs

    args = build_parser().parse_args(["serve", "--generation-config", "vllm", "--override-generation-config",
                                      '{"temperature": 0.5}'])
    assert _config_kwargs(args) == {"generation_config": "vllm", "override_generation_config": {"temperature": 0.5}}
    args = build_parser().parse_args(["serve", "--hf-overrides", '{"sliding_window": null}'])
    assert _config_kwargs(args) == {"hf_overrides": {"sliding_window": None}}
    r = tokenmill("serve", "--model", tiny_llama, "--generation-config", str(tmp_path), timeout=30)
    assert r.returncode == 2 and "no generation_config.json there" in r.stderr
    r = tokenmill("serve", "--model", tiny_llama, "--override-generation-config", '{"top_p": 0}', timeout=30)
    assert r.returncode == 2 and "top_p must be in (0, 1], got 0" in r.stderr
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8}')
    llm = LLM(tiny_llama, generation_config=str(tmp_path), override_generation_config={"top_k": 4},
              trust_remote_code=True)  # (vLLM's keyword: taken, nothing to trust)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 4, 16)
    # a max_new_tokens past the context: each prompt gets the room it leaves (as the server caps it)
    llm = LLM(tiny_llama, max_model_len=64, override_generation_config={"max_new_tokens": 1000, "temperature": 0})
    outs = llm.generate([[5] * 10, [7] * 60])  # (refused before: 1000 tokens asked of a 64-token context)
    assert all(0 < len(o.token_ids) <= 64 - len(o.prompt_token_ids) for o in outs)
    tokenizer = llm.get_tokenizer()  # vLLM's get_tokenizer and set_tokenizer
    assert tokenizer is llm.tokenizer and tokenizer.decode(tokenizer.encode("Paris")) == "Paris"

    class Shouting:  # the model's tokenizer, its texts upper-cased
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def decode(self, ids, **kw):
            return tokenizer.decode(ids, **kw).upper()

    assert llm._codec.tokenizer is tokenizer
    llm.set_tokenizer(Shouting())
    assert isinstance(llm.get_tokenizer(), Shouting) and isinstance(llm._codec.tokenizer, Shouting)  # (chats, stops)
    out = llm.generate("Paris is", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True).upper() != ""
    with pytest.raises(ValueError, match="top_p must be in"):  # at construction, not at the first generate
        LLM(tiny_llama, override_generation_config={"top_p": 0})


def test_missing_tokenizer_exits_2(tiny_llama, tmp_path):
    r = tokenmill("serve", "--model", tiny_llama, "--tokenizer", "/nonexistent/tok", timeout=30)
    assert r.returncode == 2
    assert "tokenizer '/nonexistent/tok' not found" in r.stderr
    from tests.conftest import make_tiny_model

    bare = make_tiny_model(str(tmp_path / "bare"), "llama", None)  # before any weight is loaded
    r = tokenmill("serve", "--model", bare, timeout=30)
    assert r.returncode == 2 and "holds no tokenizer (tokenizer.json or tokenizer_config.json): give one with " \
        "--tokenizer" in r.stderr


def test_a_model_without_a_tokenizer_serves_with_another_ones(tmp_path, smollm_tokenizer_dir):
    """--tokenizer (vLLM's): a folder's (or a GGUF's) tokenizer and chat template for a model that has none,
    in the frontends (chat) and in the engine (structured output reads its vocabulary) alike."""
    from engine import LLM, SamplingParams
    from tests.conftest import make_tiny_model
    from tests.test_server_e2e import Server, openai_client

    bare = make_tiny_model(str(tmp_path / "bare"), "llama", None, seed=3)
    llm = LLM(bare, tokenizer=smollm_tokenizer_dir)
    want = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert want.text == llm.tokenizer.decode(want.token_ids) and len(llm.tokenizer) == 49152
    server = Server("--model", bare, "--tokenizer", smollm_tokenizer_dir, "--served-model-name", "bare")
    try:
        r = openai_client(server).chat.completions.create(
            model="bare", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=8, temperature=0,
            extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no")
    finally:
        server.close()


def test_busy_port_is_refused_clearly(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = tokenmill("serve", "--model", tiny_llama, "--port", str(port), timeout=30)
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "started tokenmill-engine" not in r.stderr


def test_a_max_model_len_beyond_the_model_fails_at_start_naming_both(tiny_llama):
    r = tokenmill("serve", "--model", tiny_llama, "--max-model-len", "5000", "--port", "0", timeout=120)
    assert r.returncode == 1
    assert "max_model_len 5000 exceeds the model's max_position_embeddings (1024)" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_quantization_the_checkpoint_lacks_fails_at_start(tiny_llama):
    r = tokenmill("serve", "--model", tiny_llama, "-q", "awq", "--port", "0", timeout=120)
    assert r.returncode == 1
    assert f"--quantization awq, but {tiny_llama} is not quantized" in r.stderr
    assert "Traceback" not in r.stderr


def test_startup_logs_the_kv_cache_size(tiny_llama):
    r = tokenmill("generate", "--model", tiny_llama, "--dtype", "float32", "--prompt", "Hi", "--max-tokens", "1",
                  "--max-model-len", "512", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # the tiny model: 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes per token; no more
    # blocks than 64 sequences of 512 tokens can use
    assert re.search(r"KV cache: 2048 blocks of 16 tokens \(32768 tokens, 16.0 MiB, 512 bytes per token\), "
                     r"prefix caching on; max_model_len 512: at most 64.0 requests of that length", r.stderr), r.stderr


def test_startup_timeout_is_clear_and_cleans_up(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = tokenmill("serve", "--model", tiny_llama, "--port", str(port), "--startup-timeout", "0.5", timeout=120)
    assert r.returncode == 1
    assert "start-up timed out after 0.5s" in r.stderr
    runtime = re.search(r"runtime dir (\S+)", r.stderr).group(1)
    assert not os.path.exists(runtime)
    for pid in re.findall(r"\(pid (\d+)\)", r.stderr):
        assert not os.path.exists(f"/proc/{pid}/status") or "State:\tZ" in open(f"/proc/{pid}/status").read()


def test_generate_prints_the_offline_greedy_text(tiny_llama):
    from engine import LLM, SamplingParams

    want = LLM(tiny_llama).generate(["Hello, my name is"], SamplingParams(max_tokens=8, temperature=0))[0].text
    r = tokenmill("generate", "--model", tiny_llama, "--prompt", "Hello, my name is", "--max-tokens", "8",
                  timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == want + "\n"


def test_generate_chat_applies_the_template(tiny_llama):
    from engine import LLM, SamplingParams

    llm = LLM(tiny_llama)
    want = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=6, temperature=0))[0].text
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert want == llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].text
    r = tokenmill("generate", "--model", tiny_llama, "--prompt", "Hi", "--chat", "--max-tokens", "6",
                  timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == want + "\n"


def test_generate_says_what_the_engine_refuses_in_one_line(tiny_llama, capsys):
    from engine.cli import main

    for prompt, why in (("", "the prompt is empty"), ("\udcff bad", "--prompt is not valid UTF-8")):
        with pytest.raises(SystemExit) as e:  # (it was a traceback)
            main(["generate", "--model", tiny_llama, "--prompt", prompt])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err


def test_port_0_is_one_port_for_every_frontend(tiny_llama, monkeypatch):
    """--port 0: the launcher picks one free port for all the frontends (each picked its own, and the banner said
    port 0), and names it."""
    import test_server_e2e as e2e

    monkeypatch.setattr(e2e, "free_port", lambda: 0)
    s = e2e.Server("--model", tiny_llama, api_server_count=2)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+) \(2 frontends\)", s.banner).group(1))
        assert port != 0
        assert all(e2e.http_status(f"http://127.0.0.1:{port}/health") == 200 for _ in range(6))
        for name in ("tokenmill-frontend-0", "tokenmill-frontend-1"):
            assert listening_ports(s.pids(name)[-1]) == {port}, name
    finally:
        s.close()


def test_port_0_is_held_for_the_frontends_until_they_listen():
    """The port --port 0 picks is held while the model loads (review: it was free again until the frontends bound
    it, and another process could take it): no other socket binds it, the frontends' (SO_REUSEPORT) do, and
    every connection goes to them; an explicit port is only checked."""
    from engine.launcher import reserve_port

    port, hold = reserve_port("127.0.0.1", 0)
    try:
        for reuse_addr in (0, 1):  # (one with SO_REUSEADDR, as asyncio's, nginx's: it got in beside a hold that had it)
            with socket.socket() as other, pytest.raises(OSError):
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse_addr)
                other.bind(("127.0.0.1", port))
        with socket.socket() as frontend:
            frontend.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as asyncio's)
            frontend.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            frontend.bind(("127.0.0.1", port))
            frontend.listen()
            frontend.settimeout(5)
            for _ in range(8):
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    frontend.accept()[0].close()
    finally:
        hold.close()
    assert reserve_port("127.0.0.1", port) == (port, None)  # (free again, and an explicit port holds nothing)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes in /proc/net/tcp and tcp6)."""
    fds = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fds):
        try:
            link = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # (0A: LISTEN)
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6(), reason="no IPv6 here")
def test_host_colons_serves_ipv6_and_ipv4(tiny_llama):
    """--host :: listens on both families, as uvicorn's (so vLLM's) server does; asyncio's own socket was IPv6 alone,
    and IPv4 clients were refused."""
    import test_server_e2e as e2e

    s = e2e.Server("--model", tiny_llama, "--host", "::", api_server_count=2)
    try:
        assert s.banner.startswith("tokenmill serving") and f"http://[::]:{s.port} (2 frontends)" in s.banner
        for url in (f"http://127.0.0.1:{s.port}", f"http://[::1]:{s.port}"):
            assert all(e2e.http_status(url + "/health") == 200 for _ in range(4)), url
    finally:
        s.close()
