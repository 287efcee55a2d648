# A CPU peer of p2pdiloco: `join`, `bootstrap`, `doctor`, `status`... (docs/operate.md,
# "Running peers as services").
#
#   docker build -t p2pdiloco .
#   docker run --rm -it -p 31337:31337 -v p2pdiloco:/data p2pdiloco \
#       join --run NAME --host 0.0.0.0 --port 31337 --announce-maddrs /ip4/<public ip>/tcp/31337 \
#       --identity /data/peer.key --checkpoint-dir /data/ckpt
#
# Everything a peer keeps (its key, checkpoints, the pinned operators of known_runs.toml)
# lives in /data: mount a volume there so a new container is the same peer.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
# torch's CPU wheel first, from its own index: from PyPI alone pip takes the CUDA build
# (several GB). TORCH_INDEX= (empty) with PIP_FIND_LINKS=<dir or URL> installs a local wheel.
ARG TORCH_VERSION=2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# py-libp2p's fastecdsa has no wheel: it builds against GMP (and Python.h, which a
# python:*-slim image has and plain Debian's python3 lacks)
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgmp-dev $(python3 -c \
       "import os, sysconfig; print('' if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 'python3-dev')") \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
    && PIP_FIND_LINKS="$PIP_FIND_LINKS" pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md LICENSE /src/
COPY p2pdiloco /src/p2pdiloco
# both transports' stacks (extras since issue 29): the image serves either kind of run
RUN PIP_FIND_LINKS="$PIP_FIND_LINKS" pip install "/src[hivemind,libp2p]"

FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends libgmp10 && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 p2pdiloco && mkdir /data && chown p2pdiloco /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 P2PDILOCO_HOME=/data
USER p2pdiloco
WORKDIR /data
VOLUME /data
# the peer's listen port (--port); metrics (--metrics-port 9100 --metrics-host 0.0.0.0)
EXPOSE 31337 9100
# SIGTERM (docker stop) is the peer's "leave": it finishes its in-flight delta and exits
STOPSIGNAL SIGTERM
ENTRYPOINT ["p2pdiloco"]
CMD ["--help"]
