"""A small HTTP/1.1 TCP proxy that corrupts one upload: run on the API host between a worker
and the API (``python tests/netns/proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT LOG ARM_FILE``).

Every request is forwarded as sent, but with ``Connection: close`` (one request per connection,
so each response's status line is the first thing the API sends back). While ``ARM_FILE``
exists, the first ``PUT /v1/worker/jobs/.../artifacts/...`` has one byte of its body flipped
(byte ``CORRUPT_AT`` of the payload, or its last one if shorter; chunked bodies are parsed so
the flip lands in chunk data, never in the framing), and the file is removed: one corruption per
arming. Each request is logged to ``LOG`` as a JSON line: method, path, whether it was
corrupted, the answer's status and the first bytes of its body.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

CORRUPT_AT = 700
"""Past the first 512-byte tar header: a flipped byte lands in a member's data."""
_lock = threading.Lock()


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _with_close(head: bytes) -> bytes:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [line for line in lines if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"


def _flip_offset(head: bytes, body: bytes) -> int | None:
    """Where to flip in the body (of which ``body`` has arrived), or None until that is known:
    byte CORRUPT_AT of the payload, or its last byte if shorter."""
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
            return min(CORRUPT_AT, length - 1) if length > 0 else -1
    line_end = body.find(b"\r\n")  # chunked: land in the first chunk's data
    if line_end < 0:
        return None
    size = int(body[:line_end].split(b";")[0], 16)
    return line_end + 2 + min(CORRUPT_AT, size - 1) if size > 0 else -1


def _forward(client: socket.socket, server: socket.socket, arm: str, record: dict) -> None:
    head, body = _read_head(client)
    if not head:
        return
    method, path = (head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""])[:2]
    record.update(method=method, path=path, corrupted=False)
    with _lock:
        target = method == "PUT" and "/artifacts/" in path and path.startswith("/v1/worker/") and os.path.exists(arm)
        if target:
            os.remove(arm)
    server.sendall(_with_close(head))
    while target:
        at = _flip_offset(head, body)
        if at is not None and at < 0:
            break  # an empty body: nothing to flip
        if at is not None and len(body) > at:
            body = body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1:]
            record["corrupted"] = True
            break
        more = client.recv(65536)
        if not more:
            break
        body += more
    if body:
        server.sendall(body)
    while chunk := client.recv(65536):
        server.sendall(chunk)


def _backward(server: socket.socket, client: socket.socket, record: dict) -> None:
    first = b""
    while chunk := server.recv(65536):
        if len(first) < 4096:
            first += chunk
        client.sendall(chunk)
    head, _, body = first.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ")
    record["status"] = int(status[1]) if len(status) > 1 and status[1].isdigit() else None
    record["body"] = body[:400].decode("utf-8", errors="replace")
    try:
        client.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _serve(client: socket.socket, target: tuple[str, int], log: str, arm: str) -> None:
    record: dict = {}
    try:
        with client, socket.create_connection(target) as server:
            back = threading.Thread(target=_backward, args=(server, client, record), daemon=True)
            back.start()
            try:
                _forward(client, server, arm, record)
                server.shutdown(socket.SHUT_WR)
            except OSError as exc:  # the API answered and closed before the whole body was sent
                record["forward_error"] = str(exc)
            back.join(timeout=120)
    except OSError as exc:
        record["error"] = str(exc)
    if record.get("method"):
        with _lock, open(log, "a") as out:
            out.write(json.dumps(record) + "\n")


def main(listen: str, target: str, log: str, arm: str) -> None:
    host, port = listen.rsplit(":", 1)
    to_host, to_port = target.rsplit(":", 1)
    listener = socket.create_server((host, int(port)), backlog=64)
    print(f"proxy listening on {listen} -> {target}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, (to_host, int(to_port)), log, arm), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:5])
