"""Every shell and Python example of README.md, run as written on the demo model.

The README's ``bash`` and ``python`` blocks are read in order. A line (after joining ``\\``
continuations) that starts a service (``expertmesh up|coordinator|gpu-server|cpu-server``) is
started in the background and waited for (over TLS when it has ``--tls-ca``); a block that
starts services first stops those of the blocks before it (they use the same ports); every other
command must exit 0 and print something other than an error (``openssl`` and ``printf`` only
write files, so they need not print). Python blocks (the PEFT adapter recipe among them) run
against the services of the last block that started some. Left out, each for its reason
in ``SKIPPED``: ``make`` (the whole install), containers (blocks with ``docker`` commands:
``docker/ci-compose.sh`` runs them),
``grpcurl`` (not packaged by Debian; the Admin reads have CLI verbs instead), the venv
activation (the test runs the current interpreter's ``expertmesh``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertmesh import placement as pl
from expertmesh.config import ModelConfig
from expertmesh.health import check
from expertmesh.tls import TLSConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SERVICES = re.compile(r"^expertmesh (up|coordinator|gpu-server|cpu-server)\b")
SKIPPED = {
    "make ": "installs the venv",
    "docker ": "containers: docker/ci-compose.sh",
    "EXPERTMESH_": "containers: docker/ci-compose.sh",
    "grpcurl ": "grpcurl is not packaged by Debian",
    ". .venv/bin/activate": "the test runs this interpreter's expertmesh",
    "img=": "containers",
    "cp /opt/wheels": "containers",
}
QUIET = ("openssl ", "printf ")  # write files (certificates), print nothing on success


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python|json)\n(.*?)^```", text, flags=re.S | re.M)


def commands(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def skipped(cmd: str) -> bool:
    return any(cmd.startswith(p) for p in SKIPPED)


class Services:
    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env, self.procs = cwd, env, []

    def start(self, cmd: str) -> None:
        p = subprocess.Popen(
            cmd, shell=True, cwd=self.cwd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, executable="/bin/bash",
        )  # fmt: skip
        self.procs.append((cmd, p))
        argv = shlex.split(cmd.split("#")[0])
        port = argv[argv.index("--port") + 1]
        tls = TLSConfig(ca=str(self.cwd / argv[argv.index("--tls-ca") + 1])) if "--tls-ca" in argv else None
        deadline = time.monotonic() + 180
        while check(f"127.0.0.1:{port}", 1.0, tls=tls) != "SERVING":  # weights loaded, experts connected
            assert p.poll() is None, f"{cmd!r} exited with {p.returncode}"
            assert time.monotonic() < deadline, f"{cmd!r} not serving after 180 s"
            time.sleep(0.3)

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait(10)
        self.procs = []


def test_readme_examples(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "expertmesh").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m expertmesh.cli "$@"\n'
    )
    (shim / "expertmesh").chmod(0o755)
    (shim / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    services = Services(tmp_path, env)
    ran: list[str] = []
    try:
        for lang, body in blocks(README.read_text()):
            if lang == "json":  # the placement file example, checked by the coordinator's own parser
                check_placement(tmp_path, json.loads(body))
                ran.append("placement.json")
                continue
            if lang == "python":
                r = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=120)  # fmt: skip
                assert r.returncode == 0, f"python example failed:\n{body}\n{r.stderr}"
                ran.append("python block")
                continue
            if any(c.startswith("docker ") for c in commands(body)):
                continue  # a containers block, run by docker/ci-compose.sh
            cmds = [c for c in commands(body) if not skipped(c)]
            if any(SERVICES.match(c) for c in cmds):
                services.stop()
            for c in cmds:
                if SERVICES.match(c):
                    services.start(c)
                else:
                    r = subprocess.run(c, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                       timeout=120, executable="/bin/bash")  # fmt: skip
                    assert r.returncode == 0, f"{c!r} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}"
                    assert r.stdout.strip() or c.startswith(QUIET), f"{c!r} printed nothing"
                    assert '{"error":' not in r.stdout, (
                        f"{c!r} answered an error:\n{r.stdout}"
                    )  # OpenAI's error JSON
                ran.append(c)
    finally:
        services.stop()
    # what must have run: the demo model, both ways of starting a cluster, HTTP, metrics, status,
    # placement, an adapter made by the PEFT recipe and loaded, a TLS cluster from openssl's certificates
    text = "\n".join(ran)
    for what in ("demo-model ./demo-model", "expertmesh up", "gpu-server", "v1/completions", "/metrics",
                 "expertmesh status", "placement.json", "placement set", "lora load demo-lora",
                 "--lora demo-lora", "openssl x509", "--tls-cert cluster.pem", "--tls-ca ca.pem"):  # fmt: skip
        assert what in text, f"no README example with {what!r} ran"


def check_placement(tmp_path: Path, obj: dict) -> None:
    cfg = ModelConfig.from_dir(tmp_path / "demo-model")
    f = tmp_path / "placement.json"
    f.write_text(json.dumps(obj))
    p = pl.load_file(str(f), cfg.moe_layer_ids, cfg.num_experts, ("gpu0", "cpu0"))
    assert sorted(p.layers) == list(cfg.moe_layer_ids)
