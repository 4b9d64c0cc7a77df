"""deploy/k8s: every overlay renders with ``kubectl kustomize``, passes the Kubernetes API schemas
of the cluster versions the guide claims (``kubernetes-validate``, strict: no unknown fields) and
the ``checkov`` policy scan (findings fixed, or skipped in the manifests with a reason), and the
containers' command lines parse with the processes' own argument parsers.

Nothing here is skipped: a machine without kubectl, kubernetes-validate or checkov fails with
what to install (the last two come with the ``test`` extra)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.experts.cluster_config import ClusterConfig
from expertmesh.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-only", "gpu-hybrid", "gpu-pool")
# the oldest and newest Kubernetes minor versions deploy/k8s/README.md claims
CLUSTER_VERSIONS = ("1.30", "1.35")
IMAGE_UID = 10001  # docker/Dockerfile's `useradd --uid`

Doc = dict[str, Any]


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl not found on PATH: install kubectl (it carries kustomize) to render deploy/k8s")
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    kubectl = _kubectl()
    out: dict[str, list[Doc]] = {}
    for name in OVERLAYS:
        proc = subprocess.run(
            [kubectl, "kustomize", str(K8S / "overlays" / name)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"kubectl kustomize overlays/{name} failed:\n{proc.stderr}"
        out[name] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def _workloads(docs: list[Doc]) -> Iterator[Doc]:
    return (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def _by(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _parse(args: list[str]) -> argparse.Namespace:
    """The container's arguments through the `expertmesh` subcommand's own parser."""
    command, rest = args[0], args[1:]
    assert command in COMMANDS, f"{command!r} is no expertmesh subcommand"
    parser = argparse.ArgumentParser(prog=f"expertmesh {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    try:
        return parser.parse_args(rest)
    except SystemExit:
        pytest.fail(f"expertmesh {command} refuses the manifest's arguments {rest} (see stderr)")


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def test_schemas_of_claimed_versions(rendered: dict[str, list[Doc]]) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: pip install -c constraints.txt -e '.[test]'")
    for name, docs in rendered.items():
        for doc in docs:
            for version in CLUSTER_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} on {version}: {e.message}")


def _checkov() -> str:
    """checkov lives in a virtual environment of its own (``make test`` makes it as
    ``.venv/tools``): it holds networkx and packaging at versions the project's stack outgrew."""
    for path in (os.environ.get("EXPERTMESH_CHECKOV"), str(ROOT / ".venv" / "tools" / "bin" / "checkov")):
        if path and os.access(path, os.X_OK):
            return path
    found = shutil.which("checkov")
    if found is None:
        pytest.fail(
            "checkov is missing: `make test` installs it into .venv/tools (or set EXPERTMESH_CHECKOV)"
        )
    return found


def test_policy_scan(rendered: dict[str, list[Doc]], tmp_path: Path) -> None:
    checkov = _checkov()
    for name, docs in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    # one run over every overlay (checkov's start-up is most of its time); --skip-download keeps
    # it off the network (CI has none)
    proc = subprocess.run(
        [checkov, "-d", str(tmp_path), "--framework", "kubernetes"]
        + ["--skip-download", "--quiet", "--compact", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.strip(), f"checkov printed no report (rc {proc.returncode}):\n{proc.stderr[-2000:]}"
    report = json.loads(proc.stdout)
    summary = report["summary"]
    failed = report.get("results", {}).get("failed_checks", [])
    assert not failed, "checkov findings:\n" + "\n".join(
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})" for c in failed
    )
    assert summary["parsing_errors"] == 0 and summary["failed"] == 0, summary
    # every object was read (checkov counts each workload's containers as resources too)
    resources = sum(len(docs) for docs in rendered.values())
    assert summary["resource_count"] >= resources, (summary, resources)
    for c in report["results"].get("skipped_checks", []):
        assert len(c.get("suppress_comment", "")) > 20, f"{c['check_id']} skipped without a reason: {c}"


def test_command_lines_parse(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        for w in _workloads(docs):
            for c in w["spec"]["template"]["spec"]["containers"]:
                args = c["args"]
                env = {e["name"] for e in c.get("env", [])}
                # Kubernetes leaves a $(VAR) naming no env var of the container as it is
                for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
                    assert ref in env, f"{name}: {c['name']} uses $({ref}) but sets no such env var"
                parsed = _parse([re.sub(r"\$\(\w+\)", "ns", a) for a in args])
                assert parsed.model == "/model" and parsed.host == "0.0.0.0", (name, c["name"])


def test_coordinator_reaches_every_expert_server(rendered: dict[str, list[Doc]]) -> None:
    """The coordinator names each expert StatefulSet by its headless Service in the dns:///
    form (the port the servers bind, every pod's address published), and nothing else."""
    for name, docs in rendered.items():
        coord = _by(docs, "Deployment", "expertmesh-coordinator")["spec"]["template"]["spec"]["containers"][0]
        cluster = ClusterConfig.from_args(
            _parse([a.replace("$(POD_NAMESPACE)", "ns") for a in coord["args"]])
        )
        for kind in ("gpu", "cpu"):
            given = sorted(_flag(coord["args"], f"{kind}-server"))
            expected = []
            for sts in (d for d in docs if d["kind"] == "StatefulSet"):
                (server,) = sts["spec"]["template"]["spec"]["containers"]
                if server["args"][0] != f"{kind}-server":
                    continue
                svc = _by(docs, "Service", sts["spec"]["serviceName"])
                assert svc["spec"]["clusterIP"] == "None", (
                    f"{name}: {svc['metadata']['name']} is not headless"
                )
                assert svc["spec"]["publishNotReadyAddresses"] is True, name
                assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"], name
                port = _parse(server["args"]).port
                assert [p["port"] for p in svc["spec"]["ports"]] == [port], (name, svc["spec"]["ports"], port)
                expected.append(f"dns:///{svc['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{port}")
            assert given == sorted(expected), f"{name}: --{kind}-server {given}, headless Services {expected}"
            assert len([s for s in cluster.servers if s.kind == kind]) == len(expected), name
        assert cluster.servers, name


def test_pods_probes_metrics_and_hardening(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        for w in _workloads(docs):
            pod = w["spec"]["template"]
            spec = pod["spec"]
            where = f"{name}: {w['kind']}/{w['metadata']['name']}"
            (c,) = spec["containers"]
            parsed = _parse(c["args"])
            # gRPC probes on the port the process binds: readiness on the overall status (""),
            # liveness and start-up on the always-SERVING "liveness" name
            assert c["readinessProbe"]["grpc"] == {"port": parsed.port}, where
            for probe in ("livenessProbe", "startupProbe"):
                assert c[probe]["grpc"] == {"port": parsed.port, "service": "liveness"}, (where, probe)
            # Prometheus scrapes the port /metrics is served on: the coordinator's HTTP port, the
            # expert servers' --metrics-port
            metrics_port = parsed.http_port if c["args"][0] == "coordinator" else parsed.metrics_port
            ann = pod["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", where
            assert ann["prometheus.io/port"] == str(metrics_port), where
            assert metrics_port in {p["containerPort"] for p in c["ports"]}, where
            # the image's user, nothing to escalate to, read-only root, seccomp
            sc, csc = spec["securityContext"], c["securityContext"]
            assert sc["runAsNonRoot"] and sc["runAsUser"] == IMAGE_UID, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert csc["readOnlyRootFilesystem"] and not csc["allowPrivilegeEscalation"], where
            assert csc["capabilities"]["drop"] == ["ALL"], where
            assert spec["automountServiceAccountToken"] is False, where
            # the checkpoint read-only from the claim, /dev/shm in memory, tokens from the Secret
            vols = {v["name"]: v for v in spec["volumes"]}
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert (
                mounts["/model"]["readOnly"]
                and vols[mounts["/model"]["name"]]["persistentVolumeClaim"]["readOnly"]
            ), where
            shm = vols[mounts["/dev/shm"]["name"]]["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"], where
            tokens = vols[mounts["/secrets"]["name"]]["secret"]["secretName"]
            files = {e["name"]: e["value"] for e in c["env"] if "value" in e}
            assert files["EXPERTMESH_CLUSTER_TOKEN_FILE"] == "/secrets/cluster-token", where
            assert tokens == "expertmesh-tokens", where
            if c["args"][0] == "coordinator":
                assert files["EXPERTMESH_ADMIN_TOKEN_FILE"] == "/secrets/admin-token", where
            # a process on a GPU asks for one, and only those do
            on_gpu = str(getattr(parsed, "device", "cpu")).startswith("cuda")
            assert (c["resources"]["limits"].get("nvidia.com/gpu") == 1) == on_gpu, where
            for r in ("cpu", "memory"):
                assert c["resources"]["requests"][r] and c["resources"]["limits"][r], (where, r)


def test_dockerfile_user_matches() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"--uid {IMAGE_UID}" in dockerfile and f"--gid {IMAGE_UID}" in dockerfile
