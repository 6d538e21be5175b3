"""The wire format: golden bytes per message type, round trips, malformed frames.

A failing golden test means the wire changed: frontends and engines of different
builds would no longer understand each other. Change the bytes here only together
with ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import msgpack
import pytest

from engine import protocol as p

SP = p.SamplingParams(max_tokens=4, temperature=0.0, seed=7, logit_bias={5: -1.5}, stop=["\n"],
                      json_schema={"type": "object"})

MESSAGES = {
    "hello": p.Hello("fe0"),
    "ready": p.Ready("tiny", 1024, 49152, [2], 64, 100, 16, loras=[["sql", "/adapters/sql"]], max_loras=4),
    "add": p.Add("r1", [1, 2, 3], SP, 1, 1700000000.5, "t1", lora="sql", client="user:alice"),
    "image add": p.Add("r3", [5, 9, 9, 6], p.SamplingParams(max_tokens=2), images=[
        p.ImageInput(1, 2, [3, 1, 1], b"\x00\x00\x80?" * 3)], admitted=True),  # (a beam search's later round)
    "image ready": p.Ready("llava", 4096, 32064, [2], 64, 100, 16, image_token_id=32000, image_tokens=576,
                           max_images=16),
    "classifier ready": p.Ready("reward", 4096, 32064, [2], 64, 100, 16, labels=["neg", "pos"]),
    "ready with a request timeout": p.Ready("tiny", 1024, 49152, [2], 64, 100, 16, request_timeout=30.0),
    "abort": p.Abort(["r1", "r2"]),
    "outputs": p.Outputs.of([
        p.Delta("r1", [7, 8], None, [[-0.5, [[7, -0.5]]], [-0.25, [[8, -0.25]]]], 3, 0),
        p.Delta("r2", [9], "length", None, 2, 1, None, None),
    ]),
    "embed": p.Add("e1", [1, 2], p.SamplingParams(max_tokens=1), 0, None, "", p.PoolingParams(64, False)),
    "embedding": p.Outputs.of([p.Delta("e1", [], "stop", None, 2, 0, None, None, b"\x00\x00\x80?\x00\x00\x00\xbf")]),
    "stats": p.Stats(1, 2, 0.25, 75, 100, 3, 4, 0.5, 6, 0.125, 7, 20, 15, 2.5),
    "error": p.Error("r1", 429, "rate_limit_error", "queue full", None),
    "lora load": p.LoraUpdate("c1", "sql", "/adapters/sql"),
    "lora unload": p.LoraUpdate("c2", "sql", None),
    "lora answer": p.LoraUpdate("c1", "sql", "/adapters/sql", 400, "no free LoRA slot", "lora_name"),
    "prefix cache reset": p.PrefixCacheReset("c1"),
    "prefix cache reset answer": p.PrefixCacheReset("c1", 200, True),
    "add with llama.cpp's samplers": p.Add("r4", [1], p.SamplingParams(
        dry_multiplier=0.8, dry_sequence_breakers=["\n"], dry_breaker_token_ids=[[198], [25, 7]], xtc_probability=0.5,
        typical_p=0.9, top_n_sigma=1.5, dynatemp_range=0.25, mirostat=2)),
}

GOLDEN = {
    "hello": "920192a366653013",
    "ready": (
        "9202dc0010a474696e79cd0400cdc0009102406410cd04009192a373716cad2f61646170746572732f73716c04ff0000"
        "90c013"
    ),
    "add": (
        "92039ba2723193010203de0028aa6d61785f746f6b656e7304ab74656d7065726174757265cb0000000000000000a574"
        "6f705f70cb3ff0000000000000a5746f705f6b00a56d696e5f70cb0000000000000000a47365656407b070726573656e"
        "63655f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b272"
        "657065746974696f6e5f70656e616c7479cb3ff0000000000000ad7265706561745f6c6173745f6ec0aa6c6f6769745f"
        "62696173919205cbbff8000000000000a473746f7091a10aae73746f705f746f6b656e5f69647390aa69676e6f72655f"
        "656f73c2aa6d696e5f746f6b656e7300a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0ab6a736f6e"
        "5f736368656d6181a474797065a66f626a656374a663686f696365c0a57265676578c0a76772616d6d6172c0b1616c6c"
        "6f7765645f746f6b656e5f696473c0a96261645f776f726473c0b36261645f776f7264735f746f6b656e5f696473c0ba"
        "696e636c7564655f73746f705f7374725f696e5f6f7574707574c2ae6472795f6d756c7469706c696572cb0000000000"
        "000000a86472795f62617365cb3ffc000000000000b26472795f616c6c6f7765645f6c656e67746802b26472795f7065"
        "6e616c74795f6c6173745f6effb56472795f73657175656e63655f627265616b657273c0b56472795f627265616b6572"
        "5f746f6b656e5f696473c0af7874635f70726f626162696c697479cb0000000000000000ad7874635f7468726573686f"
        "6c64cb3fb999999999999aa97479706963616c5f70cb3ff0000000000000ab746f705f6e5f7369676d61cbbff0000000"
        "000000ae64796e6174656d705f72616e6765cb0000000000000000b164796e6174656d705f6578706f6e656e74cb3ff0"
        "000000000000a86d69726f7374617400ac6d69726f737461745f746175cb4014000000000000ac6d69726f737461745f"
        "657461cb3fb999999999999a01cb41d954fc40200000a27431c0a373716c90c2aa757365723a616c696365"
    ),
    "image add": (
        "92039ba272339405090906de0028aa6d61785f746f6b656e7302ab74656d7065726174757265cb3ff0000000000000a5"
        "746f705f70cb3ff0000000000000a5746f705f6b00a56d696e5f70cb0000000000000000a473656564c0b07072657365"
        "6e63655f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b2"
        "72657065746974696f6e5f70656e616c7479cb3ff0000000000000ad7265706561745f6c6173745f6ec0aa6c6f676974"
        "5f62696173c0a473746f7090ae73746f705f746f6b656e5f69647390aa69676e6f72655f656f73c2aa6d696e5f746f6b"
        "656e7300a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0ab6a736f6e5f736368656d61c0a663686f"
        "696365c0a57265676578c0a76772616d6d6172c0b1616c6c6f7765645f746f6b656e5f696473c0a96261645f776f7264"
        "73c0b36261645f776f7264735f746f6b656e5f696473c0ba696e636c7564655f73746f705f7374725f696e5f6f757470"
        "7574c2ae6472795f6d756c7469706c696572cb0000000000000000a86472795f62617365cb3ffc000000000000b26472"
        "795f616c6c6f7765645f6c656e67746802b26472795f70656e616c74795f6c6173745f6effb56472795f73657175656e"
        "63655f627265616b657273c0b56472795f627265616b65725f746f6b656e5f696473c0af7874635f70726f626162696c"
        "697479cb0000000000000000ad7874635f7468726573686f6c64cb3fb999999999999aa97479706963616c5f70cb3ff0"
        "000000000000ab746f705f6e5f7369676d61cbbff0000000000000ae64796e6174656d705f72616e6765cb0000000000"
        "000000b164796e6174656d705f6578706f6e656e74cb3ff0000000000000a86d69726f7374617400ac6d69726f737461"
        "745f746175cb4014000000000000ac6d69726f737461745f657461cb3fb999999999999a00c0a0c0a091940102930301"
        "01c40c0000803f0000803f0000803fc3a0"
    ),
    "image ready": "9202dc0010a56c6c617661cd1000cd7d409102406410cd04009000cd7d00cd02401090c013",
    "classifier ready": (
        "9202dc0010a6726577617264cd1000cd7d409102406410cd04009000ff000092a36e6567a3706f73c013"
    ),
    "ready with a request timeout": (
        "9202dc0010a474696e79cd0400cdc0009102406410cd04009000ff000090cb403e00000000000013"
    ),
    "abort": "920492a27231a27232",
    "outputs": (
        "92059592a27231a27232929207089109920302920001929600c09292cbbfe0000000000000c40807000000000000bf92"
        "cbbfd0000000000000c40808000000000080bec0c0c09601a66c656e677468c0c0c0c0"
    ),
    "embed": (
        "92039ba26531920102de0028aa6d61785f746f6b656e7301ab74656d7065726174757265cb3ff0000000000000a5746f"
        "705f70cb3ff0000000000000a5746f705f6b00a56d696e5f70cb0000000000000000a473656564c0b070726573656e63"
        "655f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b27265"
        "7065746974696f6e5f70656e616c7479cb3ff0000000000000ad7265706561745f6c6173745f6ec0aa6c6f6769745f62"
        "696173c0a473746f7090ae73746f705f746f6b656e5f69647390aa69676e6f72655f656f73c2aa6d696e5f746f6b656e"
        "7300a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0ab6a736f6e5f736368656d61c0a663686f6963"
        "65c0a57265676578c0a76772616d6d6172c0b1616c6c6f7765645f746f6b656e5f696473c0a96261645f776f726473c0"
        "b36261645f776f7264735f746f6b656e5f696473c0ba696e636c7564655f73746f705f7374725f696e5f6f7574707574"
        "c2ae6472795f6d756c7469706c696572cb0000000000000000a86472795f62617365cb3ffc000000000000b26472795f"
        "616c6c6f7765645f6c656e67746802b26472795f70656e616c74795f6c6173745f6effb56472795f73657175656e6365"
        "5f627265616b657273c0b56472795f627265616b65725f746f6b656e5f696473c0af7874635f70726f626162696c6974"
        "79cb0000000000000000ad7874635f7468726573686f6c64cb3fb999999999999aa97479706963616c5f70cb3ff00000"
        "00000000ab746f705f6e5f7369676d61cbbff0000000000000ae64796e6174656d705f72616e6765cb00000000000000"
        "00b164796e6174656d705f6578706f6e656e74cb3ff0000000000000a86d69726f7374617400ac6d69726f737461745f"
        "746175cb4014000000000000ac6d69726f737461745f657461cb3fb999999999999a00c0a09240c2a090c2a0"
    ),
    "embedding": "92059591a26531919091029100919600a473746f70c0c0c0c4080000803f000000bf",
    "stats": "92069e0102cb3fd00000000000004b640304cb3fe000000000000006cb3fc000000000000007140fcb4004000000000000",
    "error": "920795a27231cd01adb0726174655f6c696d69745f6572726f72aa71756575652066756c6cc0",
    "lora load": "920896a26331a373716cad2f61646170746572732f73716c00a0c0",
    "lora unload": "920896a26332a373716cc000a0c0",
    "lora answer": (
        "920896a26331a373716cad2f61646170746572732f73716ccd0190b16e6f2066726565204c6f524120736c6f74a96c6f"
        "72615f6e616d65"
    ),
    "prefix cache reset": "920993a2633100c2",
    "prefix cache reset answer": "920993a26331ccc8c3",
    "add with llama.cpp's samplers": (
        "92039ba272349101de0028aa6d61785f746f6b656e7310ab74656d7065726174757265cb3ff0000000000000a5746f70"
        "5f70cb3ff0000000000000a5746f705f6b00a56d696e5f70cb0000000000000000a473656564c0b070726573656e6365"
        "5f70656e616c7479cb0000000000000000b16672657175656e63795f70656e616c7479cb0000000000000000b2726570"
        "65746974696f6e5f70656e616c7479cb3ff0000000000000ad7265706561745f6c6173745f6ec0aa6c6f6769745f6269"
        "6173c0a473746f7090ae73746f705f746f6b656e5f69647390aa69676e6f72655f656f73c2aa6d696e5f746f6b656e73"
        "00a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0ab6a736f6e5f736368656d61c0a663686f696365"
        "c0a57265676578c0a76772616d6d6172c0b1616c6c6f7765645f746f6b656e5f696473c0a96261645f776f726473c0b3"
        "6261645f776f7264735f746f6b656e5f696473c0ba696e636c7564655f73746f705f7374725f696e5f6f7574707574c2"
        "ae6472795f6d756c7469706c696572cb3fe999999999999aa86472795f62617365cb3ffc000000000000b26472795f61"
        "6c6c6f7765645f6c656e67746802b26472795f70656e616c74795f6c6173745f6effb56472795f73657175656e63655f"
        "627265616b65727391a10ab56472795f627265616b65725f746f6b656e5f6964739291ccc6921907af7874635f70726f"
        "626162696c697479cb3fe0000000000000ad7874635f7468726573686f6c64cb3fb999999999999aa97479706963616c"
        "5f70cb3feccccccccccccdab746f705f6e5f7369676d61cb3ff8000000000000ae64796e6174656d705f72616e6765cb"
        "3fd0000000000000b164796e6174656d705f6578706f6e656e74cb3ff0000000000000a86d69726f7374617402ac6d69"
        "726f737461745f746175cb4014000000000000ac6d69726f737461745f657461cb3fb999999999999a00c0a0c0a090c2"
        "a0"
    ),
}


def test_protocol_version_is_pinned():
    assert p.PROTOCOL_VERSION == 19
    assert [int(k) for k in p.Kind] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_golden_bytes(name):
    assert p.encode(MESSAGES[name]).hex() == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_round_trip(name):
    msg = MESSAGES[name]
    back = p.decode(p.encode(msg))
    assert type(back) is type(msg)
    assert back == msg
    assert p.decode(bytes.fromhex(GOLDEN[name])) == msg


def test_sampling_params_round_trip_defaults_and_logit_bias():
    for sp in (p.SamplingParams(), SP, p.SamplingParams(stop="x", top_k=-1, logprobs=0, ignore_eos=True)):
        assert p.SamplingParams.from_wire(sp.to_wire()) == sp
    assert SP.to_wire()["logit_bias"] == [[5, -1.5]]


def test_sampling_params_ignores_unknown_fields():
    wire = p.SamplingParams(max_tokens=3).to_wire() | {"from_the_future": 1}
    assert p.SamplingParams.from_wire(wire).max_tokens == 3


def test_empty_stats_frame_is_a_request():
    frame = msgpack.packb([int(p.Kind.STATS), []])
    assert p.decode(frame) == p.Stats()


def test_error_without_request_id():
    e = p.Error(None, 500, "internal_error", "bad frame")
    assert p.decode(p.encode(e)) == e


def _frame(kind, payload) -> bytes:
    return msgpack.packb([kind, payload], use_bin_type=True)


MALFORMED = {
    "not msgpack": b"\xc1\xc1\xc1",
    "empty": b"",
    "not a pair": msgpack.packb([1, 2, 3]),
    "a bare int": msgpack.packb(5),
    "unknown kind": _frame(99, []),
    "hello short": _frame(1, ["fe0"]),
    "ready short": _frame(2, ["m", 1]),
    "add token ids not a list": _frame(3, ["r", "abc", {}, 0, None]),
    "add token ids with strings": _frame(3, ["r", [1, "2"], {}, 0, None]),
    "add token ids with bools": _frame(3, ["r", [True], {}, 0, None]),
    "add params not a map": _frame(3, ["r", [1], [1, 2], 0, None]),
    "add bad sampling value": _frame(3, ["r", [1], {"temperature": -1.0}, 0, None]),
    "add bad sampling type": _frame(3, ["r", [1], {"max_tokens": "many"}, 0, None]),
    "add bad priority": _frame(3, ["r", [1], {}, "high", None]),
    "add bad deadline": _frame(3, ["r", [1], {}, 0, "soon"]),
    "abort a string": _frame(4, "r1"),
    "outputs short": _frame(5, [["r"], [[1]]]),
    "outputs delta tokens not a list": _frame(5, [["r"], [5], [0], [0], []]),
    "outputs columns of different lengths": _frame(5, [["r", "s"], [[1], [2]], [0], [0, 0], []]),
    "outputs end of no delta": _frame(5, [["r"], [[1]], [0], [0], [[3, "stop", None, None, None, None]]]),
    "outputs delta id not a string": _frame(5, [[7], [[1]], [0], [0], []]),
    "outputs count not an integer": _frame(5, [["r"], [[1]], [0], ["3"], []]),
    "outputs end's index not an integer": _frame(5, [["r"], [[1]], [0], [0], [["0", "stop", None, None, None, None]]]),
    "outputs embedding not float32s": _frame(5, [["r"], [[]], [0], [0], [[0, "stop", None, None, None, b"\x00"]]]),
    "outputs top logprobs not packed": _frame(5, [["r"], [[1]], [0], [0], [[0, None, [[-0.5, [[1, -0.5]], 1]], None,
                                                                               None, None]]]),
    "outputs top logprobs cut short": _frame(5, [["r"], [[1]], [0], [0], [[0, None, [[-0.5, b"\x01" * 7, 1]], None,
                                                                              None, None]]]),
    "outputs prompt logprobs not a list": _frame(5, [["r"], [[1]], [0], [0], [[0, None, None, 3, None, None]]]),
    "stats short": _frame(6, [1, 2]),
    "error short": _frame(7, [None, 500]),
    "lora short": _frame(8, ["c1", "sql"]),
    "lora name not a string": _frame(8, ["c1", 5, None, 0, "", None]),
    "lora path not a string": _frame(8, ["c1", "sql", ["/a"], 0, "", None]),
    "trailing bytes": p.encode(p.Hello("fe0")) + b"\x00",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_raise_protocol_error(name):
    with pytest.raises(p.ProtocolError):
        p.decode(MALFORMED[name])


def test_outputs_are_their_deltas_in_order_and_take_some_renamed():
    """``Outputs`` iterates as the deltas it was made of; ``take`` keeps some of them (an actor's step for one of
    several frontends), renamed, with their ends and logprobs at their new places."""
    lps = [[-0.5, [(3, -0.5)], 1]]
    deltas = [p.Delta("a", [1], None, None, 3, 0), p.Delta("b", [2], "stop", None, 4, 1, None, 7),
              p.Delta("c", [3], None, lps, 5, 2), p.Delta("d", [], "stop", None, 6, 0, None, None, b"\0\0\0\0")]
    out = p.Outputs.of(deltas)
    assert list(out) == deltas and len(out) == 4 and not p.Outputs()
    assert [r[0] for r in out.rare] == [1, 2, 3]  # (a's delta, one token of a running request, has no row)
    assert list(out.take([1, 2], ["B", "C"])) == [p.Delta("B", [2], "stop", None, 4, 1, None, 7),
                                                  p.Delta("C", [3], None, lps, 5, 2)]
    assert out.rare[1][2] == [[-0.5, p.pack_top([[3, -0.5]]), 1]]  # (packed as the engine's step makes it)
    assert list(out.take([0, 3], ["A", "D"])) == [p.Delta("A", [1], None, None, 3, 0),
                                                  p.Delta("D", [], "stop", None, 6, 0, None, None, b"\0\0\0\0")]


def test_protocol_error_is_a_value_error():
    assert issubclass(p.ProtocolError, ValueError)


# ----------------------------------------------------------------------------- caps on sampling params


def test_caps_are_exported_with_their_values():
    assert (p.MAX_STOP_STRINGS, p.MAX_STOP_STRING_BYTES, p.MAX_STOP_TOKEN_IDS, p.MAX_LOGIT_BIAS) == (64, 1024, 2048, 2048)
    assert (p.MIN_REPETITION_PENALTY, p.MAX_REPETITION_PENALTY) == (0.01, 10.0)


def test_values_at_the_caps_are_accepted():
    sp = p.SamplingParams(stop=["x" * 1024] * 64, stop_token_ids=[3] * 2048,
                          logit_bias={i: 1.0 for i in range(2048)}, repetition_penalty=0.01)
    assert p.SamplingParams.from_wire(sp.to_wire()) == sp
    p.SamplingParams(stop=["é" * 512], repetition_penalty=10.0)  # 1024 UTF-8 bytes


@pytest.mark.parametrize(("kw", "param"), [
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop": ["é" * 513]}, "stop"),  # 513 characters, 1026 UTF-8 bytes
    ({"stop_token_ids": [3] * 2049}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(2049)}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),  # 1/1e-40 overflows fp32 logits
    ({"repetition_penalty": 0.009}, "repetition_penalty"),
])
def test_beyond_the_caps_is_refused_naming_the_param(kw, param):
    with pytest.raises(p.SamplingParamError) as e:
        p.SamplingParams(**kw)
    assert e.value.param == param


def test_check_vocab_names_the_param():
    p.SamplingParams(stop_token_ids=[99], logit_bias={99: 1.0}).check_vocab(100)
    for kw, param in (({"stop_token_ids": [1, 100]}, "stop_token_ids"), ({"logit_bias": {100: 1.0}}, "logit_bias")):
        with pytest.raises(p.SamplingParamError) as e:
            p.SamplingParams(**kw).check_vocab(100)
        assert e.value.param == param


def test_to_wire_is_shallow():
    sp = p.SamplingParams(stop=["a"], stop_token_ids=[1, 2], logit_bias={3: 1.0})
    wire = sp.to_wire()
    assert wire["stop_token_ids"] is sp.stop_token_ids and wire["stop"] is sp.stop  # no copy per choice
    assert wire["logit_bias"] == [[3, 1.0]]


@pytest.mark.parametrize("params", [
    {"stop_token_ids": [3] * 2049},
    {"logit_bias": [[i, 1.0] for i in range(2049)]},
    {"logit_bias": {"1": 1.0}},  # a map where pairs belong
    {"stop": ["x"] * 65},
    {"stop": ["x" * 1025]},
    {"repetition_penalty": 1e-40},
])
def test_oversized_sampling_params_over_the_wire_raise_protocol_error(params):
    with pytest.raises(p.ProtocolError):
        p.decode(_frame(int(p.Kind.ADD), ["r", [1], params, 0, None]))
