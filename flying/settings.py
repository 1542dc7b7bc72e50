"""Environment variables (all prefixed FLYING_) in one place."""

from __future__ import annotations

import os

REDIS_URL = "FLYING_REDIS_URL"
REDIS_SENTINEL = "FLYING_REDIS_SENTINEL"  # host:port,host:port of Redis Sentinels (see flying.redis_conn)
REDIS_MASTER_NAME = "FLYING_REDIS_MASTER_NAME"
KEY_PREFIX = "FLYING_KEY_PREFIX"
ENGINE_INDEX = "FLYING_ENGINE_INDEX"
ENGINE_URL = "FLYING_ENGINE_URL"
NUM_ENGINES = "FLYING_NUM_ENGINES"
SERVED_MODEL = "FLYING_SERVED_MODEL"
DEVICE = "FLYING_DEVICE"
LAUNCH_ID = "FLYING_LAUNCH_ID"
COMM_HOST = "FLYING_COMM_HOST"  # the communicator pool's rendezvous store (hosted by the node's first engine)
COMM_PORT = "FLYING_COMM_PORT"
NODE = "FLYING_NODE"  # the node an engine announces (flying-worker --node)
FIRST_ENGINE = "FLYING_FIRST_ENGINE"  # the first engine of the node's communicator pool (--first-engine)
LOG_FORMAT = "FLYING_LOG_FORMAT"  # set by flying-worker for the SGLang server's processes (the plugin)
# tests only: a batch holding a request whose stop strings hold this value crashes the scheduler (a poison request)
TEST_CRASH_STOP = "FLYING_TEST_CRASH_STOP"
SP_THRESHOLD = "FLYING_SP_THRESHOLD"  # a bound group's SP steps: batched tokens from which a step runs in SP

API_KEYS = "FLYING_API_KEYS"  # the gateway's API keys, comma-separated (see gateway.auth)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SP_THRESHOLD = 512  # batched tokens (docs/benchmarks.md, "Sequence-parallel prefill", says why)


def sp_threshold() -> int:
    return int(os.environ.get(SP_THRESHOLD, DEFAULT_SP_THRESHOLD))


def redis_url() -> str:
    return os.environ.get(REDIS_URL, DEFAULT_REDIS_URL)


def redis_sentinel() -> str:
    return os.environ.get(REDIS_SENTINEL, "")


def redis_master_name() -> str:
    return os.environ.get(REDIS_MASTER_NAME, "mymaster")


def key_prefix() -> str:
    return os.environ.get(KEY_PREFIX, "flying")


def api_keys() -> str:
    return os.environ.get(API_KEYS, "")
