"""Starting a node: busy port or data dir, configuration from flags and SKYRING_* variables, /health."""

from __future__ import annotations

import asyncio
import signal

import pytest
from yarl import URL

from skyring import __version__
from skyring.settings import FIELDS
from tests.harness import SkyringProcess, run_skyring, start_command
from tests.process.client import create_timer, health
from tests.support import timer_body

pytestmark = pytest.mark.process

STARTUP_FAILURE = 3
USAGE_ERROR = 2


# -- things in the way -------------------------------------------------------------------------


async def test_port_in_use_exits_3_with_a_clear_message(processes):
    """--port taken by another node: exit 3 and a log line naming the address, no ready line."""
    node = await SkyringProcess.start()
    processes.append(node)
    port = URL(node.url).port

    result = await run_skyring("serve", "--port", str(port), "--storage", "memory", timeout_s=10)

    assert result.code == STARTUP_FAILURE, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "skyring ready" not in result.stderr


async def test_second_node_on_a_data_dir_exits_3_until_the_first_is_gone(tmp_path, processes):
    """A second node on a data dir in use exits 3 saying so; once the holder dies (even by kill -9) it starts."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start(data_dir=data_dir)
    processes.append(node)

    result = await run_skyring("serve", "--port", "0", "--data-dir", str(data_dir), timeout_s=10)

    assert result.code == STARTUP_FAILURE, result.stderr
    assert f"data directory {data_dir} is in use by another skyring process" in result.stderr
    assert "skyring ready" not in result.stderr
    await node.kill()
    processes.append(await SkyringProcess.start(data_dir=data_dir))


async def test_unusable_data_dir_exits_3(tmp_path):
    """A data dir that cannot be created (a file is in the way) exits 3 with a message naming it."""
    in_the_way = tmp_path / "file"
    in_the_way.write_text("not a directory")

    result = await run_skyring("serve", "--port", "0", "--data-dir", str(in_the_way / "data"), timeout_s=10)

    assert result.code == STARTUP_FAILURE, result.stderr
    assert f"cannot use data directory {in_the_way / 'data'}" in result.stderr


# -- configuration -----------------------------------------------------------------------------


async def test_help_lists_a_flag_and_an_environment_variable_for_every_setting():
    """`serve --help` documents --<name> and SKYRING_<NAME> for every setting."""
    result = await run_skyring("serve", "--help", env={"COLUMNS": "200"}, timeout_s=10)

    assert result.code == 0, result.stderr
    for field in FIELDS:
        assert "--" + field.name.replace("_", "-") in result.stdout
        assert f"[SKYRING_{field.name.upper()}]" in result.stdout


async def test_environment_alone_configures_a_node(tmp_path, processes, http, sink):
    """With no flags at all, SKYRING_* variables set address, id, storage, limits and log level."""
    data_dir = tmp_path / "env-data"
    env = {
        "SKYRING_HOST": "127.0.0.1",
        "SKYRING_PORT": "0",
        "SKYRING_NODE_ID": "env-node",
        "SKYRING_STORAGE": "SQLite",
        "SKYRING_DATA_DIR": str(data_dir),
        "SKYRING_LOG_LEVEL": "WARNING",
        "SKYRING_MAX_TIMEOUT_MS": "5000",
    }
    node = await start_command("serve", env=env)
    processes.append(node)

    assert node.node_id == "env-node"
    assert URL(node.url).host == "127.0.0.1"
    report = await health(http, node)
    assert report["storage"]["backend"] == "sqlite"
    assert report["storage"]["path"] == str(data_dir / "timers.db")
    async with http.post(f"{node.url}/timer", json=timer_body(sink.hook(), timeout_ms=5001)) as response:
        assert response.status == 400
        assert (await response.json())["error"] == "invalid_timeout"
    await create_timer(http, node, timer_body(sink.hook(), timeout_ms=5000))
    assert await node.stop(signal.SIGTERM) == 0
    assert " INFO " not in node.output  # log level warning


async def test_flags_win_over_environment_variables(tmp_path, processes, http, sink):
    """A flag overrides the SKYRING_* variable of the same setting."""
    env = {"SKYRING_NODE_ID": "a", "SKYRING_MAX_TIMEOUT_MS": "1000", "SKYRING_DATA_DIR": str(tmp_path / "env")}
    node = await SkyringProcess.start(
        "--node-id", "b", "--max-timeout-ms", "60000", data_dir=tmp_path / "flag", env=env
    )
    processes.append(node)

    assert node.node_id == "b"
    assert "skyring ready node=b url=" in node.output
    report = await health(http, node)
    assert report["node"] == "b"
    assert report["storage"]["path"] == str(tmp_path / "flag" / "timers.db")
    await create_timer(http, node, timer_body(sink.hook(), timeout_ms=60000))


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        ((), {"SKYRING_PORT": "eighty"}, "SKYRING_PORT"),
        (("--port", "70000"), {}, "--port"),
        (("--port", "0"), {"SKYRING_STORAGE": "redis"}, "SKYRING_STORAGE"),
        (("--port", "0", "--storage", "memory", "--log-level", "loud"), {}, "--log-level"),
        (("--port", "0", "--storage", "memory"), {"SKYRING_DELIVERY_TIMEOUT_S": "soon"}, "SKYRING_DELIVERY_TIMEOUT_S"),
        (("--port", "0", "--storage", "memory", "--delivery-max-attempts", "0"), {}, "--delivery-max-attempts"),
        (("--port", "0", "--storage", "memory", "--shutdown-timeout-s=-1"), {}, "--shutdown-timeout-s"),
        (("--port", "0", "--storage", "memory"), {"SKYRING_MAX_BODY_BYTES": "10"}, "SKYRING_MAX_BODY_BYTES"),
    ],
    ids=["env-port", "flag-port", "env-storage", "flag-log-level", "env-float", "flag-min", "flag-negative", "env-min"],
)
async def test_bad_value_exits_2_naming_the_variable_or_flag(tmp_path, args, env, named):
    """A malformed or out-of-range setting exits 2 before serving, with a message naming where it came from."""
    result = await run_skyring("serve", *args, "--data-dir", str(tmp_path / "data"), env=env, timeout_s=10)

    assert result.code == USAGE_ERROR, result.stderr
    assert "skyring: error:" in result.stderr
    assert named in result.stderr
    assert "skyring ready" not in result.stderr
    assert not (tmp_path / "data").exists()


async def test_lowering_concurrency_alone_is_accepted(processes):
    """--delivery-concurrency below the default per-host cap starts a node (the cap follows it)."""
    node = await SkyringProcess.start("--delivery-concurrency", "16", timeout_s=10)
    processes.append(node)


# -- health --------------------------------------------------------------------------------------


async def test_health_reports_node_version_pending_timers_and_storage(tmp_path, processes, http, sink):
    """GET /health reports the node id, version, pending timers, storage status; recovered timers after a restart."""
    data_dir = tmp_path / "data"
    node = await SkyringProcess.start("--node-id", "healthy", data_dir=data_dir)
    processes.append(node)
    await asyncio.gather(*(create_timer(http, node, timer_body(sink.hook(), timeout_ms=60_000)) for _ in range(3)))

    report = await health(http, node)

    assert report["status"] == "ok"
    assert report["node"] == "healthy"
    assert report["version"] == __version__
    assert report["timers"] == {"pending": 3, "delivering": 0, "moving": 0, "in_flight": 0}
    storage = report["storage"]
    assert storage["backend"] == "sqlite"
    assert storage["durable"] is True
    assert storage["status"] == "ok"
    assert storage["last_error"] is None
    assert storage["path"] == str(data_dir / "timers.db")
    assert "http" in report["transports"]
    assert report["counters"]["created"] == 3

    assert await node.stop(signal.SIGTERM) == 0
    node = await SkyringProcess.start("--node-id", "healthy", data_dir=data_dir)
    processes.append(node)
    report = await health(http, node)
    assert report["timers"]["pending"] == 3
    assert report["counters"]["recovered"] == 3
    assert report["counters"]["created"] == 0


async def test_health_of_a_memory_node_says_it_is_not_durable(processes, http):
    """GET /health on a memory-storage node reports a non-durable store and a <host>:<port> node id by default."""
    node = await SkyringProcess.start()
    processes.append(node)

    report = await health(http, node)

    assert report["node"] == f"127.0.0.1:{URL(node.url).port}"
    assert report["storage"] == {"backend": "memory", "durable": False, "status": "ok"}
    assert report["timers"]["pending"] == 0
