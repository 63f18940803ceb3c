#!/bin/sh
# As redis:7's entrypoint: in a container Redis listens on every interface, without
# protected mode (the container network is the boundary).
if [ "$1" = redis-server ]; then
    shift
    exec redis-server "$@" --protected-mode no
fi
exec "$@"
