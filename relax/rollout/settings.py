"""The rollout's settings: every rollout knob once, nested by the part that reads it.

One frozen record per part (the data and the generation loop, how engines are launched, the fleet, dispatch,
scaling), gathered in :class:`RolloutSettings` and built from the parsed flags by one function,
:func:`rollout_settings`. A new knob is a field here and a line in that function; the parts read their own
record and nothing else, so the same value never lives in two places that can drift apart.

What the driver learns only at run time (the engines' backend decided on a node, the broadcast backend, how
many engines share a node, the run's secrets) comes in as :class:`RunFacts`, so the function stays pure and is
tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax.config.flags import PartialSuccessPolicy, UnfinishedRequests
from relax.config.verify_weights import VerifyPolicy
from relax.weights.pause_mode import PauseMode

if TYPE_CHECKING:
    from relax.config.flags import TrainArgs
    from relax.config.plan import Plan


@dataclass(frozen=True)
class SamplingSettings:
    """How each prompt is sampled: ``n_samples`` answers of at most ``max_new_tokens``."""

    n_samples: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def to_params(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


@dataclass(frozen=True)
class DataSettings:
    """The prompts, how many steps of them, how they are sampled and rewarded, and the staleness bound."""

    prompt_data: str
    num_rollout: int
    rollout_batch_size: int
    sampling: SamplingSettings
    max_staleness: int = 1
    max_prompt_len: int | None = None  # --rollout-max-prompt-len: longer prompts are dropped at load
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    shuffle: bool = False
    seed: int = 42  # the prompt order's and the engines' sampling seed (--rollout-seed)
    rm_type: str | None = None
    custom_rm_path: str | None = None
    reward_key: str | None = None  # the entry of a reward function's dict result that is the reward
    scale_by_std: bool = True
    eval_datasets: tuple[tuple[str, str], ...] = ()
    eval_sampling: SamplingSettings | None = None  # None: the rollout's


@dataclass(frozen=True)
class EvictionSettings:
    """Budgets of evictions from Ray's drain notices (``rollout.fleet.eviction``)."""

    margin_s: float = 5.0  # kept back from the deadline for stopping the server and removing the group
    default_budget_s: float = 30.0  # when the notice has no deadline (Ray's own default drain timeout)


@dataclass(frozen=True)
class LaunchSettings:
    """How the run's own engines are started (``rollout.pool.launcher``); attached engines ignore it."""

    backend: str = "auto"
    max_running_requests: int = 64
    log_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "auto"
    engines_per_node: int = 1  # how many engines share a node's cores (SGLang on CPU binds each to its share)
    sglang_mem_fraction_static: float | None = None
    sglang_extra_args: tuple[str, ...] = ()
    sglang_python: str | None = None  # the interpreter that runs SGLang's server (--sglang-python); None: the actor's


@dataclass(frozen=True)
class BroadcastSettings:
    """Broadcast weight updates (versions published with a sender): group backend and per-step deadline."""

    backend: str = "gloo"
    timeout_s: float = 60.0  # per step: a join, one bucket
    ranks_per_engine: int = 1  # the engine's tensor-parallel ranks


@dataclass(frozen=True)
class FleetSettings:
    """The engines and their lifecycle: model, sizes, timeouts, keys, weight loads (``rollout.fleet.lifecycle``)."""

    model_path: str = ""
    gpus_per_engine: int = 1
    #: Every engine call's limit (a generation's: per wait for bytes, not the whole of it).
    request_timeout_s: float = 300.0
    health_timeout_s: float = 120.0
    #: How long a leaving engine's requests may finish before they are aborted (scale-in, eviction).
    drain_timeout_s: float = 30.0
    shutdown_timeout_s: float = 30.0
    #: How an engine is paused around each weight load.
    weight_sync_pause_mode: PauseMode = PauseMode.RETRACT
    #: After which loads an engine's served weights are checked against the publication (``rollout.refit.rules``).
    verify_weights: VerifyPolicy = VerifyPolicy.FIRST
    #: An engine started after a broadcast publication starts with random weights (no checkpoint read) and is
    #: routed only once its first refit is verified (``--joiner-weights``).
    dummy_joins: bool = False
    #: The run's engine secret: each engine the run starts has its own generation and admin keys derived from it
    #: (relax.engines.keys.engine_keys); never logged.
    engine_api_key: str | None = field(default=None, repr=False)
    #: A generation key the user chose for every engine (RELAX_ENGINE_API_KEY), else each engine's own.
    engine_generation_key: str | None = field(default=None, repr=False)
    #: What engines attached by URL get instead (the operator's key for them; None: no header). The run's
    #: secret never leaves the run: an attached URL may be anybody's server.
    external_engine_api_key: str | None = field(default=None, repr=False)
    broadcast: BroadcastSettings = field(default_factory=BroadcastSettings)
    #: Budgets of evictions from Ray's drain notices (safety margin, default when no deadline is given).
    eviction: EvictionSettings = field(default_factory=EvictionSettings)
    #: An SGLang router (``sglang-router``) that mirrors the routable engines (``--sglang-router-url``); None: none.
    sglang_router_url: str | None = None
    #: The router's own ``--api-key``, sent on its worker API when it has one; never logged.
    sglang_router_api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class DispatchSettings:
    """How one generation is sent and what happens when its engine fails or leaves (``rollout.dispatch.dispatcher``)."""

    max_attempts: int = 4
    migrate: bool = True  # continue interrupted generations from their prefix (False: start them again)
    stream: bool = True  # hold every generation's prefix, so it survives its engine dying without notice
    stream_interval: int = 8  # tokens per chunk at least (``rollout.dispatch.journey.stream_interval``; SGLang's
    # per-request ``sampling_params.stream_interval``)
    stream_min_tokens: int = 64  # budgets up to this many tokens are sent unstreamed (a crash regenerates them)
    # Facts of the model, filled in when the rollout is built (``rollout.assembly``), not knobs:
    eos_ids: frozenset[int] = frozenset()
    max_context: int | None = None


@dataclass
class ScalingSettings:
    """The run's scaling flags. ``initial_engines`` is set once the initial engines are placed."""

    initial_engines: int = 0
    max_engines: int | None = None
    scale_out_timeout_s: float = 300.0
    partial_success_policy: PartialSuccessPolicy | str = PartialSuccessPolicy.ROLLBACK_ALL


@dataclass(frozen=True)
class RolloutSettings:
    """Everything the rollout is built from (``rollout.assembly.build_rollout``)."""

    data: DataSettings
    fleet: FleetSettings
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)

    @property
    def model_path(self) -> str:
        return self.fleet.model_path


@dataclass(frozen=True)
class RunFacts:
    """What the driver learns at run time, not from the flags."""

    backend: str = "auto"  # the engines' backend, decided on an engine's node
    broadcast_backend: str = "gloo"  # nccl when the trainer computes on CUDA
    engines_per_node: int = 1
    engine_log_dir: str | None = None
    engine_api_key: str | None = field(default=None, repr=False)  # the run's secret
    engine_generation_key: str | None = field(default=None, repr=False)  # RELAX_ENGINE_API_KEY
    external_engine_api_key: str | None = field(default=None, repr=False)
    sglang_router_api_key: str | None = field(default=None, repr=False)


def rollout_settings(args: TrainArgs, plan: Plan, facts: RunFacts) -> RolloutSettings:
    """The rollout's settings from the parsed flags, the run's plan and what the driver learnt."""
    a = args
    sampling = SamplingSettings(n_samples=a.n_samples_per_prompt, max_new_tokens=a.rollout_max_response_len,
                                temperature=a.rollout_temperature, top_p=a.rollout_top_p, top_k=a.rollout_top_k)
    eval_sampling = SamplingSettings(
        n_samples=a.n_samples_per_eval_prompt,
        max_new_tokens=a.eval_max_response_len or a.rollout_max_response_len,
        temperature=a.eval_temperature if a.eval_temperature is not None else a.rollout_temperature,
        top_p=a.eval_top_p if a.eval_top_p is not None else a.rollout_top_p,
    )
    data = DataSettings(
        prompt_data=str(Path(a.prompt_data).resolve()), num_rollout=plan.num_rollout,
        rollout_batch_size=a.rollout_batch_size, sampling=sampling, max_staleness=a.max_staleness,
        max_prompt_len=a.rollout_max_prompt_len,
        input_key=a.input_key, label_key=a.label_key, apply_chat_template=a.apply_chat_template,
        shuffle=a.rollout_shuffle, seed=a.rollout_seed, rm_type=a.rm_type.value if a.rm_type else None,
        custom_rm_path=a.custom_rm_path, reward_key=a.reward_key, scale_by_std=not a.disable_grpo_std_normalization,
        eval_datasets=tuple((n, str(Path(p).resolve())) for n, p in a.eval_prompt_data), eval_sampling=eval_sampling,
    )
    fleet = FleetSettings(
        model_path=str(Path(a.hf_checkpoint).resolve()), gpus_per_engine=a.rollout_num_gpus_per_engine,
        drain_timeout_s=a.scale_in_drain_timeout, shutdown_timeout_s=a.scale_in_shutdown_timeout,
        weight_sync_pause_mode=a.weight_sync_pause_mode, verify_weights=a.verify_weights,
        dummy_joins=a.joiner_weights == "dummy" or (a.joiner_weights == "auto" and facts.backend == "builtin"),
        engine_api_key=facts.engine_api_key, engine_generation_key=facts.engine_generation_key,
        external_engine_api_key=facts.external_engine_api_key,
        broadcast=BroadcastSettings(backend=facts.broadcast_backend, timeout_s=a.weight_broadcast_timeout),
        sglang_router_url=a.sglang_router_url, sglang_router_api_key=facts.sglang_router_api_key,
    )
    launch = LaunchSettings(
        backend=facts.backend, log_dir=facts.engine_log_dir, host=a.engine_host,
        engines_per_node=facts.engines_per_node, sglang_mem_fraction_static=a.sglang_mem_fraction_static,
        sglang_extra_args=tuple(a.sglang_extra_args), sglang_python=a.sglang_interpreter(),
    )
    return RolloutSettings(
        data=data, fleet=fleet, launch=launch,
        dispatch=DispatchSettings(migrate=a.scale_in_unfinished is UnfinishedRequests.MIGRATE),
        scaling=ScalingSettings(max_engines=plan.max_engines, scale_out_timeout_s=a.scale_out_timeout,
                                partial_success_policy=a.scale_out_partial_success_policy.value),
    )
