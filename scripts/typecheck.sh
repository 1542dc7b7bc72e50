#!/usr/bin/env bash
# The type check CI runs: strict on the shared core, the policy and the command intake; mypy's defaults elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
MYPY=${MYPY:-.venv/bin/mypy}
"$MYPY" --strict flying router/policy.py router/prefix_index.py router/transform_cost.py router/decision.py router/engine_view.py \
  router/snapshot.py router/round.py router/regime.py router/releases.py router/placement.py router/dp_dispatch.py \
  router/config.py worker_ext/intake.py
"$MYPY" gateway router loadgen flyctl worker_ext sim devstack
