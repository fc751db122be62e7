"""Every rule a Relax manifest is checked against, beyond what ``schema`` checks.

Three kinds, all pure (a list of documents in, findings out):

- **KubeRay's own**, which it checks in Go and no schema says (``ray-operator/controllers/ray/utils/
  validation.go``): a group's ``resources`` field excludes the resource start parameters, ``minReplicas`` <=
  ``maxReplicas``, autoscaler v2 wants ``restartPolicy`` unset or ``Never``, token auth needs Ray >= 2.52.0, a
  RayJob has a cluster spec or a selector; and what the API server checks: names, unique list-map keys.
- **The recipe's**: node-group markers only on a fixed worker group, as single-quoted JSON in
  ``rayStartParams.resources``, never a ``*gpu`` key in a ``resources`` field; drain shorter than the grace the
  platform gives; ``/dev/shm`` sized; secrets from a Secret; a PodDisruptionBudget over the stable group.
- **The plan's** (given a plan): the baseline fits at start, and the unmarked autoscaled groups hold exactly
  the engines the autoscaler may add.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from relax.cluster.kuberay.documents import Document
from relax.cluster.kuberay.findings import Finding, Rule
from relax.cluster.kuberay.fit import elastic_groups, plan_fit
from relax.cluster.kuberay.grace import pod_grace
from relax.cluster.kuberay.groups import GPU_LIMIT_SUFFIX, RayGroup, cluster_groups
from relax.cluster.kuberay.schema import API_VERSION, kind_schema, list_map_keys, schema_errors
from relax.config.plan import Plan

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# KubeRay derives Service and pod names from these, hence its limits below the label's 63.
NAME_LIMITS = {"RayCluster": 53, "RayJob": 47}
START_PARAMS_EXCLUSIVE = ("num-cpus", "num-gpus", "memory", "resources")
TOKEN_AUTH_MIN_RAY = (2, 52, 0)
# A name with one of these words between underscores (not TOKENIZERS_PARALLELISM): WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, RELAX_API_TOKEN, HF_TOKEN ...
SECRET_NAMES = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|KEY)(_|$)")
# Words of a shell line: KubeRay pastes an entrypoint unquoted into the submitter's `bash -c "ray job submit ... --
# <entrypoint>"`, so these split it and run the rest in the submitter pod.
SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")"})
SHM_PATH = "/dev/shm"
PDB_KIND = "PodDisruptionBudget"


def check_documents(documents: list[Document], node_group: str = "stable", plan: Plan | None = None) -> list[Finding]:
    """Every finding for a set of manifests deployed together (an overlay's rendering, say)."""
    findings: list[Finding] = []
    clusters = [d for d in documents if d.kind == "RayCluster"]
    pdbs = [d for d in documents if d.kind == PDB_KIND]
    for document in documents:
        findings += _names(document)
        if document.kind in ("RayCluster", "RayJob"):
            findings += _schema(document)
        if document.kind == "RayCluster":
            findings += _cluster(document, document.body.get("spec") or {}, "spec", node_group, plan, pdbs)
        elif document.kind == "RayJob":
            findings += _rayjob(document, clusters, node_group, plan, pdbs)
    return findings


def _finding(rule: Rule, document: Document, path: str, message: str) -> Finding:
    return Finding(rule, f"{document.label}: {path}" if path else document.label, message)


def _names(document: Document) -> Iterator[Finding]:
    name, kind = document.name, document.kind
    if not name:
        yield _finding(Rule.NAME, document, "metadata.name", "has no name")
        return
    if kind in NAME_LIMITS:
        if not DNS_1035.match(name):
            yield _finding(Rule.NAME, document, "metadata.name",
                           f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', starting with a "
                           "letter, ending with a letter or digit)")
        if len(name) > NAME_LIMITS[kind]:
            yield _finding(Rule.NAME, document, "metadata.name",
                           f"{name!r} has {len(name)} characters; KubeRay allows at most {NAME_LIMITS[kind]} for a "
                           f"{kind}")
    elif not DNS_1123_SUBDOMAIN.match(name) or len(name) > 253:
        yield _finding(Rule.NAME, document, "metadata.name", f"{name!r} is not a DNS-1123 subdomain")


def _schema(document: Document) -> Iterator[Finding]:
    if document.body.get("apiVersion") != API_VERSION:
        yield _finding(Rule.SCHEMA, document, "apiVersion",
                       f"{document.body.get('apiVersion')!r}: use {API_VERSION} (v1alpha1 is deprecated)")
        return
    for path, message in schema_errors(document.body):
        yield _finding(Rule.SCHEMA, document, path, message)
    for path, message in list_map_keys(kind_schema(document.kind), document.body):
        yield _finding(Rule.LIST_MAP_KEY, document, path, message)


# --------------------------------------------------------------------------------------------------
# A RayCluster's spec (also a RayJob's rayClusterSpec)


def _cluster(document: Document, spec: Mapping[str, Any], prefix: str, node_group: str, plan: Plan | None,
             pdbs: list[Document]) -> list[Finding]:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("headGroupSpec"), Mapping):
        return []  # the schema says what is missing
    groups = cluster_groups(spec)
    found: list[Finding] = []
    found += _auth(document, spec, prefix)
    found += _group_names(document, groups, prefix)
    v2 = bool(spec.get("enableInTreeAutoscaling")) and (spec.get("autoscalerOptions") or {}).get("version") == "v2"
    markers = (f"{node_group}_gpu", f"{node_group}_cpu")
    for group in groups:
        where = f"{prefix}.{group.where.removeprefix('spec.')}"
        found += _group_resources(document, group, where)
        found += _markers(document, group, where, markers)
        if v2:
            found += _restart_policy(document, group, where)
        found += _secrets_in_containers(document, group.pod_spec, f"{where}.template.spec")
        if not group.is_head:
            if group.spec.get("idleTimeoutSeconds") is not None and not v2:
                found.append(_finding(Rule.REPLICAS, document, f"{where}.idleTimeoutSeconds",
                                      "a group's idleTimeoutSeconds needs autoscaler v2 (enableInTreeAutoscaling "
                                      "and autoscalerOptions.version: v2); KubeRay refuses it otherwise"))
            found += _replicas(document, group, where)
            found += _drain(document, group, where)
            found += _shm(document, group, where)
    cluster_name = document.name if document.kind == "RayCluster" else None
    if cluster_name is not None:
        found += _pdb(document, groups, markers, cluster_name, pdbs)
    if plan is not None:
        found += _plan(document, prefix, plan, groups)
    return found


def _group_names(document: Document, groups: list[RayGroup], prefix: str) -> Iterator[Finding]:
    seen: set[str] = set()
    for group in groups:
        where = f"{prefix}.{group.where.removeprefix('spec.')}"
        if not group.is_head and group.name in seen:
            yield _finding(Rule.GROUPS, document, where, f"worker group name {group.name!r} is used twice; "
                           "worker group names must be unique (KubeRay names pods after them)")
        seen.add(group.name)
        if not group.ray_container:
            yield _finding(Rule.GROUPS, document, f"{where}.template.spec.containers",
                           "has no container; the first one runs Ray")


def _ray_version(text: object) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(part or 0) for part in match.groups()) if match else None


def _auth(document: Document, spec: Mapping[str, Any], prefix: str) -> Iterator[Finding]:
    mode = (spec.get("authOptions") or {}).get("mode")
    if mode != "token":
        yield _finding(Rule.TOKEN_AUTH, document, f"{prefix}.authOptions",
                       "Ray's token auth is off: set authOptions: {mode: token} (KubeRay then makes the token's "
                       "Secret and gives RAY_AUTH_TOKEN to every Ray container and the job submitter)")
        return
    version = _ray_version(spec.get("rayVersion"))
    if version is None or version < TOKEN_AUTH_MIN_RAY:
        yield _finding(Rule.TOKEN_AUTH, document, f"{prefix}.rayVersion",
                       f"token auth needs rayVersion >= 2.52.0, got {spec.get('rayVersion')!r} (KubeRay refuses it)")


def _group_resources(document: Document, group: RayGroup, where: str) -> Iterator[Finding]:
    field_resources = group.spec.get("resources") or {}
    if not isinstance(field_resources, Mapping) or not field_resources:
        return
    params = group.spec.get("rayStartParams") or {}
    clash = [name for name in START_PARAMS_EXCLUSIVE if name in params]
    if clash:
        yield _finding(Rule.RESOURCES_EXCLUSIVE, document, f"{where}.resources",
                       f"the group's resources field and rayStartParams {', '.join(clash)} exclude each other "
                       "(KubeRay refuses the cluster); keep one")
    for key in field_resources:
        if str(key).lower().endswith(GPU_LIMIT_SUFFIX) and str(key).lower() != "gpu":
            yield _finding(Rule.GPU_KEY_IN_RESOURCES, document, f"{where}.resources.{key}",
                           f"KubeRay turns every key ending in 'gpu' in a group's resources field into --num-gpus, "
                           f"so {key!r} never reaches Ray; put markers in rayStartParams.resources as "
                           f"'{{\"{key}\": {field_resources[key]}}}' and GPUs in the container's limits")


def _markers(document: Document, group: RayGroup, where: str, markers: tuple[str, ...]) -> Iterator[Finding]:
    if group.start_resources is not None and group.start_resources.problem:
        yield _finding(Rule.MARKER_QUOTING, document, f"{where}.rayStartParams.resources",
                       group.start_resources.problem)
    field_keys = set((group.spec.get("resources") or {}) if isinstance(group.spec.get("resources"), Mapping) else ())
    declared = sorted(m for m in markers if m in group.custom or m in field_keys)
    if not declared:
        return
    if group.is_head or not group.fixed:
        what = "the head" if group.is_head else (f"group {group.name!r}, which the autoscaler resizes "
                                                 f"({group.min_replicas}..{group.max_replicas})")
        yield _finding(Rule.MARKER_PLACEMENT, document, f"{where}.rayStartParams.resources",
                       f"node-group markers {', '.join(declared)} are on {what}; put them only on the fixed stable "
                       "worker group (replicas = minReplicas = maxReplicas) so the baseline never lands on "
                       "capacity that is scaled in or reclaimed")
    in_field = sorted(m for m in markers if m in field_keys and not m.lower().endswith(GPU_LIMIT_SUFFIX))
    if in_field:
        yield _finding(Rule.MARKER_QUOTING, document, f"{where}.resources",
                       f"markers {', '.join(in_field)} belong in rayStartParams.resources (single-quoted JSON), "
                       "where the autoscaler and the plan read them")


def _restart_policy(document: Document, group: RayGroup, where: str) -> Iterator[Finding]:
    policy = group.pod_spec.get("restartPolicy")
    if policy not in (None, "Never"):
        yield _finding(Rule.RESTART_POLICY, document, f"{where}.template.spec.restartPolicy",
                       f"{policy!r}: with autoscaler v2 every pod's restartPolicy must be unset or Never "
                       "(KubeRay refuses the cluster)")


def _replicas(document: Document, group: RayGroup, where: str) -> Iterator[Finding]:
    if group.min_replicas > group.max_replicas:
        yield _finding(Rule.REPLICAS, document, where,
                       f"minReplicas {group.min_replicas} is above maxReplicas {group.max_replicas}")
    elif not group.min_replicas <= group.replicas <= group.max_replicas:
        yield _finding(Rule.REPLICAS, document, f"{where}.replicas",
                       f"replicas {group.replicas} is outside minReplicas..maxReplicas "
                       f"({group.min_replicas}..{group.max_replicas}); KubeRay would clamp it: write the number "
                       "you mean (a fixed group: all three equal)")


def _drain(document: Document, group: RayGroup, where: str) -> Iterator[Finding]:
    grace = pod_grace(group.spec.get("template") or {}, group.ray_container)
    if not grace.ok:
        yield _finding(Rule.DRAIN_GRACE, document, f"{where}.template.spec",
                       f"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S {grace.drain_s:g} s must be below the grace the pod "
                       f"really gets ({grace.effective_s:g} s: {grace.platform}), which must not exceed "
                       f"terminationGracePeriodSeconds ({grace.pod_grace_s} s); otherwise the pod is killed "
                       "before Relax has moved its work")


def _shm(document: Document, group: RayGroup, where: str) -> Iterator[Finding]:
    mounts = {m.get("name"): m for m in group.ray_container.get("volumeMounts") or [] if isinstance(m, Mapping)}
    volumes = {v.get("name"): v for v in group.pod_spec.get("volumes") or [] if isinstance(v, Mapping)}
    for name, mount in mounts.items():
        if mount.get("mountPath") == SHM_PATH:
            empty = (volumes.get(name) or {}).get("emptyDir") or {}
            if empty.get("medium") == "Memory" and empty.get("sizeLimit"):
                return
    yield _finding(Rule.SHM, document, f"{where}.template.spec",
                   "mount an emptyDir {medium: Memory, sizeLimit: ...} at /dev/shm in the Ray container: SGLang "
                   "and NCCL live there, and its size is counted against the pod's memory")


def _secret_env(entry: Mapping[str, Any]) -> bool:
    return bool(SECRET_NAMES.search(str(entry.get("name", "")))) and "value" in entry


def _secrets_in_containers(document: Document, pod_spec: Mapping[str, Any], where: str) -> Iterator[Finding]:
    for kind in ("initContainers", "containers"):
        for c_index, container in enumerate(pod_spec.get(kind) or []):
            for e_index, entry in enumerate((container or {}).get("env") or []):
                if isinstance(entry, Mapping) and _secret_env(entry):
                    yield _finding(Rule.SECRETS, document, f"{where}.{kind}[{c_index}].env[{e_index}]",
                                   f"{entry.get('name')} is written in the manifest; take it from a Secret "
                                   "(valueFrom.secretKeyRef)")


def _pdb_blocks(pdb: Document, labels: Mapping[str, str], replicas: int) -> bool:
    """Whether ``pdb`` selects pods with ``labels`` and keeps all ``replicas`` of them from voluntary eviction."""
    spec = pdb.body.get("spec") or {}
    wanted = (spec.get("selector") or {}).get("matchLabels") or {}
    minimum = spec.get("minAvailable")
    return (bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())
            and isinstance(minimum, int) and not isinstance(minimum, bool) and minimum >= replicas)


def _pdb(document: Document, groups: list[RayGroup], markers: tuple[str, ...], cluster: str,
         pdbs: list[Document]) -> Iterator[Finding]:
    for pdb in pdbs:
        if "maxUnavailable" in (pdb.body.get("spec") or {}):
            yield _finding(Rule.STABLE_PDB, pdb, "spec.maxUnavailable",
                           "a RayCluster has no scale subresource, so a budget over its pods may only use an "
                           "integer minAvailable (with maxUnavailable the disruption controller cannot count the "
                           "pods); write minAvailable: <pods>")
    for group in groups:
        if not group.is_head and not any(m in group.custom for m in markers):
            continue  # the head (the driver) and the stable group must stay; elastic pods may go
        role = {"ray.io/node-type": "head"} if group.is_head else {"ray.io/group": group.name,
                                                                   "ray.io/node-type": "worker"}
        labels = {"ray.io/cluster": cluster, **role,
                  **((group.spec.get("template") or {}).get("metadata") or {}).get("labels", {})}
        if not any(_pdb_blocks(pdb, labels, group.replicas) for pdb in pdbs):
            what = "the head (it runs the driver)" if group.is_head else f"the stable group {group.name!r}"
            select = ", ".join(f"{k}: {v}" for k, v in {"ray.io/cluster": cluster, **role}.items()
                               if k != "ray.io/node-type" or group.is_head)
            yield _finding(Rule.STABLE_PDB, document, group.where,
                           f"no PodDisruptionBudget keeps voluntary evictions off {what}: add one selecting "
                           f"{select} with minAvailable: {group.replicas} (KubeRay makes none)")


def _plan(document: Document, prefix: str, plan: Plan, groups: list[RayGroup]) -> Iterator[Finding]:
    fit = plan_fit(plan, groups)
    for problem in fit.problems:
        yield _finding(Rule.PLAN_FIT, document, prefix, problem)
    if plan.autoscaler is not None and fit.fits and fit.elastic_engines != plan.headroom_engines:
        shown = ", ".join(f"{g.name!r} {g.added_pods} pod(s) x {g.engines_per_pod}"
                          for g in elastic_groups(plan, groups))
        yield _finding(Rule.ELASTIC_CAPACITY, document, prefix,
                       f"the unmarked autoscaled groups hold {fit.elastic_engines} engine(s) ({shown}) but the "
                       f"autoscaler adds at most {plan.headroom_engines} (max_engines {plan.max_engines} - "
                       f"{plan.engine_floor} initial): set maxReplicas so they match (extra pods are quota the "
                       "run never uses)")


# --------------------------------------------------------------------------------------------------
# RayJob


def _rayjob(document: Document, clusters: list[Document], node_group: str, plan: Plan | None,
            pdbs: list[Document]) -> list[Finding]:
    spec = document.body.get("spec") or {}
    if not isinstance(spec, Mapping):
        return []
    found: list[Finding] = []
    has_spec, selector = "rayClusterSpec" in spec, spec.get("clusterSelector")
    if has_spec == bool(selector):
        found.append(_finding(Rule.RAYJOB, document, "spec",
                              "give either rayClusterSpec (a cluster for this job) or clusterSelector (an existing "
                              "RayCluster): with both KubeRay ignores rayClusterSpec, with neither it has no cluster"))
    if selector and (spec.get("submissionMode") == "SidecarMode" or (spec.get("backoffLimit") or 0) > 0):
        found.append(_finding(Rule.RAYJOB, document, "spec.clusterSelector",
                              "a RayJob on an existing cluster (clusterSelector) cannot use SidecarMode or "
                              "backoffLimit > 0 (KubeRay refuses it)"))
    found += _entrypoint(document, spec)
    if selector is not None and "ray.io/cluster" not in (selector or {}):
        found.append(_finding(Rule.RAYJOB, document, "spec.clusterSelector",
                              "clusterSelector needs the key ray.io/cluster: <RayCluster name>"))
    target = (selector or {}).get("ray.io/cluster")
    if target and clusters and target not in {c.name for c in clusters}:
        found.append(_finding(Rule.RAYJOB, document, "spec.clusterSelector",
                              f"names RayCluster {target!r}, which is not among these manifests "
                              f"({', '.join(sorted(c.name for c in clusters))})"))
    ttl = spec.get("ttlSecondsAfterFinished")
    if isinstance(ttl, int) and ttl > 0 and not spec.get("shutdownAfterJobFinishes"):
        found.append(_finding(Rule.RAYJOB, document, "spec.ttlSecondsAfterFinished",
                              "ttlSecondsAfterFinished > 0 needs shutdownAfterJobFinishes: true"))
    found += _runtime_env_secrets(document, spec.get("runtimeEnvYAML"))
    submitter = (spec.get("submitterPodTemplate") or {}).get("spec") or {}
    found += _secrets_in_containers(document, submitter, "spec.submitterPodTemplate.spec")
    if has_spec:
        found += _cluster(document, spec["rayClusterSpec"], "spec.rayClusterSpec", node_group, plan, pdbs)
    return found


def _entrypoint(document: Document, spec: Mapping[str, Any]) -> Iterator[Finding]:
    text = spec.get("entrypoint")
    if not isinstance(text, str) or spec.get("submissionMode", "K8sJobMode") != "K8sJobMode":
        return
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError as error:
        yield _finding(Rule.RAYJOB, document, "spec.entrypoint", f"is not one shell command ({error})")
        return
    operators = sorted({w for w in words if w in SHELL_OPERATORS})
    if operators:
        yield _finding(Rule.RAYJOB, document, "spec.entrypoint",
                       f"holds {' '.join(operators)}: KubeRay pastes the entrypoint unquoted after `ray job submit "
                       "... --` in the submitter's bash, so only what comes before it runs as the Ray job and the "
                       "rest runs in the submitter pod; make it one command (settings in runtimeEnvYAML env_vars, "
                       "absolute paths, or bash -c '...')")


def _runtime_env_secrets(document: Document, text: object) -> Iterator[Finding]:
    if not isinstance(text, str):
        return
    try:
        env = yaml.safe_load(text)
    except yaml.YAMLError:
        yield _finding(Rule.RAYJOB, document, "spec.runtimeEnvYAML", "is not valid YAML")
        return
    env_vars = (env or {}).get("env_vars") if isinstance(env, Mapping) else None
    for name in (env_vars or {}) if isinstance(env_vars, Mapping) else ():
        if SECRET_NAMES.search(str(name)):
            yield _finding(Rule.SECRETS, document, f"spec.runtimeEnvYAML.env_vars.{name}",
                           f"{name} would be stored in clear in the RayJob; give it to the head container from a "
                           "Secret (valueFrom.secretKeyRef): the driver runs there and inherits it")
