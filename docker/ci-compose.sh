#!/usr/bin/env bash
# Container CI job: build the expertmesh image on a host that reaches no container registry,
# bring the stack up with `docker compose up`, make a real generation request through the
# coordinator's published gRPC port and one through its HTTP port (curl, /v1/completions), check
# /metrics, and tear everything down. Exits non-zero on any failure.
#
#   bash docker/ci-compose.sh          # as root; installs Debian's docker.io etc. when missing
#
# It runs its own dockerd (own data root, exec root and socket; no bridge, no iptables rules),
# so it neither needs nor disturbs another Docker engine on the machine. What it learned about
# this kind of machine is in docker/README.md.
#
# Environment (all optional):
#   EXPERTMESH_CACHE_DIR            cache root: base tarball, docker data root (/var/cache/expertmesh)
#   EXPERTMESH_CI_KEEP_DOCKER_ROOT  1 keeps the data root (images = build cache) for the next run (1)
#   EXPERTMESH_CI_HEALTH_TIMEOUT    seconds for the stack to turn healthy (420)
#   EXPERTMESH_CI_CLIENT            auto | host | image: where `expertmesh generate` runs (auto:
#                                   host when the host expertmesh below exists, else image)
#   EXPERTMESH_CI_HOST_EXPERTMESH   the host's expertmesh command ($ROOT/.venv/bin/expertmesh)
#   EXPERTMESH_TORCH_WHEEL_PATH     the CPU torch wheel (default: /opt/wheels, version from constraints.txt)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_DIR=${EXPERTMESH_CACHE_DIR:-/var/cache/expertmesh}
RUN_DIR=/run/expertmesh-ci
DATA_ROOT=$CACHE_DIR/docker
KEEP_ROOT=${EXPERTMESH_CI_KEEP_DOCKER_ROOT:-1}
HEALTH_TIMEOUT=${EXPERTMESH_CI_HEALTH_TIMEOUT:-420}
CLIENT=${EXPERTMESH_CI_CLIENT:-auto}
HOST_EXPERTMESH=${EXPERTMESH_CI_HOST_EXPERTMESH:-$ROOT/.venv/bin/expertmesh}
PROJECT=expertmesh-ci
IMAGE=expertmesh:ci
COMPOSE_FILE_MAIN=$ROOT/docker/compose.yaml
COMPOSE_FILE_GPU=$ROOT/docker/compose.gpu.yaml

export DOCKER_HOST=unix://$RUN_DIR/docker.sock
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0 # plain builder: Debian's engine has no buildx
unset DOCKER_CONTEXT DOCKER_TLS_VERIFY DOCKER_CERT_PATH

COMPOSE=()
DOCKERD_PID=
STACK_STARTED=0
WHEEL_LINK=
declare -a PHASES=()
PHASE_NAME=
PHASE_T0=0
SCRIPT_T0=$(date +%s)

log() { echo "[ci-compose $(date +%H:%M:%S)] $*"; }
die() {
    log "FAILED: $*"
    exit 1
}

phase() {
    phase_end
    PHASE_NAME=$1
    PHASE_T0=$(date +%s)
    log "== $PHASE_NAME"
}
phase_end() {
    if [[ -n $PHASE_NAME ]]; then
        PHASES+=("$(printf '%-22s %5ds' "$PHASE_NAME" $(($(date +%s) - PHASE_T0)))")
        PHASE_NAME=
    fi
}
print_timings() {
    phase_end
    echo "---- ci-compose phase timings ----"
    local p
    for p in "${PHASES[@]}"; do echo "  $p"; done
    printf '  %-22s %5ds\n' total $(($(date +%s) - SCRIPT_T0))
}

compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE_MAIN" "$@"; }

dump_stack() {
    log "stack state:"
    compose ps || true
    log "service logs:"
    compose logs --no-color --tail=200 || true
    local svc id
    for svc in cpu-server gpu-server coordinator; do
        id=$(compose ps -q "$svc" 2>/dev/null) || continue
        [[ -n $id ]] || continue
        log "$svc: last health checks:"
        docker inspect -f '{{if .State.Health}}{{range .State.Health.Log}}{{.ExitCode}} {{.Output}}{{end}}{{end}}' "$id" 2>/dev/null | tail -20 || true
    done
}

cleanup() {
    local rc=$?
    set +e
    phase_end
    if ((STACK_STARTED)); then
        ((rc != 0)) && dump_stack
        log "compose down -v"
        timeout 120 "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE_MAIN" down -v --remove-orphans >/dev/null 2>&1
    fi
    [[ -n $WHEEL_LINK ]] && rm -f "$WHEEL_LINK"
    if [[ -n $DOCKERD_PID ]]; then
        # old builds' layers no longer reachable from a tag; the current cache is tagged
        ((rc == 0)) && docker image prune -f >/dev/null 2>&1
        ((rc != 0)) && { log "dockerd errors (tail):"; grep -E 'level=(error|fatal)' "$RUN_DIR/dockerd.log" | tail -n 20; }
        stop_dockerd
        # dockerd leaves its default network namespace mounted under the exec root
        awk -v d="$RUN_DIR/exec/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r -n1 umount -l
        rm -rf --one-file-system "$RUN_DIR/exec"
        if [[ $KEEP_ROOT != 1 ]]; then
            log "removing docker data root $DATA_ROOT"
            rm -rf --one-file-system "$DATA_ROOT"
        fi
    fi
    print_timings
    if ((rc == 0)); then log "PASSED"; else log "exit status $rc"; fi
    exit "$rc"
}

stop_dockerd() {
    local pid=${DOCKERD_PID:-$(cat "$RUN_DIR/dockerd.pid" 2>/dev/null)} i
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    grep -q dockerd "/proc/$pid/cmdline" 2>/dev/null || return 0 # a recycled pid
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for ((i = 0; i < 60; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    DOCKERD_PID=
}

apt_candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2 }'; }

ensure_tools() {
    local need=()
    command -v dockerd >/dev/null || need+=(docker.io)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v flock >/dev/null || need+=(util-linux)
    if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
        need+=(compose)
    fi
    if ((${#need[@]})); then
        [[ $(id -u) == 0 ]] || die "missing ${need[*]} and not root: install them first"
        log "installing: ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        local pkgs=() p c
        for p in "${need[@]}"; do
            if [[ $p == compose ]]; then
                # prefer Compose v2 where Debian ships it; bookworm only has the v1 package
                for c in docker-compose-v2 docker-compose-plugin docker-compose; do
                    if [[ -n $(apt_candidate "$c") && $(apt_candidate "$c") != "(none)" ]]; then
                        pkgs+=("$c")
                        break
                    fi
                done
            else
                pkgs+=("$p")
            fi
        done
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
    if docker compose version >/dev/null 2>&1; then
        COMPOSE=(docker compose)
    elif command -v docker-compose >/dev/null; then
        COMPOSE=(docker-compose)
    else
        die "no docker compose available"
    fi
    command -v docker >/dev/null || die "no docker client"
    log "docker client: $(docker --version)"
    log "compose: $("${COMPOSE[@]}" version 2>/dev/null | head -n1)"
}

start_dockerd() {
    mkdir -p "$RUN_DIR" "$DATA_ROOT"
    stop_dockerd # a daemon left behind by a run that was killed
    rm -f "$RUN_DIR/docker.sock" "$RUN_DIR/dockerd.pid"
    # NOTE: --bridge=none/--iptables=false: no docker0 and no host firewall changes. Compose's
    # own network still gives the services DNS names to reach each other, published ports go
    # through docker-proxy, and builds use the host's network (docker build --network host).
    # Its own containerd namespaces keep it apart from any other engine on the machine.
    dockerd \
        --data-root "$DATA_ROOT" \
        --exec-root "$RUN_DIR/exec" \
        --pidfile "$RUN_DIR/dockerd.pid" \
        --host "$DOCKER_HOST" \
        --bridge=none --iptables=false --ip-masq=false \
        --storage-driver=overlay2 \
        --containerd-namespace expertmesh-ci \
        --containerd-plugins-namespace expertmesh-ci-plugins \
        >"$RUN_DIR/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    local i
    for ((i = 0; i < 120; i++)); do
        docker version >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -n 30 "$RUN_DIR/dockerd.log"; die "dockerd exited"; }
        sleep 0.5
    done
    docker version >/dev/null 2>&1 || { tail -n 30 "$RUN_DIR/dockerd.log"; die "dockerd did not answer in 60 s"; }
    log "dockerd $(docker version --format '{{.Server.Version}}') up, data root $DATA_ROOT"
}

torch_wheel() {
    if [[ -n ${EXPERTMESH_TORCH_WHEEL_PATH:-} ]]; then
        echo "$EXPERTMESH_TORCH_WHEEL_PATH"
        return
    fi
    local ver
    ver=$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$ROOT/constraints.txt" | head -n1)
    [[ -n $ver ]] || die "constraints.txt pins no torch version"
    compgen -G "/opt/wheels/torch-$ver+cpu-cp311-*.whl" | head -n1
}

build_image() {
    local src name
    src=$(torch_wheel)
    # never fall back to PyPI's torch here: that is the multi-GB CUDA build
    [[ -n $src && -f $src ]] || die "no CPU torch wheel found (set EXPERTMESH_TORCH_WHEEL_PATH)"
    name=$(basename "$src")
    if [[ ! -f $ROOT/docker/wheels/$name ]]; then
        WHEEL_LINK=$ROOT/docker/wheels/$name
        ln "$src" "$WHEEL_LINK" 2>/dev/null || cp "$src" "$WHEEL_LINK"
    fi
    local args=(--network host -f "$ROOT/docker/Dockerfile"
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_WHEEL=$name" --build-arg OMIT_DEPS=triton)
    docker build "${args[@]}" -t "$IMAGE" "$ROOT" >"$RUN_DIR/build.log" 2>&1 ||
        { tail -n 60 "$RUN_DIR/build.log"; die "docker build failed (log above)"; }
    grep -E '^Step [0-9]+/[0-9]+ :|Using cache' "$RUN_DIR/build.log" | awk '
        /^Step/ { n++ } /Using cache/ { c++ } END { printf "build steps: %d, from cache: %d\n", n, c }'
    # Tag the intermediate stages so that the prune at exit keeps them as cache.
    docker build "${args[@]}" --target deps -t "$IMAGE-deps" "$ROOT" >/dev/null 2>&1
    docker build "${args[@]}" --target wheel -t "$IMAGE-wheel" "$ROOT" >/dev/null 2>&1
    docker image ls "$IMAGE" --format 'image {{.Repository}}:{{.Tag}} {{.Size}}'
    docker run --rm "$IMAGE" --help >/dev/null || die "expertmesh --help fails in the image"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_healthy() {
    local deadline=$(($(date +%s) + HEALTH_TIMEOUT)) id state s svc
    while :; do
        state=
        for svc in cpu-server gpu-server coordinator; do
            id=$(compose ps -q "$svc" 2>/dev/null)
            s=missing
            [[ -n $id ]] && s=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id" 2>/dev/null)
            state+="$svc=$s "
            if [[ $s == unhealthy || $s == exited || $s == dead ]]; then
                die "$svc is $s"
            fi
        done
        [[ $state == *"coordinator=healthy"* ]] && { log "healthy: $state"; return 0; }
        (($(date +%s) < deadline)) || die "stack not healthy after ${HEALTH_TIMEOUT}s: $state"
        sleep 3
    done
}

run_client() {
    local mode=$CLIENT
    if [[ $mode == auto ]]; then
        mode=image
        [[ -x $HOST_EXPERTMESH ]] && mode=host
    fi
    log "generate via the $mode client -> 127.0.0.1:$PORT"
    if [[ $mode == host ]]; then
        "$HOST_EXPERTMESH" "$@"
    else
        docker run --rm --network host "$IMAGE" "$@"
    fi
}

check_generation() {
    local out
    out=$(run_client generate --addr "127.0.0.1:$PORT" --prompt "the quick brown fox" \
        --max-new-tokens 16 --timeout 120 --json) || die "generate request failed"
    echo "$out"
    python3 - "$out" <<'EOF' || die "unexpected generate answer"
import json, sys
ans = json.loads(sys.argv[1].strip().splitlines()[-1])
ids, reason = ans.get("token_ids"), ans.get("finish_reason")
assert isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids), f"token_ids={ids!r}"
assert isinstance(reason, str) and reason, f"finish_reason={reason!r}"
print(f"ok: {len(ids)} tokens, finish_reason={reason}, text={ans.get('text')!r}")
EOF
}

# The OpenAI-compatible HTTP API on its published port, with curl (the host's: it needs nothing
# of expertmesh), and the metrics of the coordinator and of an expert server.
check_http() {
    local out
    log "curl POST /v1/completions -> 127.0.0.1:$HTTP_PORT"
    out=$(curl -sS --fail-with-body --max-time 120 "http://127.0.0.1:$HTTP_PORT/v1/completions" \
        -H 'Content-Type: application/json' \
        -d '{"model": "model", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}') ||
        die "POST /v1/completions failed: $out"
    echo "$out"
    python3 - "$out" <<'EOF' || die "unexpected /v1/completions answer"
import json, sys
ans = json.loads(sys.argv[1])
choice, usage = ans["choices"][0], ans["usage"]
assert ans["object"] == "text_completion" and choice["text"], ans
assert choice["finish_reason"] in ("stop", "length") and usage["completion_tokens"] > 0, ans
print(f"ok: {usage['completion_tokens']} tokens, finish_reason={choice['finish_reason']}, text={choice['text']!r}")
EOF
    out=$(curl -sS --fail --max-time 30 "http://127.0.0.1:$HTTP_PORT/metrics") || die "GET /metrics failed"
    grep -E '^expertmesh_requests_total\{status="length"\} [1-9]' <<<"$out" ||
        die "coordinator /metrics does not count the finished request"
    # both expert servers on the shared-memory fast path (the services share one /dev/shm);
    # plain gRPC here means the fast path was lost (the coordinator's log says why)
    local on_shm
    on_shm=$(grep -cE '^expertmesh_expert_server_transport\{[^}]*transport="shm"[^}]*\} 1' <<<"$out" || true)
    [[ $on_shm == 2 ]] || die "$on_shm of 2 expert servers on the shm fast path: $(grep '^expertmesh_expert_server_transport' <<<"$out" | tr '\n' ' ')"
    log "ok: both expert servers on the shm fast path"
    # the expert servers' metrics ports are not published: scrape one from inside the network
    compose exec -T coordinator python -c \
        'import urllib.request; print(urllib.request.urlopen("http://cpu-server:9061/metrics").read().decode())' |
        grep -E '^expertmesh_worker_requests_total [1-9]' || die "cpu-server /metrics shows no requests"
}

# The stack serves (above), so the coordinator holds the cluster token cluster-secret generated;
# an expert server must refuse a placement push that lacks it (the servers are closed).
check_cluster_token() {
    log "cpu-server refuses ApplyPlacement without the cluster token"
    compose exec -T coordinator python - <<'EOF' || die "cpu-server accepted a placement push without the cluster token"
import grpc
from expertmesh.v1 import expert_worker_pb2 as pb, expert_worker_pb2_grpc as pb_grpc
with grpc.insecure_channel("cpu-server:50061") as ch:
    P = pb.ApplyPlacementRequest
    try:
        pb_grpc.ExpertWorkerStub(ch).ApplyPlacement(P(phase=P.COMMIT, generation=99), timeout=10)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        print("refused:", e.code().name)
    else:
        raise SystemExit("accepted")
EOF
}

# What `grpcurl -plaintext HOST:PORT list` shows, through server reflection (no grpcurl here).
check_reflection() {
    docker run --rm -i --network host --entrypoint python "$IMAGE" - "127.0.0.1:$PORT" <<'EOF' ||
import sys
import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    names = [s.name for r in stub.ServerReflectionInfo(iter([req]), timeout=10) for s in r.list_services_response.service]
print("reflection lists:", " ".join(names))
assert "expertmesh.v1.Generation" in names, names
EOF
        die "server reflection does not list expertmesh.v1.Generation"
}

# the image carries a C compiler, so the CPU expert server must run its C decode
# kernels, not the torch fallback (its start-up log says which).
check_cpu_kernels() {
    local logs # NOTE: not `compose logs | grep -q`: grep's early exit fails the pipe (pipefail)
    logs=$(compose logs --no-color cpu-server 2>&1)
    grep -E "CPU experts: .*decode kernel" <<<"$logs" || die "cpu-server logged no decode-kernel line"
    grep -q "decode kernel C" <<<"$logs" || die "cpu-server runs the torch fallback, not the C kernels"
}

main() {
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    cd "$ROOT"

    phase tools
    ensure_tools
    mkdir -p "$CACHE_DIR"
    exec 9>"$CACHE_DIR/ci-compose.lock"
    flock -w 1800 9 || die "another ci-compose run holds $CACHE_DIR/ci-compose.lock"

    phase dockerd
    start_dockerd

    phase compose-config
    compose config -q
    "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE_MAIN" -f "$COMPOSE_FILE_GPU" config -q
    log "compose files valid"

    phase base-image
    BASE_IMAGE=$(EXPERTMESH_CACHE_DIR=$CACHE_DIR bash "$ROOT/docker/build-base.sh" | tail -n1)
    log "base image $BASE_IMAGE"

    phase image
    build_image

    phase compose-up
    PORT=$(free_port)
    HTTP_PORT=$(free_port)
    export EXPERTMESH_IMAGE=$IMAGE EXPERTMESH_PORT=$PORT EXPERTMESH_HTTP_PORT=$HTTP_PORT EXPERTMESH_PUBLISH_ADDR=127.0.0.1
    STACK_STARTED=1
    compose down -v --remove-orphans >/dev/null 2>&1 || true # leftovers of a killed run
    timeout "$HEALTH_TIMEOUT" "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE_MAIN" up -d --no-build ||
        die "compose up failed"

    phase wait-healthy
    wait_healthy

    phase generate
    check_generation
    check_http
    check_reflection
    check_cluster_token
    check_cpu_kernels

    phase compose-down
    compose down -v --remove-orphans
    STACK_STARTED=0
}

main "$@"
