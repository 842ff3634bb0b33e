"""A flood of wrongly signed messages at a live controller, and a worker that
loses its controller.

Anyone who can connect to the controller's address (here: a process of the
same user, which is admitted) sends wrongly signed 100-byte messages as fast
as it can, for longer than a worker's heartbeat timeout, while calls keep
running. Refusing them must cost little, never hold up the controller's
heartbeats (no worker exits), and be reported as a few summary lines, not one
line per message. A worker that leaves because its controller went silent
says so, and so does the error of the calls it fails.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import zmq
from wire_attack_helpers import count_drops

from monarch_kernel.controller.request import RankInfo
from monarch_kernel.errors import MeshFailure
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.wire import messages, protocol

pytestmark = pytest.mark.timeout(240)

#: wrongly signed messages the flood sends at least
FLOOD_MIN = 20_000
#: seconds it goes on at least: longer than a worker's heartbeat timeout (6 s)
FLOOD_S = 8.0
#: what the controller's process may grow by during the flood (its sockets queue at
#: most RECEIVE_QUEUE messages per connection; the rest waits in the flooder)
MEMORY_BOUND = 100 * 2**20

#: messages a second it sends at most (as fast as it can, up to this: the controller's
#: socket queues what it has not read yet, and the test waits until it read them all)
FLOOD_RATE = 10_000

FLOODER = textwrap.dedent('''
    import os, sys, time
    import zmq
    address, server_key = sys.argv[1], sys.argv[2]
    seconds, least, rate = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    if server_key != "-":  # a CURVE server: anyone may make a key pair and connect
        public, secret = zmq.curve_keypair()
        d.curve_publickey, d.curve_secretkey = public, secret
        d.curve_serverkey = server_key.encode()
    d.connect(address)
    # 100 bytes: magic, a made-up signature, epoch and number, a header length, 44 more
    n = 0
    start = time.monotonic()
    end = start + seconds
    while n < least or time.monotonic() < end:
        for _ in range(500):
            d.send(b"MK/4" + os.urandom(48) + (40).to_bytes(4, "little") + os.urandom(44))
        n += 500
        ahead = n / rate - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    print(n, flush=True)
    d.close(0)
    ctx.term()
''')


def _flood(address: str, server_key: bytes | None, seconds: float = FLOOD_S,
           least: int = FLOOD_MIN, rate: int = FLOOD_RATE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FLOODER, address, server_key.decode() if server_key else "-",
         str(seconds), str(least), str(rate)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True)


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["lanes", "zeromq"])
def test_a_flood_of_bad_messages_neither_stops_heartbeats_nor_fills_the_log(lanes, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller.controller")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_LANES", lanes)
        mesh = spawn_procs(2)
    ctl = mesh.controller
    proc = None
    try:
        assert list(mesh.collect(mesh.run("rank")).values()) == [0, 1]
        pids = {r: ctl.ranks[r].pid for r in (0, 1)}
        before = ctl.drops.total
        me = psutil.Process()
        rss0 = peak = me.memory_info().rss
        start = time.monotonic()
        proc = _flood(ctl.address, ctl.curve_public_key)
        calls = 0
        silent = 0.0  # the longest the controller went without a word from a rank

        def busy() -> bool:  # calls go on throughout the flood, and until it is all read
            nonlocal calls, silent, peak
            assert list(mesh.collect(mesh.run("rank * 10"), timeout=30).values()) == [0, 10]
            calls += 1
            now = time.monotonic()
            silent = max(silent, *(now - ctl.ranks[r].last_heard for r in (0, 1)))
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.05)
            return proc.poll() is not None and ctl.drops.total - before >= sent

        sent = FLOOD_MIN * 100  # (until the flooder says how many)
        wait_for(lambda: busy() or proc.poll() is not None, 120, what="the flood")
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        sent = int(out.split()[-1])
        assert sent >= FLOOD_MIN
        wait_for(busy, 180, what=f"the controller to refuse all {sent} messages")
        # (without heartbeats from the controller, a rank leaves after 6 s; the controller
        # hears each rank every second, through the flooded socket too without lanes)
        assert silent < 6.0, silent
        # the flood costs the controller bounded memory (it queued in the flooder)
        assert peak - rss0 < MEMORY_BOUND, (rss0 >> 20, peak >> 20)
        assert ctl.drops.total - before == sent
        assert ctl.drops.by_reason["bad signature"] >= sent
        # heartbeats went on: no rank left, none was replaced, calls still run
        assert all(ctl.ranks[r].state in ("idle", "busy") for r in (0, 1)), \
            {r: (ctl.ranks[r].state, ctl.ranks[r].exitcode) for r in (0, 1)}
        assert {r: ctl.ranks[r].pid for r in (0, 1)} == pids
        assert calls > 0
        assert list(mesh.collect(mesh.run("rank"), timeout=30).values()) == [0, 1]
        # reported in a few lines: the first ones, then one summary per interval
        wait_for(lambda: _logged(caplog) >= sent, 15, what="the summary of the flood")
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) <= 3 + (time.monotonic() - start) / 5 + 2, lines
        summaries = [ln for ln in lines if " more messages from 1 peer in the last " in ln]
        assert summaries and all("bad signature" in ln for ln in summaries), lines
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        mesh.stop()


def test_a_flood_faster_than_the_controller_refuses_costs_it_bounded_memory():
    """Sent as fast as the flooder can (faster than the controller refuses), the
    messages wait in the flooder, not in the controller."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_LANES", "0")
        mesh = spawn_procs(1)
    ctl = mesh.controller
    proc = None
    try:
        me = psutil.Process()
        rss0 = peak = me.memory_info().rss
        proc = _flood(ctl.address, ctl.curve_public_key, seconds=3.0, least=0, rate=10**9)

        def done() -> bool:
            nonlocal peak
            peak = max(peak, me.memory_info().rss)
            return proc.poll() is not None

        wait_for(done, 180, what="the flooder to send everything")
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        sent = int(out.split()[-1])
        wait_for(lambda: done() or ctl.drops.total >= sent, 180,
                 what=f"the controller to refuse all {sent} messages")
        assert peak - rss0 < MEMORY_BOUND, (sent, rss0 >> 20, peak >> 20)
        assert list(mesh.collect(mesh.run("rank"), timeout=30).values()) == [0]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        mesh.stop()


def _logged(caplog) -> int:
    return count_drops("\n".join(r.getMessage() for r in caplog.records))


def test_a_worker_that_hears_nothing_from_its_controller_says_so(tmp_path):
    """Its exit code names the cause, and the controller's error says it in words."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    key = protocol.new_key()
    err = tmp_path / "stderr.txt"
    try:
        with open(err, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "monarch_kernel", "worker",
                 "--controller", f"tcp://127.0.0.1:{port}", "--rank", "2", "--world-size", "3",
                 "--heartbeat-timeout", "2", "--telemetry-interval", "0"],
                env=dict(os.environ, MONARCH_MESH_KEY=key.hex()), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=f)
        try:
            code = proc.wait(60)  # (a silent "controller": it never answers)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    finally:
        router.close(0)
        ctx.term()
    assert code == messages.EXIT_SILENCE, err.read_text()
    assert "rank 2: no word from the controller for" in err.read_text()
    info = RankInfo(2, host="node7", pid=1234, state="dead", exitcode=code)
    assert info.describe_exit(1.0) == "stopped: no word from the controller for 6.0 s"
    assert info.describe_exit(2.0) == "stopped: no word from the controller for 12.0 s"
    assert RankInfo(0, exitcode=0).describe_exit() == "exited with code 0"


def test_the_error_of_a_call_names_a_lost_controller(local_mesh):
    ctl = local_mesh.controller
    ctl.mark_dead(1, messages.EXIT_SILENCE)  # as the launcher reports it
    with pytest.raises(MeshFailure, match=r"rank 1 .*stopped: no word from the controller "
                                          r"for 6\.0 s") as e:
        local_mesh.collect(local_mesh.run("rank"))
    assert "exited with code" not in str(e.value)
