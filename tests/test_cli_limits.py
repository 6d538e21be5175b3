"""``tokenmill serve``'s HTTP limit, origin and key flags: parsed, checked, and carried to each frontend.

No server runs: ``engine.launcher.serve`` is replaced by a recorder, and the
frontend's settings are read from ``Launcher._frontend_args``, as the launcher
would hand them to a frontend process.
"""

from __future__ import annotations

import pytest

import engine.launcher
from engine.cli import api_keys, build_parser, main
from engine.config import EngineConfig
from frontends.http import HttpConfig


@pytest.fixture
def served(monkeypatch):
    """``main(["serve", ...])`` without serving: the ServeOptions it would have served with."""
    got = []
    monkeypatch.setattr(engine.launcher, "serve", lambda config, options: got.append(options) or 0)
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)

    def run(*flags: str):
        assert main(["serve", *flags]) == 0
        return got[-1]

    return run


def usage_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command,flags,unknown", [("engine", ["-dp", "2"], "-dp 2"),
                                                   ("serve", ["--bogus", "--max-num-seqs", "4"], "--bogus"),
                                                   ("generate", ["--prompt", "hi", "--port", "1"], "--port 1")])
def test_an_unknown_flag_is_named_with_its_subcommands_usage(capsys, command, flags, unknown):
    """(argparse's top-level parser would print ``usage: tokenmill [-h] {serve,engine,generate}``, which does not say
    that ``-dp`` is serve's flag, not the engine's)"""
    with pytest.raises(SystemExit) as e:
        main([command, *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"usage: tokenmill {command}" in err
    assert f"tokenmill {command}: error: unrecognized arguments: {unknown}" in err


@pytest.mark.parametrize("flags", [["--api-key", ""], ["--api-key", "  "], ["--api-key", "ok", "--api-key", " "]])
def test_blank_api_key_is_a_usage_error(capsys, monkeypatch, flags):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with a blank key"))
    assert "--api-key is blank" in usage_error(capsys, *flags)


def test_keys_a_client_could_not_tell_apart_are_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with keys that read as each other"))
    assert "are the same bytes, one in UTF-8" in usage_error(capsys, "--api-key", "sk-\u00e9", "--api-key",
                                                                "sk-\u00c3\u00a9")


def test_a_key_that_is_not_utf8_is_a_usage_error_naming_it(capsys, monkeypatch):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with a key no client can send"))
    assert "API key 2 is not valid UTF-8" in usage_error(capsys, "--api-key", "ok", "--api-key", "sk-\udce9")


def test_blank_key_in_the_environment_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with a blank key"))
    monkeypatch.setenv("TOKENMILL_API_KEY", " ")
    assert "TOKENMILL_API_KEY is blank" in usage_error(capsys)
    with pytest.raises(ValueError):
        api_keys(None, {"TOKENMILL_API_KEY": ""})
    assert api_keys(None, {}) == []  # unset: no keys, as before


def test_limit_flags_reach_the_frontends_http_config(served, tmp_path, monkeypatch):
    options = served("--max-connections", "7", "--header-timeout", "3", "--body-timeout", "4",
                     "--write-timeout", "5.5", "--max-header-bytes", "16k", "--max-body-bytes", "2M",
                     "--allowed-origins", "https://a.example, http://b.example:8080/",
                     "--forwarded-allow-ips", "10.0.0.0/8, ::1")
    launcher = engine.launcher.Launcher(EngineConfig(), options)
    launcher.runtime_dir = str(tmp_path)
    args = launcher._frontend_args(0)
    assert args.http == HttpConfig(max_connections=7, header_timeout=3.0, body_timeout=4.0,
                                           write_timeout=5.5, max_header_bytes=16 << 10, max_body_bytes=2 << 20,
                                           forwarded_allow_ips=("10.0.0.0/8", "::1"))
    assert args.allowed_origins == ["https://a.example", "http://b.example:8080"]
    defaults = engine.launcher.Launcher(EngineConfig(), served())
    defaults.runtime_dir = str(tmp_path)
    assert defaults._frontend_args(0).http == HttpConfig()  # flags left out keep the defaults
    assert served("--allowed-origins", "*").allowed_origins == ["*"]
    assert served("--forwarded-allow-ips", "").http == {"forwarded_allow_ips": ()}  # (none trusted)
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # (uvicorn's variable, where the flag is left out)
    assert served().http == {"forwarded_allow_ips": ("*",)}


@pytest.mark.parametrize("flags,why", [
    (["--body-timeout", "0"], "--body-timeout must be positive"),
    (["--max-connections", "-1"], "--max-connections must be positive"),
    (["--allowed-origins", "app.example.com"], "is not an origin"),
    (["--forwarded-allow-ips", "10.0.0.0/33"], "'10.0.0.0/33' is no address or network"),
    (["--allowed-origins", "https://app.example.com/path"], "is not an origin"),
])
def test_bad_limits_are_usage_errors(capsys, monkeypatch, flags, why):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with a bad flag"))
    assert why in usage_error(capsys, *flags)


def test_new_flags_have_help():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--max-connections", "--header-timeout", "--body-timeout", "--write-timeout",
                 "--max-header-bytes", "--allowed-origins"):
        assert flag in text


def test_responses_store_flags_reach_the_frontends(served, tmp_path):
    """The frontends share one SQLite file of kept Responses: the server's own (in its runtime dir, removed when it
    stops) unless --responses-store names one (kept across restarts: durable commits); --responses-store-mib 0
    keeps none."""
    def frontend_args(*flags):
        launcher = engine.launcher.Launcher(EngineConfig(), served(*flags))
        launcher.runtime_dir = str(tmp_path)
        return launcher._frontend_args(0), launcher._frontend_args(1)

    a, b = frontend_args()
    assert a.responses_store == b.responses_store == str(tmp_path / "responses.sqlite")
    assert (a.responses_store_mib, a.responses_store_durable) == (256, False)
    a, _ = frontend_args("--responses-store", str(tmp_path / "kept.db"), "--responses-store-mib", "3")
    assert (a.responses_store, a.responses_store_mib, a.responses_store_durable) == (str(tmp_path / "kept.db"), 3, True)
    assert oct((tmp_path / "kept.db").stat().st_mode & 0o777) == "0o600"  # (made by the check: its owner's alone)
    assert frontend_args("--responses-store-mib", "0")[0].responses_store is None


@pytest.mark.parametrize("flags,why", [
    (["--responses-store-mib", "-1"], "--responses-store-mib must be 0 or more"),
    (["--responses-store", "/no/such/folder/r.db"], "no such folder"),
    (["--responses-store", "{tmp}"], "unable to open database file"),  # (a folder)
    (["--responses-store", "{tmp}/notes.txt"], "file is not a database"),  # (review: found at the first Response)
])
def test_bad_responses_store_flags_are_usage_errors(capsys, monkeypatch, tmp_path, flags, why):
    monkeypatch.setattr(engine.launcher, "serve", lambda *a: pytest.fail("served with a bad flag"))
    (tmp_path / "notes.txt").write_text("not a database, and left as it is\n" * 100)
    assert why in usage_error(capsys, *[f.format(tmp=tmp_path) for f in flags])
    assert (tmp_path / "notes.txt").read_text() == "not a database, and left as it is\n" * 100
