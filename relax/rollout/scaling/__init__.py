"""The pure core of elastic scaling: plans, request records, one-at-a-time, cancel, history.

(docs/architecture.md, "Scale requests".) The RolloutManager's scale controller is a thin async shell around
this package. It asks a planner what a request means against the pool right now (:func:`plan_scale_out`,
:func:`plan_scale_in`, taking validated :class:`ScaleOutSpec` / :class:`ScaleInSpec`), registers it
(:class:`ScaleRequestRegistry`, which enforces *one scale operation at a time*), then carries the plan out
with Ray and reports progress back into the request record (``add_engine``, ``observe``, ``advance``).

One concept per module:

* :mod:`.errors` — the domain errors (no HTTP status: the REST layer maps types to codes);
* :mod:`.states` — directions, kinds, the two status machines, :func:`current_engine_count`;
* :mod:`.planner` — specs, plans, rejections, the planners, partial outcomes;
* :mod:`.requests` — the request records;
* :mod:`.registry` — the registry of all requests of a run.

No Ray, no HTTP, no pydantic, no asyncio; the clock is injected.
"""

from __future__ import annotations

from relax.config.flags import PartialSuccessPolicy
from relax.rollout.scaling.errors import (
    IllegalRequestTransition,
    NoSuchEngine,
    NotCancellable,
    RejectedRequest,
    ScaleConflict,
    ScalingError,
    UnknownModel,
    UnknownRequest,
)
from relax.rollout.scaling.planner import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    Noop,
    Rejection,
    ScaleInPlan,
    ScaleInSpec,
    ScaleOutPlan,
    ScaleOutSpec,
    ScalePlan,
    Victim,
    check_model_name,
    decide_partial_outcome,
    engine_phase_timings,
    plan_scale_in,
    plan_scale_out,
)
from relax.rollout.scaling.registry import CancelBatchResult, ScaleRequestRegistry
from relax.rollout.scaling.requests import (
    Clock,
    EngineOutcome,
    ScaleInRequest,
    ScaleOutRequest,
    ScaleRequest,
    VictimOutcome,
)
from relax.rollout.scaling.states import (
    FAILED_STATUSES,
    TERMINAL_STATUSES,
    Direction,
    ScaleInStatus,
    ScaleKind,
    ScaleOutStatus,
    current_engine_count,
)

__all__ = [
    "DEFAULT_MODEL",
    "FAILED_STATUSES",
    "KNOWN_MODELS",
    "TERMINAL_STATUSES",
    "CancelBatchResult",
    "Clock",
    "Direction",
    "EngineOutcome",
    "IllegalRequestTransition",
    "Noop",
    "NotCancellable",
    "PartialSuccessPolicy",
    "RejectedRequest",
    "Rejection",
    "ScaleConflict",
    "ScaleInPlan",
    "ScaleInRequest",
    "ScaleInSpec",
    "ScaleInStatus",
    "ScaleKind",
    "ScaleOutPlan",
    "ScaleOutRequest",
    "ScaleOutSpec",
    "ScaleOutStatus",
    "ScalePlan",
    "ScaleRequest",
    "ScaleRequestRegistry",
    "ScalingError",
    "UnknownModel",
    "NoSuchEngine",
    "UnknownRequest",
    "Victim",
    "VictimOutcome",
    "check_model_name",
    "current_engine_count",
    "decide_partial_outcome",
    "engine_phase_timings",
    "plan_scale_in",
    "plan_scale_out",
]
