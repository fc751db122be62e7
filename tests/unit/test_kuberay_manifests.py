"""The shipped KubeRay manifests, rendered as they would be applied (``kubectl kustomize``, offline), and the
recipe's plan checked against them through the launch script's dry run and ``relax kuberay check``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax.cluster.kuberay.documents import Document
from relax.cluster.kuberay.grace import pod_grace
from relax.cluster.kuberay.groups import cluster_groups
from relax.cluster.kuberay.render import load_manifests
from relax.cluster.kuberay.rules import check_documents
from tests.unit.test_scripts import dry_run

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "examples" / "elastic_rollout" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/on-demand", "overlays/gke-spot", "overlays/eks-karpenter", "overlays/cpu-tiny"]
QWEN = "examples/elastic_rollout/run-qwen3-4B-8xgpu-elastic-async.sh"
TINY = "examples/elastic_rollout/run-tiny-cpu-elastic-async.sh"


@pytest.fixture(scope="module", autouse=True)
def kubectl() -> str:
    found = shutil.which("kubectl")
    assert found, "kubectl must be on PATH: the overlays are rendered with `kubectl kustomize` (offline, no cluster)"
    return found


def rendered(name: str) -> list[Document]:
    return load_manifests(K8S / name)


def ray_cluster(documents: list[Document]) -> dict:
    return next(d.body for d in documents if d.kind == "RayCluster")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_manifest_and_overlay_passes_the_schema_and_every_rule(name: str) -> None:
    documents = rendered(name)
    assert {"RayCluster", "RayJob", "PodDisruptionBudget"} <= {d.kind for d in documents}
    assert [f.line() for f in check_documents(documents)] == []


@pytest.mark.parametrize(("name", "drain", "own", "effective"), [
    ("overlays/on-demand", 45.0, 60, 60.0),
    ("overlays/gke-spot", 10.0, 15, 15.0),       # GKE Spot gives 15 s whatever the pod asks
    ("overlays/eks-karpenter", 80.0, 100, 100.0),  # Karpenter deletes the pod on the 2-minute notice
])
def test_each_platform_leaves_the_elastic_pods_time_to_drain(name: str, drain: float, own: int,
                                                            effective: float) -> None:
    elastic = cluster_groups(ray_cluster(rendered(name))["spec"])[2]
    grace = pod_grace(elastic.spec["template"], elastic.ray_container)
    assert (grace.drain_s, grace.pod_grace_s, grace.effective_s) == (drain, own, effective)
    assert grace.drain_s - 5 > 0  # Relax's margin before the deadline leaves requests some time to finish


def test_the_stable_group_stays_off_preemptible_capacity_per_platform() -> None:
    gke = cluster_groups(ray_cluster(rendered("overlays/gke-spot"))["spec"])
    assert gke[1].pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"] == [
            {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}]
    assert gke[2].pod_spec["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    eks = cluster_groups(ray_cluster(rendered("overlays/eks-karpenter"))["spec"])
    assert eks[1].pod_spec["nodeSelector"]["karpenter.sh/capacity-type"] == "on-demand"
    assert eks[1].spec["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert eks[2].pod_spec["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"


def test_the_tiny_twin_has_no_gpus_and_the_same_groups() -> None:
    documents = rendered("overlays/cpu-tiny")
    groups = cluster_groups(ray_cluster(documents)["spec"])
    assert [g.name for g in groups] == ["head", "stable", "elastic"]
    assert "nvidia.com/gpu" not in yaml.safe_dump([d.body for d in documents])
    assert [g.gpus for g in groups] == [0.0, 4.0, 1.0]  # logical GPUs, from num-gpus
    assert {d.kind for d in documents}.isdisjoint({"PersistentVolumeClaim"})


def test_the_recipe_fits_the_shipped_cluster(tmp_path: Path) -> None:
    result = dry_run(QWEN, tmp_path, RELAX_CLUSTER_MANIFEST=str(K8S / "base"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "RayCluster/relax" in result.stdout and ": the plan fits" in result.stdout
    assert "at start: CPU 96, GPU 8, stable_cpu 16, stable_gpu 8" in result.stdout
    assert "no problems" in result.stdout


def test_the_tiny_twin_fits_its_overlay_and_the_recipe_does_not(tmp_path: Path) -> None:
    tiny = dry_run(TINY, tmp_path, RELAX_CLUSTER_MANIFEST=str(K8S / "overlays/cpu-tiny"))
    assert tiny.returncode == 0 and ": the plan fits" in tiny.stdout, tiny.stdout + tiny.stderr
    recipe = dry_run(QWEN, tmp_path, RELAX_CLUSTER_MANIFEST=str(K8S / "overlays/cpu-tiny"))
    assert recipe.returncode == 1
    assert "the cluster declares stable_gpu: 4 but the pinned baseline needs 8" in recipe.stdout


def _broken_copy(tmp_path: Path, change) -> Path:
    documents = rendered("base")
    bodies = [yaml.safe_load(yaml.safe_dump(dict(d.body))) for d in documents]
    stable = next(b for b in bodies if b["kind"] == "RayCluster")["spec"]["workerGroupSpecs"][0]
    change(stable)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all(bodies))
    return path


def test_a_copy_without_markers_says_what_is_missing(tmp_path: Path) -> None:
    manifest = _broken_copy(tmp_path, lambda stable: stable.__setitem__("rayStartParams", {}))
    result = dry_run(QWEN, tmp_path, RELAX_CLUSTER_MANIFEST=str(manifest))
    assert result.returncode == 1
    assert "the plan does not fit" in result.stdout
    assert ("node-group affinity needs the marker resources stable_gpu, stable_cpu (RELAX_INITIAL_NODE_GROUP=stable) "
            "but the cluster does not declare them") in result.stdout


def test_a_marker_in_the_resources_field_says_why_it_is_missing(tmp_path: Path) -> None:
    def to_field(stable: dict) -> None:
        stable["rayStartParams"] = {}
        stable["resources"] = {"stable_gpu": "8", "stable_cpu": "16"}
    result = dry_run(QWEN, tmp_path, RELAX_CLUSTER_MANIFEST=str(_broken_copy(tmp_path, to_field)))
    assert result.returncode == 1
    assert "needs the marker resources stable_gpu (RELAX_INITIAL_NODE_GROUP=stable)" in result.stdout
    assert "so 'stable_gpu' never reaches Ray" in result.stdout


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_relax_kuberay_check_exit_codes(tmp_path: Path) -> None:
    clean = relax("kuberay", "check", str(K8S / "overlays" / "gke-spot"))
    assert clean.returncode == 0 and "against KubeRay v1.7.0" in clean.stdout and "no problems" in clean.stdout
    broken = _broken_copy(tmp_path, lambda stable: stable["rayStartParams"].__setitem__(
        "resources", '{"stable_gpu": 8, "stable_cpu": 16}'))
    found = relax("kuberay", "check", str(broken))
    assert found.returncode == 1 and "bash splits bare JSON into words" in found.stdout, found.stdout
    missing = relax("kuberay", "check", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"relax kuberay check: error: {tmp_path}/nope.yaml: no such file"
    bare = relax("kuberay", "check", str(tmp_path))
    assert bare.returncode == 2 and "without a kustomization.yaml" in bare.stderr


def test_the_manifest_flag_belongs_to_a_dry_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "relax.entrypoints.train", "--resource",
                             '{"actor": [1, 1], "rollout": [1, 1]}', "--num-rollout", "1",
                             "--ray-cluster-manifest", str(K8S / "base")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("--ray-cluster-manifest checks a plan before the cluster exists: use it with "
                                          "--dry-run (a real start checks the live cluster)")


def test_a_usage_error_of_relax_kuberay_is_one_line(capsys) -> None:
    from relax import cli

    assert cli.main(["kuberay", "check"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("relax kuberay check: error: ")


@pytest.mark.parametrize(("name", "plan_line"), [
    ("base", "trainer (actor)  4 GPUs"),
    ("overlays/cpu-tiny", "trainer (actor)  2 GPUs"),
])
def test_the_rayjob_runs_the_recipe_as_kuberay_and_ray_run_an_entrypoint(name: str, plan_line: str,
                                                                         tmp_path: Path) -> None:
    """The submitter runs ``bash -ce "ray job submit ... -- <entrypoint>"`` (KubeRay pastes the entrypoint
    unquoted); Ray's CLI joins the words after ``--`` with ``subprocess.list2cmdline``; the job supervisor runs
    that line with ``shell=True`` and the runtime env's variables. Here ``ray`` is a stand-in that records its
    words, /opt/relax is this checkout, and RELAX_LAUNCH=dry-run replaces ``here`` so the plan is printed."""
    job = next(d.body for d in rendered(name) if d.kind == "RayJob")["spec"]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    recorded = tmp_path / "entrypoint"
    (fake_bin / "ray").write_text(
        f"#!{sys.executable}\nimport subprocess, sys\nwords = sys.argv[sys.argv.index('--') + 1:]\n"
        f"open({str(recorded)!r}, 'w').write(subprocess.list2cmdline(words))\n")
    (fake_bin / "ray").chmod(0o755)
    submitter = subprocess.run(
        ["bash", "-ce", f"ray job submit --address http://relax-head-svc:8265 -- {job['entrypoint']}"],
        env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}, capture_output=True, text=True, timeout=60)
    assert submitter.returncode == 0 and submitter.stdout == "", submitter.stderr  # nothing ran in the submitter
    line = recorded.read_text().replace("/opt/relax", str(REPO))
    env_vars = {k: str(v).replace("/opt/relax", str(REPO))
                for k, v in yaml.safe_load(job["runtimeEnvYAML"])["env_vars"].items()}
    assert env_vars.pop("RELAX_LAUNCH") == "here"
    driver = subprocess.run(line, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env_vars, "RELAX_LAUNCH": "dry-run", "PYTHON": sys.executable})
    assert driver.returncode == 0, driver.stderr
    assert plan_line in driver.stdout and "autoscaler enabled" in driver.stdout
