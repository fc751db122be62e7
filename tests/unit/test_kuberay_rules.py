"""KubeRay manifests: KubeRay v1.7.0's strict schema, its Go-side rules and Relax's, one negative case per rule.

Each case starts from the shipped base manifests (examples/elastic_rollout/k8s/base, read as files: no kubectl),
breaks one thing and expects exactly the rule that guards it; the unbroken base has no finding at all.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relax.cluster.kuberay.documents import Document, ManifestError, parse_documents
from relax.cluster.kuberay.findings import Rule
from relax.cluster.kuberay.grace import pod_grace
from relax.cluster.kuberay.groups import cluster_groups, parse_start_resources, quantity, resources_at_start
from relax.cluster.kuberay.rules import check_documents
from relax.cluster.kuberay.schema import vendored_schema
from relax.config.flags import parse_args
from tests.unit.test_plan import driver_plan, recipe_qwen3_4b_args

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "examples" / "elastic_rollout" / "k8s" / "base"
BASE_FILES = ("storage.yaml", "raycluster.yaml", "pdb.yaml", "rayjob.yaml")
AUTOSCALER = str(REPO / "examples" / "elastic_rollout" / "autoscaler.yaml")


def base_bodies() -> list[dict[str, Any]]:
    docs = [d for name in BASE_FILES for d in parse_documents((BASE / name).read_text(), name)]
    return [copy.deepcopy(dict(d.body)) for d in docs]


def documents(bodies: list[dict[str, Any]]) -> list[Document]:
    return [Document("test", i, body) for i, body in enumerate(bodies)]


def of_kind(bodies: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(b for b in bodies if b["kind"] == kind)


def cluster(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    return of_kind(bodies, "RayCluster")["spec"]


def stable(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    return cluster(bodies)["workerGroupSpecs"][0]


def elastic(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    return cluster(bodies)["workerGroupSpecs"][1]


def recipe_plan():
    return driver_plan(parse_args(recipe_qwen3_4b_args(AUTOSCALER)), env={})


def rules_found(bodies: list[dict[str, Any]], plan=None) -> set[Rule]:
    return {f.rule for f in check_documents(documents(bodies), plan=plan)}


def test_the_shipped_base_passes_every_rule_and_fits_the_recipe() -> None:
    findings = check_documents(documents(base_bodies()), plan=recipe_plan())
    assert findings == []


def test_the_vendored_schemas_say_where_they_come_from() -> None:
    for kind in ("RayCluster", "RayJob"):
        source = vendored_schema(kind)["x-relax-source"]
        assert source["release"] == "v1.7.0" and source["kind"] == kind
    license_text = (REPO / "relax" / "cluster" / "kuberay" / "schemas" / "LICENSE.kuberay").read_text()
    assert license_text.lstrip().startswith("Apache License")


# --------------------------------------------------------------------------------------------------
# One broken thing each: (what is broken, the change, the rule that must name it)


def _set(path: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    """A change that sets a dotted path under the RayCluster's spec (``workerGroupSpecs.1.maxReplicas``)."""
    def change(bodies: list[dict[str, Any]]) -> None:
        node: Any = cluster(bodies)
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return change


def _env(group: int, name: str, value: str) -> Callable[[list[dict[str, Any]]], None]:
    def change(bodies: list[dict[str, Any]]) -> None:
        container = cluster(bodies)["workerGroupSpecs"][group]["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container.get("env", []) if e["name"] != name] + [{"name": name, "value": value}]
    return change


def _gke_spot(bodies: list[dict[str, Any]]) -> None:
    elastic(bodies)["template"]["spec"]["nodeSelector"] = {"cloud.google.com/gke-spot": "true"}


def _old_gke_advice(bodies: list[dict[str, Any]]) -> None:
    """docs/elastic.md's advice before: drain 20 s, grace 30 s, on a GKE Spot pool."""
    _gke_spot(bodies)
    elastic(bodies)["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    _env(1, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "20")(bodies)


def _markers_in_field(bodies: list[dict[str, Any]]) -> None:
    stable(bodies)["rayStartParams"] = {}
    stable(bodies)["resources"] = {"stable_gpu": "8", "stable_cpu": "16"}


def _duplicate_env(bodies: list[dict[str, Any]]) -> None:
    env = stable(bodies)["template"]["spec"]["containers"][0]["env"]
    env.append(dict(env[0]))


def _duplicate_port(bodies: list[dict[str, Any]]) -> None:
    ports = cluster(bodies)["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({"name": "gcs-again", "containerPort": 6379})


def _duplicate_group(bodies: list[dict[str, Any]]) -> None:
    groups = cluster(bodies)["workerGroupSpecs"]
    groups.append(copy.deepcopy(groups[1]))


def _no_shm(bodies: list[dict[str, Any]]) -> None:
    pod = elastic(bodies)["template"]["spec"]
    pod["containers"][0]["volumeMounts"] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] != "shm"]


def _shm_unsized(bodies: list[dict[str, Any]]) -> None:
    volumes = stable(bodies)["template"]["spec"]["volumes"]
    next(v for v in volumes if v["name"] == "shm")["emptyDir"] = {"medium": "Memory"}


def _secret_in_runtime_env(bodies: list[dict[str, Any]]) -> None:
    job = of_kind(bodies, "RayJob")["spec"]
    job["runtimeEnvYAML"] += "  WANDB_API_KEY: abc123\n"


def _literal_token(bodies: list[dict[str, Any]]) -> None:
    env = cluster(bodies)["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    env[0] = {"name": "RELAX_API_TOKEN", "value": "s3cret"}


def _pdbs(bodies: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {b["metadata"]["name"]: b for b in bodies if b["kind"] == "PodDisruptionBudget"}


def _no_pdb(bodies: list[dict[str, Any]]) -> None:
    bodies.remove(_pdbs(bodies)["relax-stable"])


def _no_head_pdb(bodies: list[dict[str, Any]]) -> None:
    bodies.remove(_pdbs(bodies)["relax-head"])


def _loose_pdb(bodies: list[dict[str, Any]]) -> None:
    _pdbs(bodies)["relax-stable"]["spec"]["minAvailable"] = 0


def _max_unavailable_pdb(bodies: list[dict[str, Any]]) -> None:
    spec = _pdbs(bodies)["relax-stable"]["spec"]
    spec.pop("minAvailable")
    spec["maxUnavailable"] = 0


def _entrypoint_with_cd(bodies: list[dict[str, Any]]) -> None:
    job = of_kind(bodies, "RayJob")["spec"]
    job["entrypoint"] = "cd /opt/relax && bash scripts/entrypoint/ray-job.sh " + job["entrypoint"].split()[-1]


def _job(**spec: Any) -> Callable[[list[dict[str, Any]]], None]:
    def change(bodies: list[dict[str, Any]]) -> None:
        job = of_kind(bodies, "RayJob")["spec"]
        for key, value in spec.items():
            if value is None:
                job.pop(key, None)
            else:
                job[key] = value
    return change


def _name(kind: str, name: str) -> Callable[[list[dict[str, Any]]], None]:
    def change(bodies: list[dict[str, Any]]) -> None:
        of_kind(bodies, kind)["metadata"]["name"] = name
    return change


CASES: list[tuple[str, Callable[[list[dict[str, Any]]], None], Rule]] = [
    ("unknown field (a typo)", _set("workerGroupSpecs.1.maxReplica", 4), Rule.SCHEMA),
    ("wrong type", _set("workerGroupSpecs.1.minReplicas", "0"), Rule.SCHEMA),
    ("value outside the enum", _set("autoscalerOptions.version", "v3"), Rule.SCHEMA),
    ("int32 out of range", _set("workerGroupSpecs.1.maxReplicas", 2**31), Rule.SCHEMA),
    ("unknown ObjectMeta field in a template", _set("workerGroupSpecs.1.template.metadata", {"label": {}}),
     Rule.SCHEMA),
    ("missing required field", lambda b: elastic(b).pop("template"), Rule.SCHEMA),
    ("a quantity that is not one", _set("workerGroupSpecs.1.template.spec.containers.0.resources.limits.cpu",
                                        "twelve"), Rule.SCHEMA),
    ("env name twice", _duplicate_env, Rule.LIST_MAP_KEY),
    ("containerPort/protocol twice (protocol defaulted)", _duplicate_port, Rule.LIST_MAP_KEY),
    ("groupName twice", _duplicate_group, Rule.GROUPS),
    ("a group without a container", _set("workerGroupSpecs.1.template.spec.containers", []), Rule.GROUPS),
    ("RayCluster name not DNS-1035", _name("RayCluster", "Relax_Cluster"), Rule.NAME),
    ("RayCluster name over 53", _name("RayCluster", "r" * 54), Rule.NAME),
    ("RayJob name over 47", _name("RayJob", "j" * 48), Rule.NAME),
    ("resources field beside num-cpus", lambda b: (stable(b).__setitem__("resources", {"CPU": "8"}),
                                                   stable(b)["rayStartParams"].__setitem__("num-cpus", "8")),
     Rule.RESOURCES_EXCLUSIVE),
    ("minReplicas above maxReplicas", _set("workerGroupSpecs.1.minReplicas", 5), Rule.REPLICAS),
    ("replicas above maxReplicas", _set("workerGroupSpecs.1.replicas", 5), Rule.REPLICAS),
    ("restartPolicy OnFailure with autoscaler v2", _set("workerGroupSpecs.1.template.spec.restartPolicy",
                                                        "OnFailure"), Rule.RESTART_POLICY),
    ("token auth off", _set("authOptions", {"mode": "disabled"}), Rule.TOKEN_AUTH),
    ("token auth on a Ray too old for it", _set("rayVersion", "2.50.0"), Rule.TOKEN_AUTH),
    ("RayJob with both cluster spec and selector", _job(rayClusterSpec={}), Rule.RAYJOB),
    ("RayJob with neither", _job(clusterSelector=None), Rule.RAYJOB),
    ("clusterSelector without ray.io/cluster", _job(clusterSelector={"app": "relax"}), Rule.RAYJOB),
    ("clusterSelector naming a cluster not in the set", _job(clusterSelector={"ray.io/cluster": "other"}),
     Rule.RAYJOB),
    ("ttlSecondsAfterFinished without shutdownAfterJobFinishes", _job(ttlSecondsAfterFinished=60), Rule.RAYJOB),
    ("markers on the autoscaled group", _set("workerGroupSpecs.1.rayStartParams",
                                             {"resources": "'{\"stable_gpu\": 1, \"stable_cpu\": 1}'"}),
     Rule.MARKER_PLACEMENT),
    ("markers on the head", _set("headGroupSpec.rayStartParams",
                                 {"num-cpus": "0", "resources": "'{\"stable_gpu\": 8, \"stable_cpu\": 16}'"}),
     Rule.MARKER_PLACEMENT),
    ("bare JSON markers (bash splits them)", _set("workerGroupSpecs.0.rayStartParams",
                                                  {"resources": '{"stable_gpu": 8, "stable_cpu": 16}'}),
     Rule.MARKER_QUOTING),
    ("Ray docs' escaped form", _set("workerGroupSpecs.0.rayStartParams",
                                    {"resources": '"{\\"stable_gpu\\": 8, \\"stable_cpu\\": 16}"'}),
     Rule.MARKER_QUOTING),
    ("fractional marker amounts", _set("workerGroupSpecs.0.rayStartParams",
                                       {"resources": "'{\"stable_gpu\": 8.0, \"stable_cpu\": 16}'"}),
     Rule.MARKER_QUOTING),
    ("a *gpu marker in the group's resources field", _markers_in_field, Rule.GPU_KEY_IN_RESOURCES),
    ("the old GKE advice on a Spot pool (drain 20 s, grace 30 s)", _old_gke_advice, Rule.DRAIN_GRACE),
    ("drain as long as the pod's own grace", _env(1, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "60"),
     Rule.DRAIN_GRACE),
    ("Ray's default 30 s drain in Kubernetes' default 30 s grace",
     lambda b: (elastic(b)["template"]["spec"].pop("terminationGracePeriodSeconds"),
                elastic(b)["template"]["spec"]["containers"][0].pop("env")), Rule.DRAIN_GRACE),
    ("no /dev/shm mount", _no_shm, Rule.SHM),
    ("/dev/shm without a sizeLimit", _shm_unsized, Rule.SHM),
    ("a secret in runtimeEnvYAML", _secret_in_runtime_env, Rule.SECRETS),
    ("a token written into the head's env", _literal_token, Rule.SECRETS),
    ("no PodDisruptionBudget over the stable group", _no_pdb, Rule.STABLE_PDB),
    ("no PodDisruptionBudget over the head", _no_head_pdb, Rule.STABLE_PDB),
    ("a PodDisruptionBudget that allows an eviction", _loose_pdb, Rule.STABLE_PDB),
    ("a PodDisruptionBudget with maxUnavailable", _max_unavailable_pdb, Rule.STABLE_PDB),
    ("an entrypoint of two commands", _entrypoint_with_cd, Rule.RAYJOB),
    ("clusterSelector with backoffLimit", _job(backoffLimit=2), Rule.RAYJOB),
    ("idleTimeoutSeconds without autoscaler v2", _set("autoscalerOptions.version", "v1"), Rule.REPLICAS),
    ("an AWS secret in runtimeEnvYAML", lambda b: of_kind(b, "RayJob")["spec"].__setitem__(
        "runtimeEnvYAML", "env_vars:\n  AWS_SECRET_ACCESS_KEY: x\n"), Rule.SECRETS),
]


@pytest.mark.parametrize(("what", "change", "rule"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_names_what_breaks_it(what: str, change, rule: Rule) -> None:
    bodies = base_bodies()
    change(bodies)
    findings = check_documents(documents(bodies))
    assert rule in {f.rule for f in findings}, [f.line() for f in findings]
    for finding in findings:  # one line each, naming the object and the field
        assert "\n" not in finding.line()
        assert finding.where.startswith(("RayCluster/", "RayJob/", "PodDisruptionBudget/"))


def test_every_rule_has_a_negative_case() -> None:
    covered = {rule for _, _, rule in CASES} | {Rule.PLAN_FIT, Rule.ELASTIC_CAPACITY}
    assert covered == set(Rule)


# --------------------------------------------------------------------------------------------------
# The plan's rules


def test_what_kuberay_accepts_is_not_flagged() -> None:
    bodies = base_bodies()
    elastic(bodies)["rayStartParams"] = {}
    elastic(bodies)["resources"] = {"cpu": "12", "gpu": "1"}  # lower-case keys: the operator lowercases them
    for where in ("limits", "requests"):
        elastic(bodies)["template"]["spec"]["containers"][0]["resources"][where].pop("nvidia.com/gpu")
    of_kind(bodies, "RayJob")["spec"]["runtimeEnvYAML"] += "  TOKENIZERS_PARALLELISM_X: \"false\"\n"
    of_kind(bodies, "RayJob")["spec"]["entrypoint"] = "bash -c 'cd /opt/relax && exec bash run.sh'"
    assert check_documents(documents(bodies), plan=recipe_plan()) == []
    assert cluster_groups(cluster(bodies))[2].cpus == 12.0


def test_elastic_group_must_hold_exactly_the_autoscaler_headroom() -> None:
    plan = recipe_plan()
    bodies = base_bodies()
    elastic(bodies)["maxReplicas"] = 6
    assert rules_found(bodies, plan) == {Rule.ELASTIC_CAPACITY}
    elastic(bodies)["maxReplicas"] = 2
    findings = check_documents(documents(bodies), plan=plan)
    assert {f.rule for f in findings} == {Rule.PLAN_FIT}
    assert "may add 4 engine(s)" in findings[0].message and "hold 2" in findings[0].message


def test_a_cluster_without_markers_misses_them_in_the_live_checks_words() -> None:
    bodies = base_bodies()
    stable(bodies)["rayStartParams"] = {}
    findings = [f for f in check_documents(documents(bodies), plan=recipe_plan()) if f.rule is Rule.PLAN_FIT]
    assert len(findings) == 1
    assert "needs the marker resources stable_gpu, stable_cpu" in findings[0].message


def test_a_marker_in_the_resources_field_never_reaches_ray() -> None:
    bodies = base_bodies()
    _markers_in_field(bodies)
    groups = cluster_groups(cluster(bodies))
    assert groups[1].gpus == 8 and "stable_gpu" not in groups[1].custom  # turned into --num-gpus
    assert groups[1].custom == {"stable_cpu": 16.0}
    fit = [f for f in check_documents(documents(bodies), plan=recipe_plan()) if f.rule is Rule.PLAN_FIT]
    assert ["needs the marker resources stable_gpu " in f.message for f in fit] == [True]


def test_too_few_gpus_at_start() -> None:
    bodies = base_bodies()
    for where in ("limits", "requests"):
        stable(bodies)["template"]["spec"]["containers"][0]["resources"][where]["nvidia.com/gpu"] = "4"
    messages = [f.message for f in check_documents(documents(bodies), plan=recipe_plan()) if f.rule is Rule.PLAN_FIT]
    assert any("the cluster has 4 GPUs but the baseline needs 8" in m for m in messages)


def test_another_node_group_prefix_is_read_from_the_plan() -> None:
    bodies = base_bodies()
    plan = driver_plan(parse_args(recipe_qwen3_4b_args(AUTOSCALER)), env={"RELAX_INITIAL_NODE_GROUP": "baseline"})
    messages = [f.message for f in check_documents(documents(bodies), node_group="baseline", plan=plan)]
    assert any("baseline_gpu, baseline_cpu" in m for m in messages)


# --------------------------------------------------------------------------------------------------
# The pieces


def test_resources_at_start_count_the_starting_pods_as_the_operator_derives_them() -> None:
    groups = cluster_groups(cluster(base_bodies()))
    assert [(g.name, g.replicas, g.gpus, g.cpus) for g in groups] == [
        ("head", 1, 0.0, 0.0), ("stable", 1, 8.0, 96.0), ("elastic", 0, 1.0, 12.0)]
    assert resources_at_start(groups) == {"CPU": 96.0, "GPU": 8.0, "stable_gpu": 8.0, "stable_cpu": 16.0}


@pytest.mark.parametrize(("text", "markers", "problem"), [
    ("'{\"stable_gpu\": 8, \"stable_cpu\": 16}'", {"stable_gpu": 8, "stable_cpu": 16}, None),
    ('{"stable_gpu": 8}', {}, "bash splits bare JSON"),
    ("'{\"stable_gpu\": 8'", {}, "not JSON"),
    ("'[1, 2]'", {}, "JSON object"),
    ("'{\"stable_gpu\": true}'", {}, "whole number"),
    ("'{\"stable_gpu\": -1}'", {}, "whole number"),
    ("'{\"a\": 1, \"b'\": 2}'", {}, "quote inside"),
])
def test_start_resources_are_read_as_the_operator_reads_them(text: str, markers: dict, problem: str | None) -> None:
    parsed = parse_start_resources(text)
    assert parsed.markers == markers
    assert (parsed.problem is None) if problem is None else (problem in (parsed.problem or ""))


@pytest.mark.parametrize(("text", "value"), [("500m", 0.5), ("8", 8.0), (4, 4.0), ("16Gi", 16 * 2**30),
                                             ("x", None), (True, None), ("", None)])
def test_quantities(text: object, value: float | None) -> None:
    assert quantity(text) == value


@pytest.mark.parametrize(("selector", "annotations", "own", "drain", "effective", "ok"), [
    ({}, {}, 60, "45", 60, True),                                           # on-demand: the pod's own grace
    ({"cloud.google.com/gke-spot": "true"}, {}, 15, "10", 15, True),        # GKE Spot overlay
    ({"cloud.google.com/gke-spot": "true"}, {}, 30, "20", 15, False),       # the old advice: 15 s really
    ({"cloud.google.com/gke-spot": "true"}, {"relax.io/platform-grace-seconds": "120"}, 120, "100", 120, True),
    ({"karpenter.sh/capacity-type": "spot"}, {}, 100, "80", 100, True),     # EKS: the pod's own grace
    ({"karpenter.sh/capacity-type": "spot"}, {}, 300, "250", 110, False),   # the instance is gone at 120 s
    ({"eks.amazonaws.com/capacityType": "SPOT"}, {}, 60, "45", 60, True),
    ({}, {}, None, None, 30, False),                                        # 30 s drain in 30 s: no room
])
def test_pod_grace(selector, annotations, own, drain, effective, ok) -> None:
    template: dict[str, Any] = {"metadata": {"annotations": annotations}, "spec": {"nodeSelector": selector}}
    if own is not None:
        template["spec"]["terminationGracePeriodSeconds"] = own
    container = {"env": [{"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": drain}]} if drain else {}
    grace = pod_grace(template, container)
    assert (grace.effective_s, grace.ok) == (effective, ok)


def test_spot_through_node_affinity_counts_too() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}]}]}}}
    grace = pod_grace({"spec": {"affinity": affinity, "terminationGracePeriodSeconds": 30}}, {})
    assert grace.effective_s == 15


@pytest.mark.parametrize(("text", "expected"), [
    ("kind: RayCluster\n", "needs apiVersion and kind"),
    ("apiVersion: v1\nkind: [\n", "not valid YAML at line"),
    ("", "holds no Kubernetes objects"),
    ("- a\n- b\n", "is not a Kubernetes object"),
])
def test_unreadable_manifests_are_one_line(text: str, expected: str) -> None:
    with pytest.raises(ManifestError) as raised:
        parse_documents(text, "m.yaml")
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    json.dumps(str(raised.value))
