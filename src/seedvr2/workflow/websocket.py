"""A minimal WebSocket client (RFC 6455), standard library only: enough to follow ComfyUI.

Client handshake (``Sec-WebSocket-Key`` / ``Sec-WebSocket-Accept`` checked), masked frames
from the client, text and binary messages (fragmented ones reassembled), ping answered with
pong, close answered with close. No extensions (no compression is asked for, so the server
sends none) and no subprotocols. ``ws://`` and ``wss://`` URLs.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import ssl
import struct
import time
import urllib.parse
from typing import Optional, Union

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_MESSAGE = 256 * 1024 * 1024  # a larger message is a broken stream, not a ComfyUI event


class WebSocketError(OSError):
    """The connection failed, the handshake was refused, or the stream broke the protocol."""


class WebSocketClosed(WebSocketError):
    """The server closed the connection."""


def accept_key(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` a server answers to ``key`` (RFC 6455 section 4.2.2)."""
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


def encode_frame(opcode: int, payload: bytes, mask: Optional[bytes] = None, fin: bool = True) -> bytes:
    """One frame; client frames are masked (``mask``: 4 bytes, random when not given)."""
    mask = os.urandom(4) if mask is None else mask
    head = bytes([(0x80 if fin else 0) | opcode])
    length = len(payload)
    if length < 126:
        head += bytes([0x80 | length])
    elif length < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", length)
    return head + mask + _unmask(payload, mask)


def _unmask(data: bytes, mask: bytes) -> bytes:
    if not data:
        return b""
    key = int.from_bytes((mask * (len(data) // 4 + 1))[:len(data)], "big")
    return (int.from_bytes(data, "big") ^ key).to_bytes(len(data), "big")


def parse_frame(buffer: Union[bytes, bytearray]) -> Optional[tuple]:
    """``(fin, opcode, payload, frame length)`` of the frame at the start of ``buffer``, or
    None while it is incomplete."""
    if len(buffer) < 2:
        return None
    fin, opcode = bool(buffer[0] & 0x80), buffer[0] & 0x0F
    if buffer[0] & 0x70:
        raise WebSocketError("frame with reserved bits set (no extension was negotiated)")
    masked, length, offset = bool(buffer[1] & 0x80), buffer[1] & 0x7F, 2
    if length == 126:
        if len(buffer) < 4:
            return None
        length, offset = struct.unpack("!H", bytes(buffer[2:4]))[0], 4
    elif length == 127:
        if len(buffer) < 10:
            return None
        length, offset = struct.unpack("!Q", bytes(buffer[2:10]))[0], 10
    if length > MAX_MESSAGE:
        raise WebSocketError(f"frame of {length} bytes")
    mask = b""
    if masked:
        if len(buffer) < offset + 4:
            return None
        mask, offset = bytes(buffer[offset:offset + 4]), offset + 4
    if len(buffer) < offset + length:
        return None
    payload = bytes(buffer[offset:offset + length])
    return fin, opcode, _unmask(payload, mask) if masked else payload, offset + length


class WebSocket:
    """One client connection. ``recv(timeout)`` returns ``("text", str)``,
    ``("binary", bytes)`` or None when nothing complete arrived in time."""

    def __init__(self, url: str, timeout: float = 30.0, headers: Optional[dict] = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("ws", "wss"):
            raise WebSocketError(f"{url}: not a ws:// or wss:// URL")
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "wss" else 80)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            if parts.scheme == "wss":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        except OSError as e:
            raise WebSocketError(f"cannot connect to {url}: {e}") from None
        self.sock = sock
        self._buffer = bytearray()
        self._fragments: list = []
        self._fragment_opcode = 0
        self.closed = False
        try:
            self._handshake(parts, host, port, timeout, headers or {})
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, parts, host, port, timeout, headers):
        key = base64.b64encode(os.urandom(16)).decode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        default_port = 443 if parts.scheme == "wss" else 80
        lines = [f"GET {path} HTTP/1.1",
                 f"Host: {host}" + ("" if port == default_port else f":{port}"),
                 "Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13", *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            while b"\r\n\r\n" not in self._buffer:
                chunk = self.sock.recv(4096)
                if not chunk:
                    raise WebSocketError("the server closed the connection during the handshake")
                self._buffer += chunk
                if len(self._buffer) > 65536:
                    raise WebSocketError("handshake response too long")
        except OSError as e:
            if isinstance(e, WebSocketError):
                raise
            raise WebSocketError(f"handshake failed: {e}") from None
        head, _, rest = bytes(self._buffer).partition(b"\r\n\r\n")
        self._buffer = bytearray(rest)
        status, *header_lines = head.decode("latin-1").split("\r\n")
        fields = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        if status.split(" ")[1:2] != ["101"]:
            raise WebSocketError(f"the server refused the websocket: {status}")
        if fields.get("upgrade", "").lower() != "websocket" or \
                "upgrade" not in fields.get("connection", "").lower():
            raise WebSocketError("the server did not upgrade the connection to a websocket")
        if fields.get("sec-websocket-accept") != accept_key(key):
            raise WebSocketError("wrong Sec-WebSocket-Accept in the handshake response")
        if fields.get("sec-websocket-extensions"):
            raise WebSocketError("the server chose an extension that was not asked for")

    # -- sending -----------------------------------------------------------------------------

    def _send(self, opcode: int, payload: bytes) -> None:
        try:
            self.sock.sendall(encode_frame(opcode, payload))
        except OSError as e:
            raise WebSocketError(f"sending failed: {e}") from None

    def send_text(self, text: str) -> None:
        self._send(TEXT, text.encode())

    def ping(self, payload: bytes = b"") -> None:
        self._send(PING, payload)

    # -- receiving ---------------------------------------------------------------------------

    def recv(self, timeout: Optional[float] = None) -> Optional[tuple]:
        """The next message, or None if none completed within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            message = self._next_message()
            if message is not None:
                return message
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                self.sock.settimeout(left)
                chunk = self.sock.recv(65536)
            except socket.timeout:
                return None
            except OSError as e:
                raise WebSocketError(f"receiving failed: {e}") from None
            if not chunk:
                self.closed = True
                raise WebSocketClosed("the server closed the connection")
            self._buffer += chunk

    def _next_message(self) -> Optional[tuple]:
        while True:
            frame = parse_frame(self._buffer)
            if frame is None:
                return None
            fin, opcode, payload, size = frame
            del self._buffer[:size]
            if opcode == PING:
                self._send(PONG, payload)
            elif opcode == PONG:
                pass
            elif opcode == CLOSE:
                if not self.closed:
                    self.closed = True
                    try:
                        self._send(CLOSE, payload[:2])
                    except WebSocketError:
                        pass
                raise WebSocketClosed("the server closed the websocket")
            elif opcode in (TEXT, BINARY, CONTINUATION):
                if opcode != CONTINUATION:
                    if self._fragments:
                        raise WebSocketError("a new message began inside a fragmented one")
                    self._fragment_opcode = opcode
                elif not self._fragments:
                    raise WebSocketError("continuation frame without a message")
                self._fragments.append(payload)
                if sum(map(len, self._fragments)) > MAX_MESSAGE:
                    raise WebSocketError("message too large")
                if fin:
                    data, self._fragments = b"".join(self._fragments), []
                    if self._fragment_opcode == TEXT:
                        return "text", data.decode("utf-8")
                    return "binary", data
            else:
                raise WebSocketError(f"unknown opcode {opcode:#x}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.sendall(encode_frame(CLOSE, struct.pack("!H", 1000)))
            except OSError:
                pass
        self.sock.close()

    def __enter__(self) -> "WebSocket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
