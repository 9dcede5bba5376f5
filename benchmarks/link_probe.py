"""One side of a chunked transfer across a link: `recv` accepts one connection and
acknowledges every chunk once it has all of it; `send` sends `chunks` chunks of
`chunk_bytes`, waiting for each acknowledgement and then `gap_s` idle, and prints the rate
it achieved over the chunks' own transfer times (idle gaps excluded) as JSON. Run by
`benchmarks.netns.chunked_rate` inside the link's two namespaces.

    python -m benchmarks.link_probe recv <address> <port> <chunk_bytes> <chunks>
    python -m benchmarks.link_probe send <address> <port> <chunk_bytes> <chunks> <gap_s>
"""

from __future__ import annotations

import json
import socket
import sys
import time

WARMUP = 2  # chunks not counted: TCP's window opens over the first ones
CONNECT_TRIES = 100  # 0.1 s apart: the receiver may still be starting


def receive(address: str, port: int, chunk_bytes: int, chunks: int) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(1)
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            for _ in range(chunks):
                got = 0
                while got < chunk_bytes:
                    data = conn.recv(1 << 20)
                    if not data:
                        raise SystemExit("link_probe: the sender closed the connection early")
                    got += len(data)
                conn.sendall(b"k")


def send(address: str, port: int, chunk_bytes: int, chunks: int, gap_s: float) -> float:
    for _ in range(CONNECT_TRIES):
        try:
            conn = socket.create_connection((address, port), timeout=60)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"link_probe: no receiver at {address}:{port}")
    payload = b"x" * chunk_bytes
    times = []
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(chunks):
            start = time.perf_counter()
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise SystemExit("link_probe: no acknowledgement from the receiver")
            times.append(time.perf_counter() - start)
            time.sleep(gap_s)
    counted = times[WARMUP:]
    return 8 * chunk_bytes * len(counted) / sum(counted)


if __name__ == "__main__":
    role, address, port, chunk, n = sys.argv[1:6]
    if role == "recv":
        receive(address, int(port), int(chunk), int(n))
    else:
        rate = send(address, int(port), int(chunk), int(n), float(sys.argv[6]))
        print(json.dumps({"bits_per_s": rate}))
