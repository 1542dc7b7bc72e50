#!/bin/sh
# A Sentinel beside each Redis pod: it watches the primary named SENTINEL_MASTER and, with a quorum of 2 of the 3,
# promotes a replica when the primary is down for 1 s. Its config file must be writable (Sentinel rewrites it).
set -eu
until redis-cli -h localhost -p 6379 ping >/dev/null 2>&1; do sleep 0.5; done
primary="$(redis-cli -h redis-sentinel -p 26379 sentinel get-master-addr-by-name "${SENTINEL_MASTER}" 2>/dev/null | head -n 1 || true)"
[ -n "${primary}" ] || primary="redis-0.redis-headless"
cat > /sentinel/sentinel.conf <<CONF
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip ${POD_NAME}.redis-headless
sentinel monitor ${SENTINEL_MASTER} ${primary} 6379 2
sentinel down-after-milliseconds ${SENTINEL_MASTER} 1000
sentinel failover-timeout ${SENTINEL_MASTER} 3000
sentinel parallel-syncs ${SENTINEL_MASTER} 1
CONF
exec redis-sentinel /sentinel/sentinel.conf
