"""Real ``skyring serve`` processes: start on port 0, wait for the ready line, stop, read the log."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import NamedTuple

READY_PREFIX = "skyring ready "


class SkyringProcess:
    """One node process. Its stderr is collected in ``log`` (printed by tests on failure)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, node_id: str, log: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.node_id = node_id
        self.log = log
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls, *args: str, data_dir: Path | None = None, env: dict[str, str] | None = None, timeout_s: float = 20.0
    ) -> SkyringProcess:
        argv = ["serve", "--port", "0", "--log-level", "debug", *args]
        argv += ["--data-dir", str(data_dir)] if data_dir is not None else ["--storage", "memory"]
        return await start_command(*argv, env=env, timeout_s=timeout_s)

    async def _read_rest(self) -> None:
        assert self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            self.log.append(raw.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.log)

    async def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Send ``sig`` and wait for exit; kills after ``timeout_s``. Returns the exit code."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            async with asyncio.timeout(timeout_s):
                code = await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        if self._reader is not None:
            await self._reader
        return code

    async def kill(self) -> int:
        return await self.stop(signal.SIGKILL)


class Exited(NamedTuple):
    code: int
    stdout: str
    stderr: str


async def run_skyring(*args: str, env: dict[str, str] | None = None, timeout_s: float = 20.0) -> Exited:
    """Run ``python -m skyring *args`` (nothing added) until it exits; for runs expected to stop by themselves.

    Kills the process and raises ``TimeoutError`` if it is still running after ``timeout_s``.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "skyring",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Exited(proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))


async def start_command(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 20.0, cwd: Path | None = None
) -> SkyringProcess:
    """Run ``python -m skyring *args`` exactly, adding no flags, and wait for its ready line.

    For tests of configuration that the defaults of ``SkyringProcess.start`` (``--port 0``, ...) would override.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [sys.executable, "-m", "skyring", *args]
    proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE, env=full_env, cwd=cwd)
    assert proc.stderr is not None
    log: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await proc.stderr.readline()
                if not raw:
                    raise RuntimeError("skyring exited before it was ready:\n" + "".join(log))
                line = raw.decode(errors="replace")
                log.append(line)
                if line.startswith(READY_PREFIX):
                    fields = dict(item.split("=", 1) for item in line.split()[2:])
                    break
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    node = SkyringProcess(proc, fields["url"], fields["node"], log)
    node._reader = asyncio.create_task(node._read_rest())
    return node


async def wait_for_log(node: SkyringProcess, text: str, timeout_s: float = 10.0) -> str:
    """Wait until a line containing ``text`` appears in ``node``'s log; returns that line. Raises TimeoutError."""
    async with asyncio.timeout(timeout_s):
        while True:
            for line in node.log:
                if text in line:
                    return line
            await asyncio.sleep(0.01)
