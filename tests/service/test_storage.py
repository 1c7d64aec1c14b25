"""Storage: the sqlite backend's durability and group commit, and the node's behaviour when writes fail."""

from __future__ import annotations

import asyncio

import pytest

from skyring.codec import parse_timer_request
from skyring.errors import StorageError, TimerNotFound
from skyring.node import Node
from skyring.storage.memory import MemoryStorage
from skyring.storage.sqlite import SqliteStorage
from skyring.timers import Timer
from skyring.transports import Transports
from tests.fakes import FakeClock
from tests.support import node_settings


def timer(timer_id: str, due_ms: int = 1_000) -> Timer:
    return Timer(due_ms, timer_id, due_ms, 500, 0, b'[null,{"transport":"http"}]')


async def test_sqlite_keeps_changes_across_reopen(tmp_path):
    """What was put and not deleted is loaded again after close and reopen, unchanged."""
    storage = await SqliteStorage.open(str(tmp_path))
    await asyncio.gather(*(storage.put(timer(f"t{i}", 1000 + i)) for i in range(10)))
    await storage.delete("t3")
    await storage.put(timer("t5")._replace(attempts=2))
    await storage.close()

    reopened = await SqliteStorage.open(str(tmp_path))
    loaded = {t.id: t for t in await reopened.load()}
    await reopened.close()

    assert sorted(loaded) == sorted(f"t{i}" for i in range(10) if i != 3)
    assert loaded["t5"].attempts == 2
    assert loaded["t7"] == timer("t7", 1007)


async def test_sqlite_groups_concurrent_writes_into_few_commits(tmp_path):
    """A thousand concurrent puts are made durable in far fewer transactions."""
    storage = await SqliteStorage.open(str(tmp_path))

    await asyncio.gather(*(storage.put(timer(f"t{i}")) for i in range(1000)))
    commits = storage.status()["commits"]
    await storage.close()

    assert commits < 50


async def test_sqlite_applies_changes_in_call_order(tmp_path):
    """A put then a delete of the same id, issued without waiting, leaves nothing behind."""
    storage = await SqliteStorage.open(str(tmp_path))

    await asyncio.gather(storage.put(timer("a")), storage.delete("a"), storage.put(timer("b")))
    loaded = await storage.load()
    await storage.close()

    assert [t.id for t in loaded] == ["b"]


async def test_sqlite_refuses_a_data_dir_in_use(tmp_path):
    """A second node on the same data directory is refused with a clear error."""
    first = await SqliteStorage.open(str(tmp_path))

    with pytest.raises(StorageError, match="in use"):
        await SqliteStorage.open(str(tmp_path))
    await first.close()


async def test_sqlite_reports_an_unusable_directory(tmp_path):
    """A data directory that cannot be created is a StorageError, not a crash."""
    blocker = tmp_path / "file"
    blocker.write_text("")

    with pytest.raises(StorageError, match="cannot use data directory"):
        await SqliteStorage.open(str(blocker / "sub"))


class FailingStorage(MemoryStorage):
    """Memory storage whose writes fail while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def _write(self) -> asyncio.Future[None]:
        if not self.failing:
            return self._done
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_exception(StorageError("disk on fire"))
        return future

    def put(self, timer: Timer) -> asyncio.Future[None]:
        return self._write()

    def delete(self, timer_id: str) -> asyncio.Future[None]:
        return self._write()


class NoTransport:
    def normalize(self, callback):
        return dict(callback)


@pytest.fixture
async def failing_node():
    storage = FailingStorage()
    clock = FakeClock()
    node = Node(node_settings(), storage=storage, transports=Transports({}), clock=clock)
    await node.start()
    yield node, storage, clock
    await node.close()


def request(timeout_ms: int):
    transports = Transports({"x": NoTransport()})
    return parse_timer_request(
        b'{"timeout": %d, "callback": {"transport": "x"}}' % timeout_ms,
        max_timeout_ms=10**9,
        normalize_callback=transports.normalize,
    )


async def test_create_that_cannot_be_stored_leaves_no_timer(failing_node):
    """If the write fails the create fails, and no timer exists under that id."""
    node, storage, _ = failing_node
    storage.failing = True

    with pytest.raises(StorageError):
        await node.create(request(1000), "a")

    with pytest.raises(TimerNotFound):
        node.view("a")


async def test_cancel_that_cannot_be_stored_keeps_the_timer(failing_node):
    """If the delete cannot be made durable the cancel fails and the timer stays scheduled."""
    node, storage, _ = failing_node
    await node.create(request(1000), "a")
    storage.failing = True

    with pytest.raises(StorageError):
        await node.cancel("a")

    assert b'"state":"pending"' in node.view("a")


async def test_replace_that_cannot_be_stored_keeps_the_old_timer(failing_node):
    """If the replacement cannot be stored the old timer stays, with its old timeout."""
    node, storage, _ = failing_node
    await node.create(request(1000), "a")
    storage.failing = True

    with pytest.raises(StorageError):
        await node.replace("a", request(5000))

    assert b'"timeout_ms":1000' in node.view("a")


async def test_a_cancelled_writer_does_not_fail_the_others_in_its_commit(tmp_path):
    """One caller giving up on a group commit neither fails the others nor stalls later writes."""
    storage = await SqliteStorage.open(str(tmp_path))
    await storage.put(timer("warm-up"))
    first = asyncio.ensure_future(storage.put(timer("a")))
    blocked = asyncio.ensure_future(storage.put(timer("b")))  # queued behind the first commit
    other = asyncio.ensure_future(storage.put(timer("c")))  # shares the second commit with b

    blocked.cancel()
    await first
    await asyncio.wait_for(other, 5)
    await asyncio.wait_for(storage.put(timer("d")), 5)
    loaded = sorted(t.id for t in await storage.load())
    await storage.close()

    assert loaded == ["a", "b", "c", "d", "warm-up"]
