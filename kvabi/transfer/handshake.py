"""Connect-time handshake: mutual shared-secret authentication, then descriptor negotiation.

    server -> client  challenge {nonce_s}
    client -> server  auth      {nonce_c, mac_c = HMAC(secret, "kvabi-c" || nonce_s || nonce_c)}
    server -> client  welcome   {mac_s = HMAC(secret, "kvabi-s" || nonce_c || nonce_s), desc, hash}
    client -> server  desc      {desc, hash}            (after checking the server's)
    server -> client  ready                             (after checking the client's)

Each side proves it knows the secret without sending it, and neither parses a descriptor
before the peer is authenticated. Then both check the other's model part with
`check_compatible` (fingerprint, layer geometry, RoPE) and its hash scheme; a mismatch is a
`PeerIncompatibleError` now, never a wrong cache later. Layouts (axes, dtype, block size) may
differ: the receiver converts. The engine caches unquantised K/V, which every dtype converts to.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from kvabi.abi.compat import check_compatible
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.errors import KvabiError
from kvabi.transfer.errors import AuthError, PeerIncompatibleError
from kvabi.transfer.framing import expect, recv_msg, send_msg

HASH_SCHEME = "kvabi-block-hash/1"  # docs/ABI.md, section 4
PROTOCOL = 2  # 2: `wait` heartbeats before a `kv` reply (fetch_loop.py)
NONCE_BYTES = 32
MAX_HANDSHAKE_BYTES = 2**20


def server_handshake(sock: socket.socket, secret: bytes, desc: Descriptor) -> Descriptor:
    """Authenticate the connecting client and check its descriptor; returns it."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    send_msg(sock, {"t": "challenge", "v": PROTOCOL, "nonce": nonce_s})
    auth = expect(recv_msg(sock, 4096), "auth")
    nonce_c = _nonce(auth.get("nonce"))
    if not hmac.compare_digest(_mac(secret, b"kvabi-c", nonce_s, nonce_c), _bytes(auth, "mac")):
        send_msg(sock, {"t": "error", "kind": "auth", "msg": "authentication failed"})
        raise AuthError("a peer failed the shared-secret challenge")
    mac_s = _mac(secret, b"kvabi-s", nonce_c, nonce_s)
    send_msg(sock, {"t": "welcome", "mac": mac_s, "desc": desc.to_json(), "hash": HASH_SCHEME})
    peer = expect(recv_msg(sock, MAX_HANDSHAKE_BYTES), "desc")
    try:
        peer_desc = check_peer(desc, peer)
    except PeerIncompatibleError as exc:
        send_msg(sock, {"t": "error", "kind": "incompatible", "msg": str(exc)})
        raise
    send_msg(sock, {"t": "ready"})
    return peer_desc


def client_handshake(sock: socket.socket, secret: bytes, desc: Descriptor) -> Descriptor:
    """Authenticate to the server, check its descriptor and send ours; returns the server's."""
    challenge = expect(recv_msg(sock, 4096), "challenge")
    if challenge.get("v") != PROTOCOL:
        raise PeerIncompatibleError(f"peer speaks protocol {challenge.get('v')}, not {PROTOCOL}")
    nonce_s, nonce_c = _nonce(challenge.get("nonce")), secrets.token_bytes(NONCE_BYTES)
    mac_c = _mac(secret, b"kvabi-c", nonce_s, nonce_c)
    send_msg(sock, {"t": "auth", "nonce": nonce_c, "mac": mac_c})
    welcome = _expect_auth(recv_msg(sock, MAX_HANDSHAKE_BYTES))
    if not hmac.compare_digest(_mac(secret, b"kvabi-s", nonce_c, nonce_s), _bytes(welcome, "mac")):
        raise AuthError("the server failed the shared-secret challenge")
    try:
        peer_desc = check_peer(desc, welcome)
    except PeerIncompatibleError as exc:
        send_msg(sock, {"t": "error", "kind": "incompatible", "msg": str(exc)})
        raise
    send_msg(sock, {"t": "desc", "desc": desc.to_json(), "hash": HASH_SCHEME})
    expect(recv_msg(sock, 4096), "ready")
    return peer_desc


def check_peer(own: Descriptor, msg: dict) -> Descriptor:
    """The peer's descriptor from its message, refused unless it can exchange KV with ours."""
    if msg.get("hash") != HASH_SCHEME:
        scheme = msg.get("hash")
        raise PeerIncompatibleError(f"peer hashes blocks with {scheme!r}, not {HASH_SCHEME}")
    try:
        peer = Descriptor.from_json(str(msg.get("desc", "")))
        check_compatible(own.model, peer.model)
    except KvabiError as exc:
        raise PeerIncompatibleError(f"peer refused at connect time: {exc}") from exc
    if not peer.layout.is_paged:
        raise PeerIncompatibleError(f"peer layout {peer.layout.axes!r} is not paged")
    return peer


def _expect_auth(msg: dict) -> dict:
    if msg["t"] == "error" and msg.get("kind") == "auth":
        raise AuthError("the server refused our shared secret")
    return expect(msg, "welcome")


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _nonce(value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise AuthError("malformed handshake nonce")
    return value


def _bytes(msg: dict, key: str) -> bytes:
    value = msg.get(key)
    return value if isinstance(value, bytes) else b""
