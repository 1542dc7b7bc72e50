"""flyctl and flying.control against a real Redis: commands land on each member's stream, status reads beats."""

from flying import control
from flying.flyctl import main
from flying.messages import Bind, Heartbeat, Release, decode_command, encode


def test_bind_and_release_write_every_members_stream(sync_redis, keys, redis_server, capsys):
    args = ["--redis-url", redis_server.url, "--key-prefix", keys.prefix]
    assert main([*args, "bind", "1", "0"]) == 0
    epoch = int(capsys.readouterr().out)
    assert main([*args, "bind", "2", "3"]) == 0
    assert int(capsys.readouterr().out) == epoch + 1  # epochs are unique and increasing
    for e in (0, 1):
        ((_, fields),) = sync_redis.xrange(keys.commands(e))
        assert decode_command(fields[b"msg"]) == Bind(epoch=epoch, members=(0, 1))
    assert main([*args, "release", str(epoch), "0", "1"]) == 0
    assert decode_command(sync_redis.xrange(keys.commands(0))[-1][1][b"msg"]) == Release(epoch=epoch)
    assert main([*args, "bind", "1"]) == 2  # a group of one is refused


def test_status_lists_live_engines_only(sync_redis, keys, redis_server, capsys):
    hb = Heartbeat(
        engine=0, url="u", pid=1, model="m", launch_id="L", mode="tp", epoch=4, group=(0, 1), width=2
    )
    sync_redis.set(keys.worker(0), encode(hb))
    sync_redis.set(keys.ready(0), "L")
    sync_redis.set(keys.worker(1), encode(Heartbeat(engine=1, url="u", pid=2, model="m", launch_id="X")))
    sync_redis.set(keys.ready(1), "Y")  # restarted server, stale heartbeat: not live
    sync_redis.sadd(keys.workers, 0, 1)
    assert list(control.status(sync_redis, keys)) == [0]
    assert main(["--redis-url", redis_server.url, "--key-prefix", keys.prefix, "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].split()[:4] == ["0", "tp", "4", "0,1"]
