"""Bind/release commands: read from the engine's Redis stream (``flying:cmd:{i}``, inspectable with
``redis-cli xrange``) on a background thread and handed to the scheduler at its next step boundary.

An idle scheduler sleeps in a zmq poll for up to a second; the reader wakes it through an extra inproc socket
registered with that poll, so a command reaches an idle engine at once (no request needed to carry it).
"""

from __future__ import annotations

import logging
import queue
import threading

import msgspec
import redis
import zmq

from flying import redis_conn
from flying.keys import Keys
from flying.messages import Command, decode_command

log = logging.getLogger("flying.commands")


class CommandReader:
    def __init__(self, redis_url: str, keys: Keys, engine: int) -> None:
        self.stream = keys.commands(engine)
        self._redis = redis_conn.sync_client(redis_url, socket_timeout=5)
        self._queue: queue.Queue[Command] = queue.Queue()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        addr = f"inproc://flying-wake-{engine}-{id(self)}"
        self.wake_socket = ctx.socket(zmq.PULL)  # registered with the scheduler's idle poller
        self.wake_socket.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.connect(addr)
        self._last: bytes | str = (
            self._redis.xinfo_stream(self.stream)["last-generated-id"]
            if self._redis.exists(self.stream)
            else "0-0"
        )
        self._thread = threading.Thread(target=self._run, name="flying-commands", daemon=True)

    def start(self) -> CommandReader:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                got = self._redis.xread({self.stream: self._last}, block=1000, count=16)
            except redis.RedisError as exc:
                log.warning("command stream read failed: %s", exc)
                threading.Event().wait(0.5)
                continue
            # redis-py's legacy reply shape: [[stream, [(id, fields), ...]], ...]
            assert not isinstance(got, dict)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    self._last = entry_id
                    try:
                        self._queue.put(decode_command(fields[b"msg"]))
                    except (KeyError, msgspec.DecodeError) as exc:
                        log.error("ignoring malformed command %s: %s", entry_id, exc)
                        continue
                    self._push.send(b"", zmq.NOBLOCK)

    def drain(self) -> list[Command]:
        """Commands that arrived since the last call (scheduler thread)."""
        while True:
            try:
                self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out
