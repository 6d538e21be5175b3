"""Who may call the server (``frontends/auth.py``): the origin rule, CORS, JSON-only POSTs, the chat page.

The real routes (``OpenAIApi.routes`` and ``websocket.register``) on an
``HttpServer`` in a thread, with a stand-in engine client: every refusal here
happens before a handler would talk to the engine, and the endpoints that do
answer (``/v1/models``, ``/``) need no engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import socket
import threading
from types import SimpleNamespace

import orjson
import pytest

from frontends import websocket
from frontends.auth import Auth
from frontends.errors import ApiError
from frontends.http import HttpServer, Request, shaped_errors
from frontends.openai_api import OpenAIApi

KEY = "sk-auth-test"
MODEL = "secret-model-name"
EVIL = "https://evil.example"
APP = "https://app.example.com"
JSON_POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def make_api(api_keys=(), allowed_origins=(), loopback=False) -> OpenAIApi:
    client = SimpleNamespace(healthy=True, accepting=True, stalled=False, last_stats=None,
                             ready=SimpleNamespace(max_model_len=512, loras=[], max_loras=0))
    return OpenAIApi(client, None, MODEL, list(api_keys), allowed_origins=list(allowed_origins), loopback=loopback)


@contextlib.contextmanager
def serving(api: OpenAIApi):
    router = api.routes()
    websocket.register(router, api)
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(loop.create_server(HttpServer(router), "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(2)


def call(port: int, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def error(body: bytes) -> dict:
    return orjson.loads(body)["error"]


@pytest.fixture(scope="module")
def open_port():
    """No API keys; one extra origin allowed."""
    with serving(make_api(allowed_origins=[APP + "/"])) as port:
        yield port


def test_cross_origin_simple_post_is_refused_without_keys(open_port):
    # the attack: any web page can send this with no CORS preflight
    status, _, body = call(open_port, "POST", "/v1/completions", {"Origin": EVIL, "Content-Type": "text/plain"},
                           b'{"prompt": "spend my GPU"}')
    assert status == 403
    e = error(body)
    assert (e["type"], e["code"]) == ("permission_error", "origin_not_allowed") and EVIL in e["message"]
    status, _, _ = call(open_port, "GET", "/v1/models", {"Origin": EVIL})
    assert status == 403
    status, _, _ = call(open_port, "OPTIONS", "/v1/completions", {"Origin": EVIL})
    assert status == 403


@pytest.mark.parametrize("path", JSON_POSTS)
def test_json_posts_want_a_json_content_type(open_port, path):
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, body = call(open_port, "POST", path, {"Content-Type": ctype} if ctype else {}, b"{nope")
        assert status == 415, ctype
        assert error(body)["type"] == "invalid_request_error" and "application/json" in error(body)["message"]
    for ctype in ("application/json", "Application/JSON; charset=utf-8", 'application/json; Charset="UTF8"',
                  "application/json; charset=US-ASCII", "application/json; charset=utf-8 ",
                  'application/json; foo="a;charset=latin1"; charset=utf-8',  # (a quoted ";" is no separator)
                  "application/vnd.api+json"):
        status, _, body = call(open_port, "POST", path, {"Content-Type": ctype}, b"{nope")
        assert status == 400, ctype  # past the gate: the body itself is what is wrong
    status, _, body = call(open_port, "POST", path, {"Content-Type": "application/json",
                                                     "Content-Encoding": "identity"}, b"{nope")
    assert status == 400
    # read as plain UTF-8 JSON whatever they said, they were answered 200 (review): refused
    for headers, what in (({"Content-Type": "application/json; charset=utf-16"}, "utf-16"),
                          ({"Content-Type": 'application/json; foo="a;b"; charset="latin1"'}, "latin1"),
                          ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, "gzip")):
        status, _, body = call(open_port, "POST", path, headers, b'{"prompt": "x"}')
        assert status == 415 and what in error(body)["message"], headers


def test_allowed_and_same_origins_get_cors(open_port):
    status, headers, body = call(open_port, "GET", "/v1/models", {"Origin": APP})
    assert status == 200 and orjson.loads(body)["data"][0]["id"] == MODEL
    assert headers["access-control-allow-origin"] == APP and headers["vary"] == "origin"
    # errors carry it too, so the page can read them
    status, headers, _ = call(open_port, "POST", "/tokenize", {"Origin": APP, "Content-Type": "text/plain"}, b"{}")
    assert status == 415 and headers["access-control-allow-origin"] == APP
    status, headers, body = call(open_port, "OPTIONS", "/v1/chat/completions",
                                 {"Origin": APP, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204 and body == b"" and "content-length" not in headers
    assert headers["access-control-allow-origin"] == APP
    # the methods the path takes, as its 405 would list them
    assert headers["access-control-allow-methods"] == headers["allow"] == "OPTIONS, POST"
    assert headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"  # as asked
    assert int(headers["access-control-max-age"]) > 0
    _, headers, _ = call(open_port, "OPTIONS", "/v1/messages", {"Origin": APP, "Access-Control-Request-Method": "POST"})
    assert set(headers["access-control-allow-headers"].replace(" ", "").split(",")) == {
        "authorization", "content-type", "x-api-key", "anthropic-version"}  # (Anthropic's SDK sends its key so)
    assert headers["access-control-allow-methods"] == "OPTIONS, POST"  # (a GET there is a 405)
    _, headers, _ = call(open_port, "OPTIONS", "/v1/models", {"Origin": APP, "Access-Control-Request-Method": "GET"})
    assert headers["access-control-allow-methods"] == "GET, HEAD, OPTIONS"
    own = f"http://127.0.0.1:{open_port}"
    status, headers, _ = call(open_port, "POST", "/detokenize", {"Origin": own, "Content-Type": "text/plain"}, b"")
    assert status == 415  # same-origin passes the origin rule
    status, headers, _ = call(open_port, "GET", "/v1/models")  # no Origin: not a browser, no CORS headers
    assert status == 200 and "access-control-allow-origin" not in headers


def test_a_rebound_name_is_not_same_origin(open_port):
    """DNS rebinding: a page of attacker.example, its name re-pointed at 127.0.0.1, sends Origin and Host both
    attacker.example. Same-origin counts only for names no other site's DNS can take: IP addresses,
    localhost, this machine's name, names under .local/.internal."""
    body = b'{"prompt": "spend my GPU", "max_tokens": 1}'
    for host in ("attacker.example", "attacker.example."):
        headers = {"Origin": f"http://{host}:{open_port}", "Host": f"{host}:{open_port}", "Content-Type": "text/plain"}
        status, _, answer = call(open_port, "POST", "/v1/completions", headers, body)
        assert status == 403 and error(answer)["code"] == "origin_not_allowed"
        with pytest.raises(ApiError) as e:
            websocket.WebSocketEndpoint(make_api(), websocket.WsConfig())._check_auth(_upgrade_request(
                {"Origin": f"http://{host}:8000", "Host": f"{host}:8000"}), [])
        assert e.value.status == 403
    for host in ("127.0.0.1", "[::1]", "localhost", "app.localhost", socket.gethostname(), "box.local",
                 "gpu.internal"):
        headers = {"Origin": f"http://{host}:{open_port}", "Host": f"{host}:{open_port}", "Content-Type": "text/plain"}
        status, _, _ = call(open_port, "POST", "/detokenize", headers, b"")
        assert status == 415, host  # past the origin rule
    status, _, _ = call(open_port, "POST", "/detokenize", {"Origin": "http://[bad", "Host": "[bad",
                                                           "Content-Type": "text/plain"}, b"")
    assert status == 403


def test_a_keyless_server_on_loopback_answers_its_local_names_alone():
    """A rebound page's same-origin GETs carry no Origin: a keyless server listening on a loopback address alone
    refuses a Host that is no name of this machine (as Ollama's), unless an allowed origin names it. Elsewhere
    (0.0.0.0, or with keys) any Host is served."""
    from frontends.auth import loopback_only

    assert [loopback_only(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "LOCALHOST", "localhost.",
                                       "::ffff:127.0.0.1", "127.0.0.2", "0.0.0.0", "::", "box")] == [True] * 8 + [False] * 3
    listed = make_api(loopback=True, allowed_origins=["https://proxy.example"])  # (a proxy sends its own Host)
    for api, refused in ((make_api(loopback=True), {"attacker.example", "proxy.example"}),
                         (listed, {"attacker.example"}), (make_api(), set()),
                         (make_api(api_keys=[KEY], loopback=True), set())):
        with serving(api) as port:
            auth = {"Authorization": f"Bearer {KEY}"}
            for host in ("attacker.example", "proxy.example", "Proxy.Example.:443", "attacker.example@127.0.0.1"):
                status, _, body = call(port, "GET", "/v1/models", {"Host": host, **auth})
                bare = host.lower().removesuffix(":443").rstrip(".").split("@")[0]  # (the name a proxy or page gives)
                assert status == (403 if bare in refused else 200), (host, body)
                assert status == 200 or error(body)["code"] == "host_not_allowed"
            status, _, body = call(port, "GET", "/", {"Host": "attacker.example"})  # (the page names the model)
            assert status == (403 if "attacker.example" in refused else 200) and (status == 200 or MODEL.encode()
                                                                                                   not in body)
            for host in ("127.0.0.1", "localhost", socket.gethostname(), "127.1", "2130706433", "localhost."):
                assert call(port, "GET", "/v1/models", {"Host": f"{host}:{port}", **auth})[0] == 200
            assert call(port, "GET", "/health", {"Host": "attacker.example"})[0] == (
                403 if "attacker.example" in refused else 200)  # (one rule for every path)


def test_with_keys_the_key_is_the_protection():
    with serving(make_api(api_keys=[KEY])) as port:
        auth = {"Authorization": f"Bearer {KEY}"}
        status, headers, _ = call(port, "GET", "/v1/models", {"Origin": EVIL, **auth})
        assert status == 200 and "access-control-allow-origin" not in headers  # the browser hides it
        status, _, body = call(port, "GET", "/v1/models", {"Origin": EVIL})
        assert status == 401 and error(body)["code"] == "invalid_api_key"
        status, _, _ = call(port, "POST", "/v1/completions", {"Content-Type": "text/plain", **auth}, b"{}")
        assert status == 415
        status, _, _ = call(port, "GET", "/health", {"Origin": EVIL})
        assert status == 200
        # a preflight carries no key: refused, with the one fix that applies (keys are configured already)
        status, _, body = call(port, "OPTIONS", "/v1/completions", {"Origin": EVIL})
        assert status == 403 and error(body)["message"].endswith("refused (list it in --allowed-origins)")


def raw_get(port: int, path: str, headers: dict[str, bytes]) -> bytes:
    """The status line of a GET whose header values go as the bytes given (http.client would encode them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
                  + b"".join(k.encode() + b": " + v + b"\r\n" for k, v in headers.items()) + b"\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_a_key_that_is_not_ascii_matches_as_its_utf8_or_its_latin1():
    """curl and the ``openai`` client send a header's text as UTF-8, a browser's ``fetch`` as Latin-1 (review: a
    UTF-8 key from curl got 401): either form of a key is that key, and no other's."""
    # (the second has no Latin-1 form; "à" and "Р" end in bytes 0xA0 and 0xA0, which str.strip took as spaces:
    # review, a 401 in UTF-8)
    keys = ["sk-caf\u00e9", "sk-\ua66e-\u00e9", "sk-voil\u00e0", "sk-\u0420"]
    with serving(make_api(api_keys=keys)) as port:
        for value, status in ((keys[0].encode(), b"200"), (keys[0].encode("latin-1"), b"200"),
                              (keys[1].encode(), b"200"), (b"sk-caf\xc3", b"401"), (b"sk-caf", b"401"),
                              (keys[1].encode()[:-1], b"401"), (keys[2].encode(), b"200"),
                              (keys[2].encode("latin-1"), b"200"), (keys[3].encode(), b"200"),
                              (b" \t" + keys[3].encode() + b"\t ", b"200"), (keys[3].encode()[:-1], b"401")):
            for header, prefix in (("Authorization", b"Bearer "), ("x-api-key", b"")):
                line = raw_get(port, "/v1/models", {header: prefix + value})
                assert line.split(b" ")[1] == status, (header, value, line)
    auth = Auth(keys)
    assert [auth.key_number([k.encode(enc).decode("latin-1")]) for k, enc in
            ((keys[0], "utf-8"), (keys[0], "latin-1"), (keys[1], "utf-8"))] == [0, 0, 1]
    assert auth.owner([keys[0].encode("latin-1").decode("latin-1")]) == auth.owner([keys[0].encode().decode("latin-1")])
    # two keys a client's bytes could not tell apart (one's UTF-8 is the other's Latin-1) are refused
    with pytest.raises(ValueError, match="API keys 1 and 2 are the same bytes"):
        Auth(["sk-\u00c3\u00a9", "sk-\u00e9"])
    # the WebSocket's base64url form carries the UTF-8 of any key
    key64 = base64.urlsafe_b64encode(keys[1].encode()).decode().rstrip("=")
    assert auth.key_number(websocket._offered_keys([f"tokenmill.key64.{key64}"])) == 1


def test_a_request_without_its_key_is_refused_before_its_body():
    """401 straight after the head: a client without the key cannot make the server read (or wait for) a body,
    100-continue or not; with the key, the same head is read on as usual."""
    with serving(make_api(api_keys=[KEY])) as port:
        for expect in ({}, {"Expect": "100-continue"}):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            head = {"Host": "x", "Content-Type": "application/json", "Content-Length": "100000", **expect}
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
                      + b"\r\n")  # (the body never comes)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            s.close()
            assert answer.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in answer and b"100 Continue" not in answer
        status, _, body = call(port, "POST", "/v1/completions", {"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {KEY}"}, b"{")
        assert status == 400  # past the key: the body was read (and is no JSON)


def test_any_origin():
    with serving(make_api(allowed_origins=["*"])) as port:
        status, headers, _ = call(port, "GET", "/v1/models", {"Origin": EVIL})
        assert status == 200 and headers["access-control-allow-origin"] == EVIL


def _upgrade_request(headers: dict) -> Request:
    req = Request()
    req.method, req.path = "GET", websocket.PATH
    req.headers = {"host": "127.0.0.1:8000", **{k.lower(): v for k, v in headers.items()}}
    return req


def test_websocket_follows_the_same_origin_rule():
    ep = websocket.WebSocketEndpoint(make_api(allowed_origins=[APP]), websocket.WsConfig())
    ep._check_auth(_upgrade_request({"Origin": APP}), [])
    ep._check_auth(_upgrade_request({"Origin": "http://127.0.0.1:8000"}), [])
    ep._check_auth(_upgrade_request({}), [])
    with pytest.raises(ApiError) as e:
        ep._check_auth(_upgrade_request({"Origin": EVIL}), [])
    assert (e.value.status, e.value.code) == (403, "origin_not_allowed")
    keyed = websocket.WebSocketEndpoint(make_api(api_keys=[KEY]), websocket.WsConfig())
    keyed._check_auth(_upgrade_request({"Origin": EVIL}), [f"{websocket.KEY_PREFIX}{KEY}"])
    with pytest.raises(ApiError) as e:
        keyed._check_auth(_upgrade_request({"Origin": EVIL}), [])
    assert e.value.status == 401


def test_chat_page_names_the_model_only_without_keys():
    with serving(make_api(api_keys=[KEY])) as port:
        status, _, page = call(port, "GET", "/")
        assert status == 200 and b'content="required"' in page
        assert MODEL.encode() not in page  # /v1/models would not say it without a key either
        assert b'fetch("/v1/models"' in page
    with serving(make_api()) as port:
        status, _, page = call(port, "GET", "/")
        assert status == 200 and b"<title>tokenmill \xc2\xb7 " + MODEL.encode() in page


def test_blank_keys_are_refused():
    for keys in ([""], ["  "], ["ok", "\t"]):
        with pytest.raises(ValueError, match="blank"):
            Auth(keys)


def test_an_allowed_origins_error_keeps_its_own_headers():
    async def busy(req):
        raise ApiError(429, "busy", headers=[("retry-after", "1")])

    guarded = Auth(allowed_origins=[APP]).guard(busy, key=False)
    req = Request()
    req.headers = {"origin": APP, "host": "127.0.0.1:8000"}
    with pytest.raises(ApiError) as e:  # (the route's own error shape writes it: frontends.http.shaped_errors)
        asyncio.run(guarded(req))
    assert ("retry-after", "1") in e.value.headers and ("access-control-allow-origin", APP) in e.value.headers
    resp = asyncio.run(shaped_errors(guarded, lambda e: {"error": e.message})(req))  # (Ollama's, say)
    assert resp.status == 429 and orjson.loads(resp.body) == {"error": "busy"}
    assert ("retry-after", "1") in resp.headers and ("access-control-allow-origin", APP) in resp.headers


def test_each_of_several_keys_has_a_prefix_cache_of_its_own():
    """With several API keys a tenant's salt was its clients' to choose, and another's to guess: each key's place
    joins its requests' cache_salt (the engine shares blocks only between equal salts). One key, or none: as sent."""
    from frontends.auth import Auth

    several, one = make_api(api_keys=["ka", "kb"]), make_api(api_keys=["ka"])
    salts = []
    for api, key, salt in ((several, "ka", ""), (several, "kb", ""), (several, "kb", "s"), (several, "ka", "s"),
                           (one, "ka", "s"), (make_api(), None, "s")):
        gen = SimpleNamespace(client_id="", cache_salt=salt)
        api.place(gen, {}, "127.0.0.1", api.key_of(Auth.given(_upgrade_request({"Authorization": f"Bearer {key}"}))))
        salts.append(gen.cache_salt)
    assert salts == ["\0" "0\0", "\0" "1\0", "\0" "1\0s", "\0" "0\0s", "s", "s"]
    assert len(set(salts[:4])) == 4  # (no key's requests, salted or not, share another's blocks)
