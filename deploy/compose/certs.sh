#!/bin/sh
# The entrypoint of docker-compose.yml's one-shot `certs` service (runs as root, sees ./certs
# whole): issue what is missing with `orka certs ...` (its arguments), then hand the files out.
#
# - Everything in ./certs belongs to the host user who runs compose, so they can use
#   certs/admin.* with the CLI and grpcurl, and delete the folder: HOST_UID / HOST_GID from
#   the environment, else the owner of this script, i.e. of the checkout.
# - The controller and scheduler run as the image's `orka` group (gid 10001): their folders
#   and keys are group-readable for it (0750 / 0640), nobody else's are. Agents run as root.
# - The CA key stays in ./certs/ca/ (0700), which no other service mounts.
set -eu
orka "$@"
self=$(stat -c '%u:%g' "$0")
owner="${HOST_UID:-${self%%:*}}:${HOST_GID:-${self##*:}}"
chown -R "$owner" /certs
for folder in /certs/controller /certs/scheduler; do
  [ -d "$folder" ] || continue
  chgrp -R 10001 "$folder"
  chmod 0750 "$folder"
  chmod 0640 "$folder"/*.key
done
echo "certs: ./certs owned by $owner; controller and scheduler folders readable by gid 10001"
