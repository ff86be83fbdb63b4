"""The cluster configs in docs/ray, checked without a cluster: Ray Serve's own schema for the
Serve configs (also the one KubeRay's RayService carries), Ray's cluster schema for `ray up`, and
each application's args built by ``app_builder`` (every option a real ``specdec serve`` one)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAY = ROOT / "docs" / "ray"


def serve_configs() -> dict[str, dict]:
    service = yaml.safe_load((RAY / "rayservice.yaml").read_text())
    return {"serve_config.yaml": yaml.safe_load((RAY / "serve_config.yaml").read_text()),
            "rayservice.yaml serveConfigV2": yaml.safe_load(service["spec"]["serveConfigV2"])}  # fmt: skip


@pytest.mark.parametrize("name", list(serve_configs()))
def test_serve_configs_pass_ray_serves_schema_and_build(name, chat_bundle):
    from specdec.serve.ray_app import app_builder

    cfg = serve_configs()[name]
    ServeDeploySchema.model_validate(cfg) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(cfg)
    for app in cfg["applications"]:
        assert app["import_path"] == "specdec.serve.ray_app:app_builder"
        args = copy.deepcopy(app["args"])
        args["bundle"] = str(chat_bundle[1])  # a bundle here instead of the one the config names
        app_builder(args)  # refuses an unknown option or a bad value with one line


def test_rayservice_shape():
    """What the CRD's schema would catch that matters here (the CRD itself is not available offline)."""
    svc = yaml.safe_load((RAY / "rayservice.yaml").read_text())
    assert (svc["apiVersion"], svc["kind"]) == ("ray.io/v1", "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    assert all(w["image"] == head["image"] for w in workers)
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    for w in workers:  # a replica fits a worker pod
        assert float(w["resources"]["requests"]["cpu"]) >= float(args["num_cpus"])
        assert {e["name"] for e in w["env"]} >= {"SPECDEC_CACHE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert args["bundle"].startswith("s3://")


def test_ray_up_config_passes_rays_cluster_schema():
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    cfg = yaml.safe_load((RAY / "cluster.yaml").read_text())
    validate_config(fillout_defaults(copy.deepcopy(cfg)))  # as `ray up` does: the provider's defaults, then the schema
    assert any("specdec[ray,store]" in c for c in cfg["setup_commands"])
    broken = {**cfg, "provider": {**cfg["provider"], "type": 7}}
    with pytest.raises(Exception, match="provider|type"):
        validate_config(fillout_defaults(broken))
