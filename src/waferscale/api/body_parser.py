"""Parsing a request body's bytes into a plain dict (gzip, then JSON or msgpack), with nothing imported beyond the
standard library and msgpack: large bodies are parsed in a separate process (api.decoding.BodyDecoder), which runs
this file as a script, starts in a fraction of a second and holds only what it parses.

The child's protocol, over a Unix socket: a request is a header (struct HEADER: content-type, content-encoding and
body lengths, max_bytes) followed by those bytes; the answer is an 8-byte length and a pickle (protocol 5) of the
parsed object or of the BodyError."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import sys
import zlib

import msgpack

JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")
REQUEST_CONTENT_TYPES = JSON_TYPES + MSGPACK_TYPES


class BodyError(Exception):
    """A body the client must fix: its HTTP status, message and the header it names (picklable across processes)."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status_code, message, param, code)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code


def media_type(header: str | None) -> str:
    return (header or "application/json").split(";", 1)[0].strip().lower()


def parse_body(body: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int) -> dict:
    """The decoded object of a request body; a BodyError that names the problem otherwise."""
    kind = media_type(content_type)
    if kind not in REQUEST_CONTENT_TYPES:
        raise BodyError(
            415,
            f"unsupported content type {kind!r}; send one of: {', '.join(REQUEST_CONTENT_TYPES)}",
            "content-type",
            "unsupported_media_type",
        )
    if len(body) > max_bytes:
        raise BodyError(413, f"request body is {len(body)} bytes; the limit is {max_bytes}")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = _gunzip(body, max_bytes)  # bounded: stops decompressing past max_bytes
    elif encoding not in ("identity", ""):
        raise BodyError(415, f"unsupported content encoding {encoding!r}; send gzip or none", "content-encoding")
    if not body:
        raise BodyError(400, "request body is empty; send a CompletionRequest object")
    try:
        if kind in JSON_TYPES:
            obj = json.loads(body)
        else:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # TypeError: a msgpack map keyed by an array or map (unhashable); ValueError covers JSON, over-long
        # integer literals and msgpack's ExtraData/FormatError/StackError.
        fmt = "JSON" if kind in JSON_TYPES else "msgpack"
        raise BodyError(400, f"request body is not valid {fmt}: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise BodyError(400, f"request body must be an object, got {type(obj).__name__}")
    return obj


def _gunzip(body: bytes, max_bytes: int) -> bytes:
    decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = decomp.decompress(body, max_bytes + 1)
    except zlib.error:
        raise BodyError(400, "request body is not valid gzip") from None
    if len(out) > max_bytes:
        raise BodyError(413, f"decompressed request body exceeds the limit of {max_bytes} bytes")
    if not decomp.eof:
        raise BodyError(400, "request body is truncated gzip")
    return out


HEADER = struct.Struct("<IIQQ")  # len(content_type), len(content_encoding), len(body), max_bytes
ANSWER = struct.Struct("<Q")  # the pickle's length


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """n bytes from sock (the GIL is released while each recv waits); EOFError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the body parser's peer closed the socket")
        got += k
    return buf


def serve(sock: socket.socket) -> None:
    """Answer requests on sock until the server closes it (or dies: its end closes with it)."""
    while True:
        try:
            ct_len, ce_len, body_len, max_bytes = HEADER.unpack(recv_exact(sock, HEADER.size))
            meta = recv_exact(sock, ct_len + ce_len).decode()
            body = bytes(recv_exact(sock, body_len))
        except EOFError:
            return
        try:
            answer: tuple = (True, parse_body(body, meta[:ct_len] or None, meta[ct_len:] or None, max_bytes))
        except BodyError as exc:  # sent as its fields: run as a script, its class is __main__.BodyError here
            answer = (False, (exc.status_code, exc.message, exc.param, exc.code))
        del body
        data = pickle.dumps(answer, protocol=5)
        del answer
        sock.sendall(ANSWER.pack(len(data)))
        sock.sendall(data)


if __name__ == "__main__":  # python body_parser.py FD: the child BodyDecoder starts
    try:
        os.nice(19)  # a parse at normal priority would take a core from the engine's OpenMP threads
    except OSError:
        pass
    serve(socket.socket(fileno=int(sys.argv[1])))
