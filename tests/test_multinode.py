"""Tensor parallel across machines (``--nnodes``), on one host: each "node" is a process group
of its own, and the ranks meet through torch.distributed's TCPStore on 127.0.0.1.

TP=2 over 2 nodes (one rank each) gives TP=1's greedy tokens and a clean shutdown of node 1;
node 1 killed fails the engine within seconds with an error that points at the other node;
the engine (rank 0) killed makes node 1 exit non-zero; bad flags exit 2 with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from engine import LLM, SamplingParams
from engine.cli import main
from engine.parallel import TensorParallelError
from tests.test_server_e2e import CMD, ROOT, free_port, wait_for

KW = dict(device="cpu", num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=32)
PROMPTS = [[1, 5, 9, 200, 3000, 17] * 10, [42, 43], [7, 8, 9]]  # the first prefills in two chunks
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class NoText:
    """Token ids are what is compared: skip loading the tokenizer (seconds)."""

    def decode(self, ids, **kw) -> str:
        return ""


def node(model: str, port: int, rank: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*CMD, "engine", "--model", model, "-tp", "2", "--nnodes", "2", "--node-rank", str(rank),
                             "--device", "cpu", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def node0_llm(model: str, port: int) -> LLM:
    llm = LLM(model, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port, **KW)
    llm.tokenizer = NoText()
    return llm


@pytest.fixture
def stop():
    procs = []
    yield procs.append
    for p in procs:  # on a failed assertion: nothing left behind
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_two_nodes_equal_tp1_and_shut_down_cleanly(tiny_llama, stop):
    with LLM(tiny_llama, **KW) as ref:
        ref.tokenizer = NoText()
        want = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    port = free_port()
    n1 = node(tiny_llama, port, 1)  # before node 0: it waits for the rendezvous
    stop(n1)
    with node0_llm(tiny_llama, port) as llm:
        runner = llm.engine.runner
        assert (runner.tp.rank, runner.tp.size, runner.tp.local_size) == (0, 2, 1)
        assert runner.tp.driver.procs == []  # rank 1 is node 1's
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert n1.wait(15) == 0  # the engine's shutdown command
    out = n1.stdout.read()
    assert "tokenmill engine node 1 of 2: started rank 1 of 2, joining 127.0.0.1" in out
    assert "the engine shut its tensor-parallel ranks down" in out


def test_a_dead_node_fails_the_engine_within_seconds(tiny_llama, stop):
    port = free_port()
    n1 = node(tiny_llama, port, 1)
    stop(n1)
    with node0_llm(tiny_llama, port) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        os.kill(n1.pid, signal.SIGKILL)  # its rank goes with it (PR_SET_PDEATHSIG)
        n1.wait()
        t0 = time.monotonic()
        driver = llm.engine.runner.tp.driver
        wait_for(driver.dead, 5, "rank 0 to see rank 1's connection close")  # (rank 1 dies a moment after n1)
        # seen before the step by its connection to rank 0 (or, dying in the step, by that connection
        # closing while the collective fails): never a collective that waits out its timeout
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 on node 1 is gone \(its "
                                                      r"connection to rank 0 closed\)"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(TensorParallelError, match="rank 1 on node 1"):  # and stays failed
            llm.generate(PROMPTS[:1], GREEDY)


def test_a_node_exits_when_the_engine_is_gone(tiny_llama, tmp_path, stop):
    port = free_port()
    n0 = node(tiny_llama, port, 0, "--listen", f"ipc://{tmp_path}/engine.sock", "--kv-cache-memory", "16M")
    stop(n0)
    n1 = node(tiny_llama, port, 1)
    stop(n1)
    lines: list[str] = []

    def serving() -> bool:
        lines.append(n0.stdout.readline())
        return "tokenmill engine serving" in lines[-1] or n0.poll() is not None

    wait_for(serving, 60, "node 0's engine to serve")
    assert n0.poll() is None, "".join(lines)
    os.kill(n0.pid, signal.SIGKILL)
    assert n1.wait(15) == 1
    assert "the tensor-parallel group broke (is the engine on node 0 gone?)" in n1.stdout.read()


@pytest.mark.parametrize("args,message", [
    (["engine", "-tp", "3", "--nnodes", "2", "--master-addr", "h", "--listen", "ipc:///tmp/x"],
     "tensor_parallel_size 3 is not divisible by nnodes 2"),
    (["engine", "-tp", "2", "--nnodes", "2", "--node-rank", "1"], "nnodes 2 needs master_addr (--master-addr)"),
    (["engine", "-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     "node_rank must be in [0, nnodes) = [0, 2), got 2"),
    (["engine", "--nnodes", "0", "--listen", "ipc:///tmp/x"], "nnodes must be at least 1, got 0"),
    (["engine", "-tp", "2", "--nnodes", "2", "--master-addr", "h", "--master-port", "70000", "--listen",
      "ipc:///tmp/x"], "master_port must be in [1, 65535], got 70000"),
    (["engine", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--listen", "ipc:///tmp/x"],
     "--listen is for node 0 (the engine); --node-rank 1 runs only tensor-parallel ranks"),
    (["engine", "-tp", "2", "--nnodes", "2", "--master-addr", "h"], "--listen is required"),
    (["engine", "--listen", "tcp://0.0.0.0", "--engine-key", "k" * 16], "--listen must be tcp://HOST:PORT (a port"),
    (["engine", "--listen", "ipc:///tmp/x", "--shutdown-timeout", "-2"], "--shutdown-timeout must be 0 or more"),
    (["serve", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h"],
     "--node-rank 1 runs only tensor-parallel ranks: start it with `tokenmill engine`"),
    (["serve", "-tp", "2", "--nnodes", "2", "--master-addr", "h", "-dp", "2"],
     "--nnodes spreads one local engine's ranks over hosts; it does not combine with --data-parallel-size"),
    # the combination is the fault named, before each flag's own checks (which named -tp or --master-addr)
    (["serve", "--nnodes", "2", "-dp", "2"],
     "--nnodes spreads one local engine's ranks over hosts; it does not combine with --data-parallel-size"),
    (["serve", "--nnodes", "2", "--node-rank", "1"], "--node-rank 1 runs only tensor-parallel ranks"),
    (["serve", "--engine", "tcp://h:1", "-tp", "3", "--nnodes", "2"], "-tp N`): with --engine no engine starts"),
])
def test_bad_flags_exit_2_with_the_reason(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flags_through_the_console_script():
    r = subprocess.run([*CMD, "serve", "-tp", "2", "--nnodes", "2"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2
    assert "nnodes 2 needs master_addr (--master-addr)" in r.stderr


def test_node_rank_above_0_is_not_an_engine(tiny_llama):
    with pytest.raises(ValueError, match=r"node_rank 1 runs only tensor-parallel workers \(`tokenmill engine "
                                         r"--node-rank 1`, without --listen\); the engine is node 0"):
        LLM(tiny_llama, tensor_parallel_size=2, nnodes=2, node_rank=1, master_addr="127.0.0.1")


def test_rank_zero_links_only_the_ranks_it_waits_for_and_sees_them_close():
    """``_accept_links`` (t=3 ranks, one on node 0): a connection that closes at once, one that says a rank
    out of range, and a second one for rank 1 are dropped; rank 1's hello split in two and rank 2's
    are linked. A rank that sent a byte more than its hello is still seen to close."""
    import socket
    import threading

    from engine.parallel import Driver
    from engine.tp_worker import _accept_links

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    held = []

    def clients():
        def connect(*parts: bytes) -> socket.socket:
            s = socket.create_connection(("127.0.0.1", port))
            for p in parts:
                s.sendall(p)
                time.sleep(0.05)
            return s

        connect().close()
        held.append(connect((7).to_bytes(4, "little")))
        held.append(connect(b"\x01", b"\x00\x00\x00"))  # rank 1, in two pieces
        held.append(connect((1).to_bytes(4, "little")))  # rank 1 again
        held.append(connect((2).to_bytes(4, "little") + b"!"))  # rank 2, and a byte more

    thread = threading.Thread(target=clients)
    thread.start()
    driver = Driver([], remote="ranks 1-2 on node 1")
    _accept_links(server, driver, 1, 3)
    thread.join()
    assert sorted(driver.links) == ["rank 1 on node 1", "rank 2 on node 2"]
    assert driver.dead() == []
    held[3].close()  # rank 2
    wait_for(driver.dead, 5, "rank 2's link to close")
    assert driver.dead() == ["tensor-parallel rank 2 on node 2 is gone (its connection to rank 0 closed)"]
    driver.close()
    assert driver.dead() == []  # (closed: nothing left to poll)
    for s in held:
        s.close()
    server.close()
