"""The resource plan: who gets which GPUs, which placement-group bundles, how big a step is.

Pure on purpose (docs/architecture.md, "Where decisions live"): ``build_plan`` takes the parsed flags,
the environment as a mapping and the autoscaler bounds as an object, and returns a frozen ``Plan``; it
touches no files, no Ray, no ``os.environ``. The driver checks the plan against ``ray.cluster_resources()`` with
``validate_plan_against_cluster`` *before* it creates anything, and ``--dry-run`` prints
``format_plan``. The autoscaler YAML is the driver's to load (``relax.autoscaler.config.load_autoscaler_config``,
the full model); the only impure helper here is ``validate_paths`` (file existence, injectable).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from relax.config.checks import is_loopback_host
from relax.config.flags import ConfigError, TrainArgs

NODE_GROUP_ENV = "RELAX_INITIAL_NODE_GROUP"
DEFAULT_NODE_GROUP = "stable"
ENABLE_AFFINITY_ENV = "ENABLE_AFFINITY"
# Control-plane actors ask for a sliver of the {G}_cpu marker: enough to pin them to the stable
# group, small enough that they fit beside the baseline bundles that take {G}_cpu: 1 each.
CONTROL_PLANE_MARKER_AMOUNT = 0.01
PLACEMENT_STRATEGY = "PACK"
RESOURCE_EXAMPLE = '{"actor": [1, 4], "rollout": [1, 4]}'
REQUIRED_ROLES = ("actor", "rollout")
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_NODE_GROUP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class AutoscalerBoundsLike(Protocol):
    """What the plan needs from an autoscaler config; the full pydantic model satisfies it."""

    @property
    def enabled(self) -> bool: ...

    @property
    def min_engines(self) -> int: ...

    @property
    def max_engines(self) -> int: ...


@dataclass(frozen=True)
class AutoscalerBounds:
    """Minimal autoscaler config: the engine bounds and whether the autoscaler starts on."""

    enabled: bool
    min_engines: int
    max_engines: int


class AffinityStatus(Enum):
    """Whether baseline bundles carry node-group markers, and if not, why not."""

    ON = "on"
    OFF_BY_FLAG = "off (--no-enable-affinity)"
    OFF_BY_ENV = "off (ENABLE_AFFINITY=0)"
    NOT_NEEDED = "off (autoscaler not enabled)"


@dataclass(frozen=True)
class ResourceSpec:
    """The baseline GPU counts from ``--resource`` (or the slime-style flags)."""

    actor_gpus: int
    rollout_gpus: int
    ignored_roles: tuple[str, ...] = ()


@dataclass(frozen=True)
class Bundle:
    """One placement-group bundle: ``{GPU, CPU}`` plus node-group marker resources."""

    gpu: float = 1.0
    cpu: float = 1.0
    markers: tuple[tuple[str, float], ...] = ()

    def to_ray(self) -> dict[str, float]:
        """The dict Ray's ``placement_group(bundles=[...])`` takes."""
        return {"GPU": self.gpu, "CPU": self.cpu, **dict(self.markers)}


@dataclass(frozen=True)
class BatchGeometry:
    """Samples per rollout step and how the trainer cuts them into optimizer steps."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout: int
    global_batch_size: int
    optimizer_steps_per_rollout: int


@dataclass(frozen=True)
class Plan:
    """Everything the driver needs to place actors and size the run, decided before Ray is touched."""

    trainer_gpus: int
    rollout_gpus: int
    gpus_per_engine: int
    initial_engines: int
    trainer_bundles: tuple[Bundle, ...]
    # One bundle of all the engine's GPUs per engine: a bundle lives on one node, so the tensor-parallel ranks
    # share it, and an EngineActor holding every GPU of its bundle makes Ray show the server all of them.
    initial_engine_bundles: tuple[tuple[Bundle, ...], ...]  # one bundle list per initial engine
    elastic_engine_bundles: tuple[Bundle, ...]  # template for each scaled-out engine (no markers)
    placement_strategy: str
    affinity: AffinityStatus
    node_group: str | None  # set only when affinity is ON
    control_plane_resources: tuple[tuple[str, float], ...]  # custom resources for control-plane actors
    autoscaler: AutoscalerBounds | None
    engine_floor: int  # scale-in never goes below the initial engines
    max_engines: int | None  # autoscaler max_engines; None = no configured ceiling
    headroom_engines: int  # elastic engines beyond the initial ones the plan provisions for
    batch: BatchGeometry
    max_staleness: int
    num_rollout: int
    notes: tuple[str, ...] = ()
    rollout_backend: str = "auto"  # --rollout-backend as given; `auto` is decided on an engine's node at start
    sglang_python: str | None = None  # --sglang-python / RELAX_SGLANG_PYTHON; None = the engine's own interpreter
    api_host: str = "127.0.0.1"
    api_port: int = 8000

    @property
    def baseline_gpus(self) -> int:
        return self.trainer_gpus + self.rollout_gpus

    @property
    def headroom_gpus(self) -> int:
        return self.headroom_engines * self.gpus_per_engine

    @property
    def embedded_cluster_gpus(self) -> int:
        """Logical GPUs for an embedded cluster: the baseline plus room for every elastic engine."""
        return self.baseline_gpus + self.headroom_gpus

    @property
    def marker_resources(self) -> tuple[str, ...]:
        """Marker resource names the cluster must declare (empty when affinity is off)."""
        if self.node_group is None:
            return ()
        return (f"{self.node_group}_gpu", f"{self.node_group}_cpu")

    @property
    def baseline_bundles(self) -> tuple[Bundle, ...]:
        return self.trainer_bundles + tuple(b for engine in self.initial_engine_bundles for b in engine)

    @property
    def max_waiting_partitions(self) -> int:
        """Rollout steps that may wait for the trainer at once (docs/architecture.md, "Weights and staleness")."""
        return self.max_staleness + 1

    @property
    def total_optimizer_steps(self) -> int:
        return self.num_rollout * self.batch.optimizer_steps_per_rollout

    def control_plane_options(self) -> dict[str, float]:
        """``resources=`` for control-plane actors (ControlPlane, RolloutManager, ...)."""
        return dict(self.control_plane_resources)


# --------------------------------------------------------------------------------------------------
# --resource


def parse_resource(text: str) -> ResourceSpec:
    """Parse ``--resource '{"actor": [1, 4], "rollout": [1, 4]}'``; raises ConfigError."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"--resource is not valid JSON: {text!r} ({error.msg} at column {error.colno}); "
            f"use e.g. --resource '{RESOURCE_EXAMPLE}'"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--resource must be a JSON object of role: [replicas, gpus], got {text!r}; "
            f"e.g. --resource '{RESOURCE_EXAMPLE}'"
        )
    for role in REQUIRED_ROLES:
        if role not in data:
            raise ConfigError(
                f"--resource has no {role!r} role: {text!r}; give both roles, e.g. --resource '{RESOURCE_EXAMPLE}'"
            )
    gpus = {role: _role_gpus(role, value) for role, value in data.items()}
    for role in REQUIRED_ROLES:
        if gpus[role] <= 0:
            raise ConfigError(f"--resource role {role!r} needs a positive GPU count, got {gpus[role]}")
    extra = [role for role in data if role not in REQUIRED_ROLES]
    busy = [role for role in extra if gpus[role] > 0]
    if busy:
        raise ConfigError(
            f"--resource role {busy[0]!r} is not a Relax role (Relax has actor and rollout); "
            "remove it or give it 0 GPUs"
        )
    return ResourceSpec(gpus["actor"], gpus["rollout"], tuple(extra))


def _role_gpus(role: str, value: object) -> int:
    """Check one ``[replicas, gpus]`` entry and return its GPU count."""
    shape_ok = isinstance(value, list) and len(value) == 2
    if not shape_ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(
            f"--resource role {role!r} must be [replicas, gpus] with two integers, got {json.dumps(value)}"
        )
    replicas, gpus = value
    if replicas != 1:
        raise ConfigError(
            f"--resource role {role!r} has {replicas} replicas; replicas must be 1 "
            f"(the second number is the GPU count), e.g. \"{role}\": [1, {gpus}]"
        )
    if gpus < 0:
        raise ConfigError(f"--resource role {role!r} has a negative GPU count ({gpus})")
    return gpus


def resolve_resources(args: TrainArgs) -> ResourceSpec:
    """``--resource``, or the slime flags ``--actor-num-*``/``--rollout-num-gpus``; they must agree."""
    slime_actor = None
    if args.actor_num_gpus_per_node is not None:
        slime_actor = (args.actor_num_nodes or 1) * args.actor_num_gpus_per_node
    if args.resource is None:
        if slime_actor is None or args.rollout_num_gpus is None:
            raise ConfigError(
                f"no GPU counts given: pass --resource '{RESOURCE_EXAMPLE}' "
                "(or --actor-num-gpus-per-node N and --rollout-num-gpus N)"
            )
        return ResourceSpec(slime_actor, args.rollout_num_gpus)
    spec = parse_resource(args.resource)
    if slime_actor is not None and slime_actor != spec.actor_gpus:
        raise ConfigError(
            f"--actor-num-nodes × --actor-num-gpus-per-node = {slime_actor} GPUs disagrees with "
            f"--resource actor ({spec.actor_gpus} GPUs); drop one of them"
        )
    if args.rollout_num_gpus is not None and args.rollout_num_gpus != spec.rollout_gpus:
        raise ConfigError(
            f"--rollout-num-gpus {args.rollout_num_gpus} disagrees with --resource rollout "
            f"({spec.rollout_gpus} GPUs); drop one of them"
        )
    return spec


# --------------------------------------------------------------------------------------------------
# Autoscaler bounds


def check_engine_bounds(
    bounds: AutoscalerBoundsLike, initial_engines: int, source: str | None = None
) -> tuple[str, ...]:
    """Startup check: 1 <= min_engines <= initial <= max_engines. Returns notes.

    (docs/architecture.md, "Placement and eviction".)
    """
    where = f"--autoscaler-config {source}" if source else "autoscaler config"
    low, high = bounds.min_engines, bounds.max_engines
    if low < 1:
        raise ConfigError(f"{where}: min_engines must be at least 1, got {low}")
    if high < low:
        raise ConfigError(f"{where}: max_engines ({high}) is below min_engines ({low})")
    if low > initial_engines:
        raise ConfigError(
            f"{where}: min_engines ({low}) is above the {initial_engines} initial engines "
            "(rollout GPUs / --rollout-num-gpus-per-engine); lower min_engines or give rollout more GPUs "
            "in --resource"
        )
    if initial_engines > high:
        raise ConfigError(
            f"{where}: max_engines ({high}) is below the {initial_engines} initial engines; "
            "raise max_engines or give rollout fewer GPUs in --resource"
        )
    if low < initial_engines:
        return (
            f"autoscaler min_engines ({low}) is below the {initial_engines} initial engines; the effective "
            f"floor is {initial_engines} because initial engines are never scaled in",
        )
    return ()


# --------------------------------------------------------------------------------------------------
# Building the plan


def _affinity_status(
    args: TrainArgs, autoscaler: AutoscalerBoundsLike | None, env: Mapping[str, str]
) -> AffinityStatus:
    if autoscaler is None or not autoscaler.enabled:
        return AffinityStatus.NOT_NEEDED
    if not args.enable_affinity:
        return AffinityStatus.OFF_BY_FLAG
    if env.get(ENABLE_AFFINITY_ENV, "").strip().lower() in _FALSE_WORDS:
        return AffinityStatus.OFF_BY_ENV
    return AffinityStatus.ON


def node_group_name(env: Mapping[str, str]) -> str:
    """The marker prefix G of the stable group ({G}_gpu, {G}_cpu): RELAX_INITIAL_NODE_GROUP, else stable."""
    group = env.get(NODE_GROUP_ENV, "").strip() or DEFAULT_NODE_GROUP
    if not _NODE_GROUP_NAME.match(group):
        raise ConfigError(
            f"{NODE_GROUP_ENV}={group!r} is not a valid node-group name (letters, digits, '_' and '-'); "
            f"unset it to use {DEFAULT_NODE_GROUP!r}"
        )
    return group


def batch_geometry(args: TrainArgs) -> BatchGeometry:
    """Samples per rollout step and optimizer steps per rollout step; raises ConfigError."""
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    global_batch = args.global_batch_size or samples
    if samples % global_batch:
        divisor = max(d for d in range(1, min(global_batch, samples) + 1) if samples % d == 0)
        raise ConfigError(
            f"--global-batch-size {global_batch} does not divide the {samples} samples of a rollout step "
            f"(--rollout-batch-size {args.rollout_batch_size} × --n-samples-per-prompt "
            f"{args.n_samples_per_prompt}); use a divisor of {samples}, e.g. {divisor}"
        )
    return BatchGeometry(
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.n_samples_per_prompt,
        samples_per_rollout=samples,
        global_batch_size=global_batch,
        optimizer_steps_per_rollout=samples // global_batch,
    )


def _frozen_bounds(bounds: AutoscalerBoundsLike | None) -> AutoscalerBounds | None:
    if bounds is None:
        return None
    return AutoscalerBounds(bool(bounds.enabled), int(bounds.min_engines), int(bounds.max_engines))


def build_plan(
    args: TrainArgs,
    env: Mapping[str, str] | None = None,
    autoscaler: AutoscalerBoundsLike | None = None,
) -> Plan:
    """Build and validate the plan; raises ConfigError naming the flag to fix.

    ``env`` is the environment as a mapping (pass ``os.environ``); ``autoscaler`` is the loaded
    autoscaler config (the full model, ``relax.autoscaler.config.load_autoscaler_config``), required when
    ``--autoscaler-config`` is set.
    """
    env = env or {}
    if args.autoscaler_config is not None and autoscaler is None:
        raise ValueError("build_plan: --autoscaler-config is set; pass its loaded config as autoscaler=")
    if args.num_rollout is None:
        raise ConfigError("--num-rollout is required: the number of rollout steps to train, e.g. --num-rollout 100")
    resources = resolve_resources(args)
    per_engine = args.rollout_num_gpus_per_engine
    if resources.rollout_gpus % per_engine:
        raise ConfigError(
            f"rollout GPUs ({resources.rollout_gpus}) are not divisible by --rollout-num-gpus-per-engine "
            f"{per_engine}; make the rollout GPU count in --resource a multiple of {per_engine}"
        )
    initial = resources.rollout_gpus // per_engine
    notes: list[str] = [f"--resource role {role!r} has no GPUs and is ignored" for role in resources.ignored_roles]
    if autoscaler is not None:
        notes.extend(check_engine_bounds(autoscaler, initial, args.autoscaler_config))
        if not autoscaler.enabled:
            notes.append(
                "the autoscaler config says enabled: false; the autoscaler starts off "
                "(POST /autoscaler/enable turns it on) and the baseline is not pinned"
            )
    affinity = _affinity_status(args, autoscaler, env)
    group = node_group_name(env) if affinity is AffinityStatus.ON else None
    markers = ((f"{group}_gpu", 1.0), (f"{group}_cpu", 1.0)) if group else ()
    baseline = Bundle(markers=markers)
    engine_markers = ((f"{group}_gpu", float(per_engine)), (f"{group}_cpu", 1.0)) if group else ()
    engine_bundle = Bundle(gpu=float(per_engine), markers=engine_markers)
    batch = batch_geometry(args)
    if batch.global_batch_size % resources.actor_gpus:
        notes.append(
            f"global batch {batch.global_batch_size} does not split evenly over {resources.actor_gpus} trainer "
            "GPUs; ranks get unequal sample counts"
        )
    return Plan(
        trainer_gpus=resources.actor_gpus,
        rollout_gpus=resources.rollout_gpus,
        gpus_per_engine=per_engine,
        initial_engines=initial,
        trainer_bundles=(baseline,) * resources.actor_gpus,
        initial_engine_bundles=((engine_bundle,),) * initial,
        elastic_engine_bundles=(Bundle(gpu=float(per_engine)),),
        placement_strategy=PLACEMENT_STRATEGY,
        affinity=affinity,
        node_group=group,
        control_plane_resources=((f"{group}_cpu", CONTROL_PLANE_MARKER_AMOUNT),) if group else (),
        autoscaler=_frozen_bounds(autoscaler),
        engine_floor=initial,
        max_engines=autoscaler.max_engines if autoscaler is not None else None,
        headroom_engines=(autoscaler.max_engines - initial) if autoscaler is not None else initial,
        batch=batch,
        max_staleness=args.max_staleness,
        num_rollout=args.num_rollout,
        notes=tuple(notes),
        rollout_backend=args.rollout_backend,
        sglang_python=args.sglang_interpreter(env),
        api_host=args.api_host,
        api_port=args.api_port,
    )


# --------------------------------------------------------------------------------------------------
# Checks against the world


def validate_plan_against_cluster(plan: Plan, cluster_resources: Mapping[str, float]) -> list[str]:
    """Human messages for what the cluster lacks (empty list = the baseline fits).

    ``cluster_resources`` is ``ray.cluster_resources()``. Checked before anything is created so a
    missing marker fails fast instead of leaving placement groups pending forever.
    """
    problems: list[str] = []
    gpus = float(cluster_resources.get("GPU", 0.0))
    if gpus < plan.baseline_gpus:
        problems.append(
            f"the cluster has {gpus:g} GPUs but the baseline needs {plan.baseline_gpus} "
            f"({plan.trainer_gpus} trainer + {plan.rollout_gpus} rollout); add GPU nodes or lower the "
            "GPU counts in --resource"
        )
    cpus_needed = sum(bundle.cpu for bundle in plan.baseline_bundles)
    cpus = float(cluster_resources.get("CPU", 0.0))
    if cpus < cpus_needed:
        problems.append(
            f"the cluster has {cpus:g} CPUs but the baseline bundles need {cpus_needed:g} (1 per bundle); "
            "add CPUs to the GPU nodes"
        )
    problems.extend(_marker_problems(plan, cluster_resources))
    return problems


def _marker_problems(plan: Plan, cluster_resources: Mapping[str, float]) -> list[str]:
    if plan.node_group is None:
        return []
    switch = "or turn affinity off with --no-enable-affinity (ENABLE_AFFINITY=0 in the launch scripts)"
    missing = [name for name in plan.marker_resources if float(cluster_resources.get(name, 0.0)) <= 0]
    if missing:
        gpu_marker, cpu_marker = plan.marker_resources
        example = f'"{gpu_marker}": {plan.baseline_gpus}, "{cpu_marker}": {len(plan.baseline_bundles) + 1}'
        return [
            f"node-group affinity needs the marker resources {', '.join(missing)} "
            f"({NODE_GROUP_ENV}={plan.node_group}) but the cluster does not declare them; declare them on "
            f"the stable nodes (e.g. ray start --resources '{{{example}}}') {switch}"
        ]
    gpu_marker, cpu_marker = plan.marker_resources
    needs = {
        gpu_marker: float(plan.baseline_gpus),
        cpu_marker: len(plan.baseline_bundles) + sum(v for _, v in plan.control_plane_resources),
    }
    problems = []
    for name, need in needs.items():
        have = float(cluster_resources.get(name, 0.0))
        if have < need:
            problems.append(
                f"the cluster declares {name}: {have:g} but the pinned baseline needs {need:g}; "
                f"declare more {name} on the stable nodes {switch}"
            )
    return problems


def validate_paths(args: TrainArgs, exists: Callable[[str], bool] = os.path.exists) -> list[str]:
    """Messages for model and data paths that do not exist (``--load``/``--save`` may be new)."""
    checks: list[tuple[str, str | None]] = [
        ("--hf-checkpoint", args.hf_checkpoint),
        ("--prompt-data", args.prompt_data),
    ]
    checks.extend((f"--eval-prompt-data {name}", path) for name, path in args.eval_prompt_data)
    return [f"{flag}: no such file or directory: {path}" for flag, path in checks if path and not exists(path)]


# --------------------------------------------------------------------------------------------------
# --dry-run output


def _bundle_text(bundle: Bundle) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in bundle.to_ray().items()) + "}"


def _bounds_text(plan: Plan) -> str:
    if plan.autoscaler is None:
        return (
            f"floor {plan.engine_floor} (initial engines), no autoscaler; manual scale-out via "
            f"/rollout/scale_out (embedded headroom {plan.headroom_engines} engines)"
        )
    state = "enabled" if plan.autoscaler.enabled else "disabled"
    return (
        f"floor {plan.engine_floor} (initial engines), autoscaler {state} "
        f"min {plan.autoscaler.min_engines} / max {plan.autoscaler.max_engines}, "
        f"headroom {plan.headroom_engines} engines / {plan.headroom_gpus} GPUs"
    )


def _affinity_text(plan: Plan) -> str:
    if plan.node_group is None:
        return plan.affinity.value
    markers = ", ".join(plan.marker_resources)
    return f"on: node group {plan.node_group!r} (cluster must declare {markers})"


def engines_text(count: int, backend: str, python: str | None, gpus_per_engine: int) -> str:
    """``2 x sglang (python /opt/sglang/bin/python), 1 GPU each``: the start-up log's and the plan's line.

    ``backend`` is ``sglang``, ``builtin`` or ``auto`` (the plan, before an engine's node decides it).
    """
    gpus = f"{gpus_per_engine} GPU{'s' if gpus_per_engine > 1 else ''} each"
    own = f"{sys.executable}, the engine's own interpreter"
    if backend == "builtin":
        return f"{count} x builtin (python {own}), {gpus}"
    if backend == "sglang":
        return (f"{count} x sglang (python {python or own}), {gpus}; on a node without CUDA, SGLang's CPU platform "
                "(bf16, an attention backend the model's head size supports, a core set per engine)")
    return (f"{count} x auto: sglang (python {python or own}) if the engine's GPUs are CUDA devices, else builtin; "
            f"decided on the first engine's node at start, {gpus}")


def api_url_text(host: str, port: int) -> str:
    """Where the control plane will listen, and who can reach it."""
    shown = f"[{host}]" if ":" in host else host
    if is_loopback_host(host):
        return f"http://{shown}:{port} (this node only; from elsewhere: ssh -L {port}:{shown}:{port} <driver-node>)"
    return f"http://{shown}:{port} (reachable from other machines; RELAX_API_TOKEN required)"


def format_plan(plan: Plan) -> str:
    """Multi-line, human-readable plan for ``--dry-run``."""
    batch = plan.batch
    trainer_bundle = _bundle_text(plan.trainer_bundles[0])
    engine_bundle = _bundle_text(plan.initial_engine_bundles[0][0]) if plan.initial_engine_bundles else "{}"
    control = ", ".join(f"{k}: {v:g}" for k, v in plan.control_plane_resources) or "no custom resources"
    rows = [
        ("mode", "fully-async (trainer and rollout on separate GPUs)"),
        ("trainer (actor)", f"{plan.trainer_gpus} GPUs; bundles {plan.trainer_gpus} × {trainer_bundle}"),
        (
            "rollout",
            f"{plan.initial_engines} initial engines × {plan.gpus_per_engine} GPU = {plan.rollout_gpus} GPUs; "
            f"one bundle per engine {engine_bundle} (its server sees {plan.gpus_per_engine} GPU"
            f"{'s' if plan.gpus_per_engine > 1 else ''})",
        ),
        (
            "elastic engines",
            f"one bundle {_bundle_text(plan.elastic_engine_bundles[0])} each, "
            f"strategy {plan.placement_strategy}, no node-group markers",
        ),
        ("rollout engines", engines_text(plan.initial_engines, plan.rollout_backend, plan.sglang_python,
                                         plan.gpus_per_engine)),
        ("engine bounds", _bounds_text(plan)),
        ("affinity", _affinity_text(plan)),
        ("control plane", f"{api_url_text(plan.api_host, plan.api_port)}; {control}"),
        ("baseline GPUs", f"{plan.baseline_gpus} (with elastic headroom: {plan.embedded_cluster_gpus})"),
        (
            "batch",
            f"{batch.rollout_batch_size} prompts × {batch.n_samples_per_prompt} samples = "
            f"{batch.samples_per_rollout} samples per rollout step; global batch {batch.global_batch_size} "
            f"-> {batch.optimizer_steps_per_rollout} optimizer step(s) per rollout step",
        ),
        (
            "staleness",
            f"max {plan.max_staleness} version(s); at most {plan.max_waiting_partitions} rollout step(s) "
            "waiting for the trainer",
        ),
        ("training", f"{plan.num_rollout} rollout steps, {plan.total_optimizer_steps} optimizer steps"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = ["Relax plan"] + [f"  {label.ljust(width)}  {text}" for label, text in rows]
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)
