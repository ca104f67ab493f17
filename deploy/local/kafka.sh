#!/usr/bin/env bash
# Thin wrapper: deploy/local/kafka.sh start|stop|status|kill-node I|start-node I|stop-node I|jars [--name N] [--nodes N] [--security plaintext|sasl_ssl]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec python3 -m deploy.local.cluster "$@"
