"""Another Unix user against detached meshes (root: the test makes the user).

(a) The registry (one 0600 file per mesh, holding its key, in a 0700
    directory): the other user can neither list the directory nor open a
    record, even one whose path it knows and whose directory it may enter;
    a registry directory that belongs to another user is refused.
(b) A detached local mesh: its attach endpoints are Unix sockets in the
    mesh's own 0700 directory: the other user's connect fails with EACCES.
(c) A detached TCP mesh (over the one-node Slurm): the attach endpoint is a
    CurveZMQ server that admits only the mesh's client key (derived from the
    mesh key): the other user, even given the endpoint and the server's
    public key, is refused at the handshake; without CURVE no handshake
    completes; an attach request signed with another key gets no answer;
    the owner's controller goes on using the mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from other_user import other_user  # noqa: E402
from test_slurm import slurm  # noqa: E402, F401 - the one-node Slurm fixture

from monarch_kernel.mesh import registry  # noqa: E402

pytestmark = pytest.mark.timeout(300)

_IMPORTS = "import errno, json, os, socket, sys, time, zmq"


@pytest.fixture
def open_parent(monkeypatch):
    """A registry under a directory every user may enter (so that only the
    registry's own modes keep the other user out), removed afterwards."""
    parent = tempfile.mkdtemp(prefix="monarch-reg-")
    os.chmod(parent, 0o755)
    monkeypatch.setenv(registry.ENV, os.path.join(parent, "registry"))
    try:
        yield Path(parent)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _record(name: str, **kw) -> registry.MeshRecord:
    fields = {"name": name, "user": os.getuid(), "host": "h", "launcher": "local",
              "shape": {"hosts": 1, "procs": 1}, "world_size": 1, "pids": {0: os.getpid()},
              "endpoints": {0: "ipc:///nowhere/0"}, "key_hex": "ab" * 32,
              "created": time.time(), "keep_alive": 60.0}
    fields.update(kw)
    return registry.MeshRecord(**fields)


READ_REGISTRY = r'''
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "allowed"
    except OSError as e:
        out[what] = errno.errorcode[e.errno]
attempt("listdir", lambda: os.listdir(DIR))
attempt("open", lambda: open(os.path.join(DIR, "secret.json")).read())
print(json.dumps(out))
'''


def test_another_user_cannot_read_the_registry(open_parent):
    rec = _record("secret")
    registry.save(rec)
    d = registry.directory()
    f = d / "secret.json"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    code = READ_REGISTRY.replace("DIR", repr(str(d)))
    with other_user() as u:
        cp = u.python(code, imports=_IMPORTS)
        assert cp.returncode == 0, cp.stderr
        assert json.loads(cp.stdout) == {"listdir": "EACCES", "open": "EACCES"}
        # a directory others may enter (a mistake of the user's): the file's own mode holds
        os.chmod(d, 0o711)
        try:
            cp = u.python(code, imports=_IMPORTS)
        finally:
            os.chmod(d, 0o700)
        assert cp.returncode == 0, cp.stderr
        assert json.loads(cp.stdout)["open"] == "EACCES"
        # a registry directory of another user's is refused, not used
        theirs = open_parent / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, u.uid, u.gid)
        os.environ[registry.ENV] = str(theirs)
        with pytest.raises(PermissionError, match="belongs to another user"):
            registry.directory()
    assert registry.load("secret") is None  # (ENV now names the other user's directory)


UNIX_CONNECT = r'''
out = {}
for rank, path in PATHS.items():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out[rank] = "connected"
    except OSError as e:
        out[rank] = errno.errorcode[e.errno]
    s.close()
try:
    os.listdir(MESH_DIR)
    out["listdir"] = "allowed"
except OSError as e:
    out["listdir"] = errno.errorcode[e.errno]
print(json.dumps(out))
'''


def test_another_user_cannot_connect_to_a_detached_local_mesh(open_parent):
    from monarch_kernel import spawn_procs

    m = spawn_procs(2, name="du-local", detach=True, keep_alive=60, timeout=60)
    try:
        rec = registry.load("du-local")
        assert rec is not None and rec.mesh_dir
        assert stat.S_IMODE(os.stat(rec.mesh_dir).st_mode) == 0o700
        paths = {}
        for rank, ep in rec.endpoints.items():
            assert ep.startswith("ipc://") and ep[6:].startswith(rec.mesh_dir), ep
            paths[str(rank)] = ep[6:]
        code = (UNIX_CONNECT.replace("PATHS", repr(paths))
                .replace("MESH_DIR", repr(rec.mesh_dir)))
        with other_user() as u:
            cp = u.python(code, imports=_IMPORTS)
        assert cp.returncode == 0, cp.stderr
        assert json.loads(cp.stdout) == {"0": "EACCES", "1": "EACCES", "listdir": "EACCES"}
        assert m.exec("rank").values() == [0, 1]
    finally:
        m.stop()
    assert registry.load("du-local") is None


TCP_ATTACH = r'''
from zmq.utils.monitor import recv_monitor_message
from monarch_kernel.wire import protocol
args = json.loads(ARGS)
ctx = zmq.Context()
out = {}
for mode in ("curve", "null"):
    d = ctx.socket(zmq.DEALER)
    d.linger = 0
    mon = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    if mode == "curve":  # the server's public key, leaked; a client key pair of its own
        d.curve_serverkey = args["server_key"].encode()
        d.curve_publickey, d.curve_secretkey = zmq.curve_keypair()
    d.connect(args["endpoint"])
    codec = protocol.Codec(protocol.new_key(), "ctl")
    d.send_multipart(codec.encode("attach", {"t": time.time(), "steal": True,
                                             "pid": os.getpid(), "host": "x"}))
    event = recv_monitor_message(mon)["event"] if mon.poll(3000) else None
    out[mode] = {"handshake": {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
                               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused"}.get(event, "none"),
                 "answer": bool(d.poll(2000))}
    d.disable_monitor()
    mon.close(0)
    d.close(0)
print(json.dumps(out))
'''


@pytest.mark.usefixtures("slurm")
def test_another_user_cannot_attach_to_a_tcp_mesh_without_the_key(open_parent):
    """A Slurm mesh (TCP attach endpoints): the other user knows the endpoint
    and even the server's public key, but not the mesh key."""
    from monarch_kernel import spawn_procs
    from monarch_kernel.transport.sockets import curve_attach_keypair

    m = spawn_procs(2, launcher="slurm", name="du-tcp", detach=True, keep_alive=60,
                    timeout=90)
    try:
        rec = registry.load("du-tcp")
        assert rec is not None and rec.slurm_job
        endpoint = rec.endpoints[0]
        assert endpoint.startswith("tcp://"), rec.endpoints
        server_key = curve_attach_keypair(bytes.fromhex(rec.key_hex))[0].decode()
        code = TCP_ATTACH.replace("ARGS", repr(json.dumps({"endpoint": endpoint,
                                                           "server_key": server_key})))
        with other_user() as u:
            cp = u.python(code, imports=_IMPORTS + "\nimport zmq.utils.monitor\n"
                          "import monarch_kernel.wire.protocol")
        assert cp.returncode == 0, cp.stderr
        assert json.loads(cp.stdout) == {
            "curve": {"handshake": "refused", "answer": False},  # ZAP: not the mesh's key
            "null": {"handshake": "none", "answer": False}}  # no CURVE: no handshake at all
        assert m.exec("rank").values() == [0, 1]  # the owner's controller is untouched
    finally:
        with contextlib.suppress(Exception):
            m.stop()
    assert registry.load("du-tcp") is None
