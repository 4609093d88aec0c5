"""deploy/k8s/ray-matrix.yaml (KubeRay RayCluster + RayJob for the hypercube) against KubeRay's own
CRD schemas, and against Tensorverse: the spec in its ConfigMap parses, the job's command line is
one ``tensorverse matrix`` accepts, the paths it names are mounted.

The schemas are the ``openAPIV3Schema`` of KubeRay v1.7.0's CRDs, vendored unmodified (gzip) in
``tests/matrix/kuberay/`` (from github.com/ray-project/kuberay, tag v1.7.0, commit 59d663ae,
``ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml``; no package on PyPI or npm
ships them). Validation is jsonschema's, made *strict* as ``kubectl apply`` (field validation
``Strict``) is: an object with declared ``properties`` accepts no other field unless the schema
says ``x-kubernetes-preserve-unknown-fields`` or gives ``additionalProperties``; KubeRay's CEL
rules (``x-kubernetes-validations``) are not evaluated."""

from __future__ import annotations

import copy
import functools
import gzip
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tensorverse.cli import build_parser
from tensorverse.matrix.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "ray-matrix.yaml"
CRDS = Path(__file__).resolve().parent / "kuberay"


def _strict(s: Any) -> Any:
    if isinstance(s, dict):
        s = {k: _strict(v) for k, v in s.items()}
        if s.get("type") == "object" and "properties" in s and "additionalProperties" not in s \
                and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
        if s.get("x-kubernetes-int-or-string") and "type" not in s and "anyOf" not in s:
            s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return s
    if isinstance(s, list):
        return [_strict(x) for x in s]
    return s


@functools.lru_cache(maxsize=None)
def crd_validator(plural: str, version: str = "v1") -> jsonschema.Draft4Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(gzip.decompress((CRDS / f"ray.io_{plural}.yaml.gz").read_bytes()), Loader=loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"
    v = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = _strict(v["schema"]["openAPIV3Schema"])
    # metadata is the API server's (ObjectMeta), not the CRD's: name and labels are what we use
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
        "additionalProperties": False}
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for d in yaml.safe_load_all(MANIFEST.read_text()):
        out[d["kind"]] = d
    return out


def _errors(validator: jsonschema.Draft4Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_manifest_kinds(docs):
    assert set(docs) == {"PersistentVolumeClaim", "ConfigMap", "RayCluster", "RayJob"}
    assert docs["RayCluster"]["apiVersion"] == docs["RayJob"]["apiVersion"] == "ray.io/v1"


def test_raycluster_matches_kuberay_crd(docs):
    assert _errors(crd_validator("rayclusters"), docs["RayCluster"]) == []


def test_rayjob_matches_kuberay_crd(docs):
    assert _errors(crd_validator("rayjobs"), docs["RayJob"]) == []


@pytest.mark.parametrize("mutate, expect", [
    (lambda c: c["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
    (lambda c: c["spec"]["workerGroupSpecs"][0].__setitem__("replica", 8), "'replica' was unexpected"),
    (lambda c: c["spec"]["workerGroupSpecs"][0].__setitem__("replicas", "8"), "'8' is not of type 'integer'"),
    (lambda c: c["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"),
     "'name' is a required property"),
    (lambda c: c["spec"]["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-gpus", 8),
     "8 is not of type 'string'"),
])
def test_the_validator_catches_mistakes(docs, mutate, expect):
    bad = copy.deepcopy(docs["RayCluster"])
    mutate(bad)
    errs = _errors(crd_validator("rayclusters"), bad)
    assert any(expect in e for e in errs), errs


def test_rayjob_runs_a_matrix_on_this_cluster(docs):
    job, cluster = docs["RayJob"]["spec"], docs["RayCluster"]
    assert job["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["entrypoint"])
    assert argv[0] == "tensorverse"
    args = build_parser().parse_args(argv[1:])
    assert args.executor == "ray" and args.ray_address == "auto"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    vols = {v["name"]: v for v in head["volumes"]}
    for path in (args.spec, args.corpus, args.out):
        mount = next((m for m in mounts if path.startswith(m + "/")), None)
        assert mount, f"{path} is not on a volume of the head (the driver runs there)"
    assert vols[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert vols[mounts["/etc/tensorverse"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert Path(args.spec).name in docs["ConfigMap"]["data"]


def test_spec_in_the_configmap(docs):
    spec = parse_spec(tomllib.loads(docs["ConfigMap"]["data"]["matrix.toml"]))
    points = spec.all_points()
    assert len(points) == 3 ** 5 == 243
    assert spec.reference in {p.name for p in points}
    # Ray assigns each point its GPUs; a pinned device list would put every point on the same ones
    assert "CUDA_VISIBLE_DEVICES" not in spec.effective({})


def test_images_are_the_vllm_image_and_gpus_match(docs):
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    built = {s["image"] for s in compose["services"].values()
             if isinstance(s, dict) and (s.get("build") or {}).get("dockerfile") == "deploy/Dockerfile.vllm"}
    c = docs["RayCluster"]["spec"]
    pods = [c["headGroupSpec"]["template"]["spec"]] + [w["template"]["spec"] for w in c["workerGroupSpecs"]]
    for pod in pods:
        for ctr in pod["containers"]:
            assert ctr["image"] in built, (ctr["image"], built)
    for w in c["workerGroupSpecs"]:
        gpus = w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert w["rayStartParams"]["num-gpus"] == gpus
    assert c["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no points on the head
