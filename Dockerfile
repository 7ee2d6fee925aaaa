# syntax=docker/dockerfile:1.7
#
# The staleguard validator image, and the filter module as a build output.
#
#   docker build -t ghcr.io/staleguard/staleguard-validator:0.1.0 .
#   docker build --target filter-module --output type=local,dest=out .
#
# The first is the image deploy/validator/deployment.yaml names (the tag is
# the workspace version; scripts/check-deploy checks they agree). The second
# writes out/staleguard_filter.wasm and out/staleguard_filter.wasm.sha256 for
# deploy/module and the sha256 in deploy/istio/envoyfilter.yaml.
#
# For users who build from source with a container engine. CI does not build
# this file (it pulls base images): it builds and runs the images of
# scripts/images, the same static musl binary (kube uses rustls with ring, no
# OpenSSL) on an empty base, user 65532, which deploy/ is checked against
# (docs/operations.md, "Images"). This one puts the binary on distroless
# static, whose "nonroot" user is that same 65532; its digests differ.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM docker.io/library/rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
# ring needs a C compiler for the musl target.
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl wasm32-wasip1
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p staleguard-validator --bin staleguard-validator \
      --target x86_64-unknown-linux-musl \
 && install -D -m 0555 target/x86_64-unknown-linux-musl/release/staleguard-validator /out/staleguard-validator
# scripts/build-module: the build whose sha256 deploy/istio/envoyfilter.yaml pins
# (paths remapped, so this image's CARGO_HOME and /src leave no trace).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    install -D -m 0444 "$(scripts/build-module)" /out/staleguard_filter.wasm \
 && (cd /out && sha256sum staleguard_filter.wasm > staleguard_filter.wasm.sha256)

FROM scratch AS filter-module
COPY --from=build /out/staleguard_filter.wasm /out/staleguard_filter.wasm.sha256 /

# distroless static: no shell, no package manager; "nonroot" is uid 65532.
FROM gcr.io/distroless/static-debian12:nonroot AS validator
LABEL org.opencontainers.image.title="staleguard-validator" \
      org.opencontainers.image.source="https://github.com/staleguard/staleguard" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/staleguard-validator /usr/local/bin/staleguard-validator
USER 65532:65532
EXPOSE 8080 9090 9095
ENTRYPOINT ["/usr/local/bin/staleguard-validator"]
