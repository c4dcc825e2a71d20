"""--kv-events-config: vLLM's JSON fields and defaults, and errors that name what was wrong."""
import argparse
import json
import re

import pytest

from gateway.config import GatewayConfig
from worker.config import KVEventsConfig, parse_kv_events_config
from worker.config_flags import add_flags


def parsed(*flags: str) -> GatewayConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, GatewayConfig)
    return GatewayConfig.from_args(parser.parse_args(["--model", "/m", *flags]))


def test_defaults_are_vllms_and_off():
    config = parsed().worker.kv_events
    assert config == KVEventsConfig(enable_kv_cache_events=False, publisher=None, endpoint="tcp://*:5557",
                                    replay_endpoint=None, buffer_steps=10_000, hwm=100_000, max_queue_size=100_000,
                                    topic="")
    assert not config.publishes


@pytest.mark.parametrize("fields, publishes", [({"enable_kv_cache_events": True}, True),
                                               ({"enable_kv_cache_events": True, "publisher": "zmq"}, True),
                                               ({"enable_kv_cache_events": True, "publisher": "null"}, False),
                                               ({"publisher": "zmq"}, False)])
def test_events_go_out_when_enabled_and_not_sent_to_the_null_publisher(fields, publishes):
    assert parsed("--kv-events-config", json.dumps(fields)).worker.kv_events.publishes is publishes


def test_every_field_is_read():
    fields = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://epp:5557",
              "replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9,
              "topic": "kv@10.0.0.1:8000@base"}
    assert parsed("--kv-events-config", json.dumps(fields)).worker.kv_events == KVEventsConfig(**fields)


@pytest.mark.parametrize("text, message", [
    ("{not json", "Invalid JSON for --kv-events-config"),
    ('["zmq"]', "--kv-events-config takes a JSON object of fields"),
    ('{"enable_kv_cache_events": true, "port": 5557}', "Unknown --kv-events-config field(s) port; the fields are "
                                                       "enable_kv_cache_events, publisher, endpoint"),
    ('{"enable_kv_cache_events": "yes"}', "field enable_kv_cache_events takes a bool, got 'yes'"),
    ('{"buffer_steps": true}', "field buffer_steps takes a int, got True"),
    ('{"replay_endpoint": 5558}', "field replay_endpoint takes a str | None, got 5558"),
    ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null', got 'kafka'"),
    ('{"hwm": -1}', "buffer_steps, hwm and max_queue_size must be >= 0"),
])
def test_bad_configs_are_refused_with_what_was_wrong(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse_kv_events_config(text)
