#!/bin/sh
# A Redis of the Sentinel set. The first pod (redis-0) starts as the primary unless the Sentinels already know
# one (a failover happened before this pod restarted); every other pod starts as a replica of the current primary.
set -eu
self="${POD_NAME}.redis-headless"
primary="$(redis-cli -h redis-sentinel -p 26379 sentinel get-master-addr-by-name "${SENTINEL_MASTER}" 2>/dev/null | head -n 1 || true)"
if [ -z "${primary}" ]; then
  if [ "${POD_NAME##*-}" = "0" ]; then primary="${self}"; else primary="redis-0.redis-headless"; fi
fi
set -- --port 6379 --appendonly yes --appendfsync everysec --dir /data \
  --replica-announce-ip "${self}" --min-replicas-to-write 0
if [ "${primary}" != "${self}" ]; then
  set -- "$@" --replicaof "${primary}" 6379
fi
exec redis-server "$@"
