#!/usr/bin/env bash
# Start PostgreSQL and Redis for the test suite when they are not already running, and wait
# until both answer; then a real Slurm (scripts/slurm.sh: munge, slurmctld, two slurmd nodes on
# 127.0.0.1), installed with apt-get when missing. Used by `make test` (and so by .ci/run).
set -euo pipefail

PG_HOST=127.0.0.1
PG_PORT=5432
REDIS_HOST=127.0.0.1
REDIS_PORT=6379

wait_for() {  # wait_for NAME COMMAND...: up to 60 s
  local name=$1; shift
  for _ in $(seq 1 120); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "services.sh: $name did not come up within 60 s" >&2
  return 1
}

if ! pg_isready -h "$PG_HOST" -p "$PG_PORT" -q; then
  if ! command -v pg_ctlcluster >/dev/null || [ ! -d /etc/postgresql ]; then
    echo "services.sh: PostgreSQL is not running on $PG_HOST:$PG_PORT and no Debian cluster is installed;" \
         "install postgresql (apt-get install postgresql) or start it yourself" >&2
    exit 1
  fi
  echo "services.sh: starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start
fi
wait_for PostgreSQL pg_isready -h "$PG_HOST" -p "$PG_PORT" -q

if ! redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping >/dev/null 2>&1; then
  if ! command -v redis-server >/dev/null; then
    echo "services.sh: Redis is not running on $REDIS_HOST:$REDIS_PORT and redis-server is not installed;" \
         "install it (apt-get install redis-server) or start it yourself" >&2
    exit 1
  fi
  echo "services.sh: starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
wait_for Redis redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping
echo "services.sh: PostgreSQL and Redis are up"

# Slurm for tests/integration/e2e/test_slurm_e2e.py (its fixture starts it too when absent, and
# stops what it started). A machine where it cannot be installed still runs the rest of the
# suite: those tests skip there, and fail under CI.
if ! "$(dirname "$0")/slurm.sh" start; then
  echo "services.sh: Slurm could not be installed or started; the Slurm tests will skip (and fail under CI)" >&2
fi
