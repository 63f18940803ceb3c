"""``python -m bench.grpc_floor``: what grpcio's Python server costs per call by itself.

A server that answers every call with its request (no Sluice, no model, no Redis) runs in a
process of its own, with grpcio's asyncio server (on uvloop, as the gateway; unary, or
client-streaming read with ``context.read()`` as the gateway serves ModelInfer) or its
thread-pool server (answering on the pool's thread, or handing each call to an event
loop as a gateway built on it would have to), or grpclib's (HTTP/2 in Python, on the
event loop); a raw client (pre-encoded 100-byte messages,
N coroutines on one channel) drives it closed loop from another process. Reported: calls/s
and the server's CPU per call, the floor under any Python gRPC front end on this machine,
to set beside the gateway's CPU per request in ``bench.grpc_bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from concurrent import futures

import grpc

from bench.stack import free_port

_METHOD = "/floor.Echo/Echo"
KINDS = {
    "aio": "grpc.aio (uvloop), unary-unary",
    "aio-read": "grpc.aio (uvloop), stream-unary read with context.read()",
    "threads": "grpc.server (16 threads)",
    "threads-loop": "grpc.server (16 threads), each call handed to an event loop",
    "grpclib": "grpclib (pure-Python HTTP/2 on the event loop, uvloop), unary-unary",
}


def _handlers(echo: object, streaming: bool = False) -> grpc.GenericRpcHandler:
    make = (
        grpc.stream_unary_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    )
    return grpc.method_handlers_generic_handler("floor.Echo", {"Echo": make(echo)})


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(kind: str, port: int) -> None:
    """Serve until stdin closes; then print the CPU seconds used, as JSON."""
    if kind in ("aio", "aio-read"):
        import uvloop

        async def echo(request: bytes, context: object) -> bytes:
            return request

        async def read_echo(
            requests: object, context: grpc.aio.ServicerContext[bytes, bytes]
        ) -> bytes:
            # As the gateway serves ModelInfer: client-streaming, the message and the end of
            # the client's side read with context.read().
            message = await context.read()
            await context.read()
            assert isinstance(message, bytes)
            return message

        async def main() -> None:
            server = grpc.aio.server()
            streaming = kind == "aio-read"
            server.add_generic_rpc_handlers(
                (_handlers(read_echo if streaming else echo, streaming),)
            )
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            print(json.dumps({"cpu_s": _cpu_s()}), flush=True)

        uvloop.run(main())
        return
    if kind == "threads-loop":
        _serve_threads_into_loop(port)
        return
    if kind == "grpclib":
        _serve_grpclib(port)
        return
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((_handlers(lambda request, context: request),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    print(json.dumps({"cpu_s": _cpu_s()}), flush=True)


def _serve_threads_into_loop(port: int) -> None:
    """grpcio's thread-pool server whose handler hands each call to an event loop (uvloop,
    the main thread) and waits for its answer: what serving the gateway's asyncio data
    plane from that server would cost at least."""
    import uvloop

    async def echo(request: bytes) -> bytes:
        return request

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def handler(request: bytes, context: object) -> bytes:
            return asyncio.run_coroutine_threadsafe(echo(request), loop).result()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        server.add_generic_rpc_handlers((_handlers(handler),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        print(json.dumps({"cpu_s": _cpu_s()}), flush=True)
        server.stop(None)

    uvloop.run(main())


def _serve_grpclib(port: int) -> None:
    """grpclib's server: HTTP/2 framing in Python (h2) on the event loop itself, so a call
    never crosses threads (grpcio's hand each event from its threads to the loop)."""
    import uvloop
    from grpclib.const import Cardinality, Handler
    from grpclib.encoding.base import CodecBase
    from grpclib.server import Server, Stream

    class Raw(CodecBase):
        __content_subtype__ = "proto"

        def encode(self, message: object, message_type: object) -> bytes:
            assert isinstance(message, bytes)
            return message

        def decode(self, data: bytes, message_type: object) -> bytes:
            return data

    class Echo:
        def __mapping__(self) -> dict[str, Handler]:
            return {_METHOD: Handler(self.echo, Cardinality.UNARY_UNARY, bytes, bytes)}

        async def echo(self, stream: Stream[bytes, bytes]) -> None:
            request = await stream.recv_message()
            assert request is not None
            await stream.send_message(request)

    async def main() -> None:
        server = Server([Echo()], codec=Raw())
        await server.start("127.0.0.1", port)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print(json.dumps({"cpu_s": _cpu_s()}), flush=True)
        server.close()

    uvloop.run(main())


async def _drive(port: int, concurrency: int, seconds: float) -> int:
    message = b"x" * 100
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(_METHOD)
        await call(message)
        done = 0
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                await call(message)
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def measure(kind: str, concurrency: int, seconds: float) -> dict[str, float | int | str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "--serve", kind, "--port", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server did not start")
        warm = asyncio.run(_drive(port, concurrency, 1.0))
        calls = asyncio.run(_drive(port, concurrency, seconds))
        server.stdin.close()
        cpu_s = float(json.loads(server.stdout.readline())["cpu_s"])
    finally:
        server.kill()
        server.wait()
    return {
        "server": kind,
        "concurrency": concurrency,
        "calls_per_s": round(calls / seconds, 1),
        "server_cpu_us_per_call": round(cpu_s / (warm + calls) * 1e6),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--servers",
        type=lambda text: [part for part in text.split(",") if part],
        default=list(KINDS),
        help=f"which servers, of {', '.join(KINDS)}",
    )
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return 0
    print(f"grpcio {grpc.__version__}, {os.cpu_count()} CPUs", file=sys.stderr)
    print("| server | concurrency | calls/s | server CPU µs/call |")
    print("| --- | ---: | ---: | ---: |")
    for kind in args.servers:
        row = measure(kind, args.concurrency, args.seconds)
        label = KINDS[kind]
        print(
            f"| {label} | {row['concurrency']} | {row['calls_per_s']:,.0f} "
            f"| {row['server_cpu_us_per_call']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
