"""Settings from the environment and flags: precedence, conversion, and errors that name the culprit."""

from __future__ import annotations

import pytest

from skyring.cli import build_parser, settings_from_args
from skyring.settings import Settings


def from_cli(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_are_a_durable_local_node():
    """With nothing set, a node listens on 127.0.0.1:8080 with sqlite storage."""
    settings = Settings()

    assert (settings.host, settings.port, settings.storage) == ("127.0.0.1", 8080, "sqlite")
    assert settings.max_timeout_ms >= 2**31 - 1


def test_environment_sets_every_field_and_flags_win():
    """SKYRING_<NAME> sets a field; the matching flag overrides it."""
    env = {"SKYRING_PORT": "9000", "SKYRING_NODE_ID": "from-env", "SKYRING_DELIVERY_TIMEOUT_S": "2.5"}

    settings = from_cli(["--node-id", "from-flag"], env)

    assert settings.port == 9000
    assert settings.node_id == "from-flag"
    assert settings.delivery_timeout_s == 2.5


def test_choices_are_case_insensitive():
    """--storage MEMORY and SKYRING_LOG_LEVEL=DEBUG are accepted."""
    settings = from_cli(["--storage", "MEMORY"], {"SKYRING_LOG_LEVEL": "DEBUG"})

    assert (settings.storage, settings.log_level) == ("memory", "debug")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SKYRING_PORT": "eighty"}, "SKYRING_PORT"),
        ({"SKYRING_PORT": "70000"}, "SKYRING_PORT"),
        ({"SKYRING_STORAGE": "redis"}, "SKYRING_STORAGE"),
        ({"SKYRING_DELIVERY_MAX_ATTEMPTS": "0"}, "SKYRING_DELIVERY_MAX_ATTEMPTS"),
        ({"SKYRING_DELIVERY_TIMEOUT_S": "-1"}, "SKYRING_DELIVERY_TIMEOUT_S"),
    ],
)
def test_bad_environment_value_names_the_variable(env, named):
    """A malformed or out-of-range variable is refused with its name in the message."""
    with pytest.raises(ValueError, match=named):
        Settings.from_env(env)


def test_bad_flag_value_names_the_flag():
    """A malformed flag value is refused with the flag in the message."""
    with pytest.raises(ValueError, match="--max-timeout-ms"):
        from_cli(["--max-timeout-ms", "soon"])


def test_flag_shadows_a_bad_environment_value():
    """A flag replaces its variable entirely, so a malformed variable it overrides does no harm."""
    settings = from_cli(["--port", "0"], {"SKYRING_PORT": "eighty"})

    assert settings.port == 0


def test_boolean_settings_accept_a_bare_flag_and_words():
    """--local-ids alone means true; variables take true/false/yes/no/1/0; anything else is refused."""
    assert from_cli(["--local-ids"]).local_ids is True
    assert from_cli(["--local-ids", "false"]).local_ids is False
    assert from_cli([], {"SKYRING_LOCAL_IDS": "YES"}).local_ids is True
    assert from_cli([]).local_ids is False
    with pytest.raises(ValueError, match="SKYRING_LOCAL_IDS"):
        from_cli([], {"SKYRING_LOCAL_IDS": "maybe"})


def test_failure_timeout_must_outlast_two_heartbeats():
    """One late heartbeat must not drop a node, so failure_timeout_s > 2 * heartbeat_s."""
    with pytest.raises(ValueError, match="failure_timeout_s"):
        Settings(heartbeat_s=1.0, failure_timeout_s=2.0)


def test_default_data_dir_is_one_per_node_in_a_cluster():
    """Alone a node keeps its data in skyring-data; in a cluster in skyring-data/<node-id>; --data-dir wins."""
    assert Settings(node_id="127.0.0.1:8080").data_path == "skyring-data"
    assert Settings(node_id="127.0.0.1:8080", nats="nats://n:4222").data_path == "skyring-data/127.0.0.1_8080"
    assert Settings(node_id="a", nats="nats://n:4222", data_dir="/var/lib/x").data_path == "/var/lib/x"
