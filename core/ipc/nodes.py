"""Engine cores on several machines: the addresses, the keys, and what must match between nodes.

The node with the API server binds two TCP sockets on ``parallel.data_parallel_address`` (only
that address): the ROUTER on ``data_parallel_rpc_port`` and the PULL on the port after it
(``paged.core.ipc.engine_core_proc`` has the protocol). Every core, on that node or another,
connects to both.

**Keys** (CurveZMQ): ``paged keys DIR`` writes two key pairs, ``server.key`` / ``server.key_secret``
(the API server node's) and ``node.key`` / ``node.key_secret`` (every engine core's). The same
folder goes to every node (copy it over a channel you trust; the secret files are readable by
their owner only). The API server's sockets are CURVE servers that accept only a client whose
public key is ``node.key`` (a ZAP handler, ``zmq.auth``); the cores are CURVE clients that check
the server's key. Every byte between nodes is then encrypted and authenticated; a node with other
keys is refused in the handshake, before any message, and both sides log it. An address that is
not loopback needs keys (``check_node_security``).

**Fingerprint**: a core's READY carries what must be the same on every core of one engine (``fingerprint``: paged's version, the model's ``config.json``, the dtype, quantization, KV
block size, ``max_model_len``, tensor parallelism, the runner, LoRA and speculative settings); the
API server compares it with rank 0's (always on its own node) and refuses a core that differs,
with a log line naming both, and the core exits with that reason.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import zmq

from paged.core.errors import ConfigError

logger = logging.getLogger("paged")

SERVER_KEY, NODE_KEY = "server", "node"


def addresses(parallel) -> tuple[str, str]:
    """The API server node's two sockets (input ROUTER, output PULL) as ``tcp://`` addresses."""
    host = parallel.data_parallel_address
    if ":" in host and not host.startswith("["):  # IPv6
        host = f"[{host}]"
    port = parallel.data_parallel_rpc_port
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def check_node_security(parallel) -> None:
    """Traffic between machines is authenticated and encrypted: an address other nodes can reach
    needs ``data_parallel_keys`` (ConfigError naming it)."""
    if parallel.data_parallel_address is None:
        return
    if parallel.data_parallel_keys is None:
        if is_loopback(parallel.data_parallel_address):
            return
        raise ConfigError(
            f"parallel.data_parallel_keys: engine cores on other machines connect to "
            f"{parallel.data_parallel_address!r}, so their traffic must be authenticated and encrypted: create keys "
            f"with `paged keys DIR`, copy DIR to every node and pass --data-parallel-keys DIR on each")
    folder = Path(parallel.data_parallel_keys).expanduser()
    missing = [f.name for f in (folder / f"{SERVER_KEY}.key", folder / f"{NODE_KEY}.key_secret") if not f.is_file()]
    if missing:
        raise ConfigError(f"parallel.data_parallel_keys: {str(folder)!r} has no {', '.join(missing)}; create the keys "
                          "with `paged keys DIR`")


def create_keys(folder: str | Path) -> list[Path]:
    """``paged keys DIR``: the API server's and the nodes' key pairs (secret files mode 0600)."""
    import zmq.auth

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (SERVER_KEY, NODE_KEY):
        if (folder / f"{name}.key_secret").exists():
            raise ConfigError(f"keys: {str(folder / (name + '.key_secret'))!r} exists; remove it or choose another "
                              "folder (new keys would lock out the nodes that have the old ones)")
    for name in (SERVER_KEY, NODE_KEY):
        public, secret = zmq.auth.create_certificates(str(folder), name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


def _load(path: Path) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"parallel.data_parallel_keys: cannot read {str(path)!r}: {e}") from None


def secure_server(sockets: list[zmq.Socket], context: zmq.Context, keys_dir: str) -> Any:
    """Make ``sockets`` CURVE servers that accept the nodes' key only; returns the ZAP
    authenticator (a thread; ``stop()`` it when the sockets close)."""
    from zmq.auth.thread import ThreadAuthenticator

    folder = Path(keys_dir).expanduser()
    public, secret = _load(folder / f"{SERVER_KEY}.key_secret")
    authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying), log=logging.getLogger("paged.auth"))
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(_allowed_keys(folder)))
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    return authenticator


def _allowed_keys(folder: Path) -> Path:
    """A folder holding only the nodes' public key (what the ZAP handler reads: every ``*.key``
    in it), next to the keys."""
    allowed = folder / "allowed"
    allowed.mkdir(exist_ok=True)
    (allowed / f"{NODE_KEY}.key").write_bytes((folder / f"{NODE_KEY}.key").read_bytes())
    return allowed


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def watch_connection(sock: zmq.Socket, what: str, on_failure=None, on_up=None, on_down=None) -> threading.Thread:
    """Follow ``sock``'s connections from a daemon thread: ``on_failure(message)`` when a
    handshake fails (CURVE: the peer's keys are not the ones expected), ``on_up()`` when one
    succeeds, ``on_down()`` when a connection is lost (closed, or its ZMTP heartbeats unanswered).
    ``what`` names the socket in messages."""
    from zmq.utils.monitor import recv_monitor_message

    # a plain (blocking) PAIR in the socket's context, whatever kind of socket it is (asyncio too)
    address = f"inproc://paged-monitor-{id(sock):x}"
    sock.monitor(address, _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                 | zmq.EVENT_MONITOR_STOPPED)
    monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    monitor.connect(address)

    def run() -> None:
        try:
            while True:
                event = recv_monitor_message(monitor)
                kind = event["event"]
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if on_up is not None:
                        on_up()
                elif kind == zmq.EVENT_DISCONNECTED:
                    if on_down is not None:
                        on_down()
                elif on_failure is not None:
                    reason = "refused by the ZAP handler" if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH else \
                        "the keys do not match"
                    on_failure(f"{what}: CURVE handshake with {event['endpoint'].decode()} failed ({reason})")
        except zmq.ZMQError:
            return
        finally:
            monitor.close(0)

    thread = threading.Thread(target=run, name=f"paged-connection-{what}", daemon=True)
    thread.start()
    return thread


def secure_client(sock: zmq.Socket, keys_dir: str) -> None:
    """Make ``sock`` a CURVE client with the nodes' key, trusting only the API server's key."""
    folder = Path(keys_dir).expanduser()
    public, secret = _load(folder / f"{NODE_KEY}.key_secret")
    server_public, _ = _load(folder / f"{SERVER_KEY}.key")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def fingerprint(config, model_info, dtype: str) -> str:
    """What must be the same on every engine core behind one API server (see the module
    docstring), as JSON (``fingerprint_difference`` names what differs)."""
    from paged import __version__

    try:
        model_config = (Path(model_info.model_dir) / "config.json").read_bytes()
    except OSError:
        model_config = b""
    fields = {
        "paged": __version__,
        "config.json": hashlib.sha256(model_config).hexdigest(),
        "dtype": dtype,
        "quantization": [config.model.quantization, config.model.quantization_options],
        "block_size": config.cache.block_size,
        "max_model_len": model_info.max_model_len,
        "vocab_size": model_info.vocab_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "runner": config.model.runner,
        "lora": [config.lora.enable_lora, config.lora.max_loras, config.lora.max_lora_rank],
        "speculative": config.speculative.method,
    }
    return json.dumps(fields, sort_keys=True, default=str)


def fingerprint_difference(expected: str, got: str) -> str:
    """What differs between two fingerprints, e.g. ``max_model_len 2048 != 1024`` ('' if nothing)."""
    try:
        a, b = json.loads(expected), json.loads(got)
    except ValueError:
        return "an unreadable fingerprint"
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k} {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


def hostname() -> str:
    return socket.gethostname()
