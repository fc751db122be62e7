"""The driver: `python -m relax.entrypoints.train [flags]` — fully-asynchronous GRPO on Ray.

(docs/architecture.md, "Processes and actors".)

flags → plan → Ray (cluster or embedded) → placement groups → RolloutManager + trainer group →
loop: take rollout step k from the buffer, train, publish weights k+1 → evaluation, checkpoints,
metrics → clean shutdown. SIGTERM/SIGINT stop it between steps, with a checkpoint when `--save` is set.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.autoscaler.config import load_autoscaler_config
from relax.cluster.secret_env import DRIVER_ONLY, WANDB_KEY_ENV, withhold
from relax.config.checks import (
    check_api_host,
    check_hf_checkpoint,
    check_load,
    check_port_free,
    check_sglang_python,
    check_wandb,
    check_weight_shapes,
    find_run_outputs,
    is_loopback_host,
    run_dir_decision,
    wandb_key_warning,
)
from relax.config.flags import (
    SGLANG_PYTHON_ENV,
    ConfigError,
    TrainArgs,
    fail,
    parse_args_or_exit,
)
from relax.config.plan import (
    Plan,
    build_plan,
    engines_text,
    format_plan,
    node_group_name,
    validate_paths,
    validate_plan_against_cluster,
)
from relax.engines.sglang import api_key_from_env, engine_secret, external_engine_key, reserved_flag_problems
from relax.logs import LOG_LEVEL_ENV, failure_cause, setup_logging
from relax.training import tracking
from relax.training.console import ETA_WINDOW, StepLine, eta_seconds

log = logging.getLogger("relax.train")

PARTITION_TIMEOUT_S = 1800.0


def flag_problems(args: TrainArgs) -> list[str]:
    """Checks of the flags themselves (one line each): a real start and ``--dry-run`` both refuse on them."""
    problems: list[str] = []
    if args.rollout_backend != "builtin":  # the built-in engine neither runs SGLang nor reads --sglang-* flags
        problems += reserved_flag_problems(args.sglang_passthrough)
        source = "--sglang-python" if args.sglang_python else SGLANG_PYTHON_ENV
        if python_problem := check_sglang_python(args.sglang_interpreter(), flag=source):
            problems.append(python_problem)
    if host_problem := check_api_host(args.api_host):
        problems.append(host_problem)
    return problems


def dry_run_checks(args: TrainArgs) -> None:
    """``--dry-run``: the flag checks refuse as at a real start; what depends on this machine (paths, the port)
    is only warned about, since a plan is often made away from the cluster that will run it."""
    problems = flag_problems(args)
    if problems:
        fail(ConfigError("; ".join(problems)))
    machine = validate_paths(args)
    machine += [p for p in (check_load(args.load, args.save), check_port_free(args.api_host, args.api_port)) if p]
    for problem in machine:
        log.warning("--dry-run: a start on this machine would stop here: %s", problem)


def manifest_check(args: TrainArgs, plan: Plan) -> int:
    """``--dry-run --ray-cluster-manifest``: the plan against a KubeRay manifest, in the live check's words."""
    from relax.cluster.kuberay.render import load_manifests
    from relax.cluster.kuberay.report import manifest_report

    try:
        documents = load_manifests(args.ray_cluster_manifest)
    except ConfigError as exc:
        fail(ConfigError(f"--ray-cluster-manifest {exc}"))
    report = manifest_report(documents, node_group=plan.node_group or node_group_name(os.environ), plan=plan)
    print("\n".join(report.lines))
    return 0 if report.ok else 1


def preflight(args: TrainArgs) -> None:
    """Every check that needs no cluster, before anything starts (clear errors, exit 2)."""
    if warning := wandb_key_warning(args.wandb_key):
        log.warning("%s", warning)
    problems = flag_problems(args)
    problems += [p for p in validate_paths(args) if not p.startswith("--hf-checkpoint")]
    problems += check_hf_checkpoint(args.hf_checkpoint)
    if not problems:
        from relax.engines.builtin.decoder import parameter_shapes

        config = json.loads((Path(args.hf_checkpoint) / "config.json").read_text(encoding="utf-8"))
        try:
            expected = parameter_shapes(config)  # milliseconds for Qwen3/Llama; else transformers' meta model
        except (KeyError, TypeError, ValueError):
            expected = None
        problems += check_weight_shapes(args.hf_checkpoint, expected)
    load_problem = check_load(args.load, args.save)
    if load_problem:
        problems.append(load_problem)
    resume = _resume_choice(args) if args.load and not load_problem else None
    if isinstance(resume, str):
        problems.append(resume)
        resume = None
    if not args.prompt_data:
        problems.append("--prompt-data is required (a JSONL file of prompts)")
    port_problem = check_port_free(args.api_host, args.api_port)
    if port_problem:
        problems.append(port_problem)
    if wandb_problem := check_wandb(args.use_wandb):
        problems.append(wandb_problem)
    if problems:
        fail(ConfigError("; ".join(problems)))
    from relax.data.dataset import DataError, load_prompt_data
    from relax.data.rewards import RewardConfigError, get_reward_fn

    tokenizer = None
    if args.apply_chat_template:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        except Exception as exc:  # noqa: BLE001 - any broken tokenizer file: one line, not transformers' traceback
            fail(ConfigError(f"--hf-checkpoint {args.hf_checkpoint}: its tokenizer cannot be loaded "
                             f"({failure_cause(exc, 200)}); "
                             "restore tokenizer.json / tokenizer_config.json from the original model"))
    try:  # malformed data files fail here, with the line number, not an hour into the run
        datasets = [load_prompt_data(path, args.input_key, args.label_key, tokenizer=tokenizer,
                                     apply_chat_template=args.apply_chat_template)
                    for path in [args.prompt_data, *(p for _name, p in args.eval_prompt_data)]]
        get_reward_fn(args.rm_type.value if args.rm_type else "tiny", args.custom_rm_path, args.reward_key)
    except (DataError, RewardConfigError) as exc:
        fail(ConfigError(str(exc)))
    if len(datasets[0]) < args.rollout_batch_size:
        log.warning("--prompt-data %s has %d prompt(s), fewer than one batch (--rollout-batch-size %d): every "
                    "step repeats prompts", args.prompt_data, len(datasets[0]), args.rollout_batch_size)
    _warn_resume_past_the_end(args, resume)
    from relax.cluster import scratch

    # Last, once the input is known good: two live runs must not write one output directory (held until exit).
    try:
        owner = scratch.claim(Path(args.output_dir))
    except OSError as exc:  # an existing file of that name, a read-only mount
        fail(ConfigError(f"--output-dir {args.output_dir}: cannot be used as the run's directory "
                         f"({exc.strerror or exc})"))
    if owner:
        fail(ConfigError(f"--output-dir: {owner}; give this run its own --output-dir"))
    # ... and one output directory holds one run: continued by a resume, never logged into again from step 0.
    outputs = find_run_outputs(args.output_dir, args.resolved_tensorboard_dir)
    decision = run_dir_decision(outputs, resume.step if resume and resume.path else None, args.output_dir, args.load)
    if decision.problem:
        fail(ConfigError(decision.problem))
    if args.save:
        _claim_save_dir(args.save)


def _claim_save_dir(save: str) -> None:
    """Make ``--save`` this run's alone, then remove what interrupted saves left there (logged in one line).

    Two live runs saving into one directory would rotate each other's checkpoints away, and a write in progress
    looks like an interrupted one: so the removal comes only after the claim (the same ``flock`` as the output
    directory's, dropped by the kernel when the run exits), and a directory another live run holds is refused.
    """
    from relax.cluster import scratch
    from relax.training.checkpoint import remove_save_leftovers

    try:
        owner = scratch.claim(Path(save))
    except OSError as exc:
        fail(ConfigError(f"--save {save}: cannot be used as the checkpoint directory ({exc.strerror or exc})"))
    if owner:
        fail(ConfigError(f"--save: {owner}; give this run its own --save directory"))
    remove_save_leftovers(save)


def _resume_choice(args: TrainArgs) -> Any:
    """What ``--load`` resumes from (``find_resume_checkpoint``), or the one-line problem when it cannot be read."""
    from relax.training.checkpoint import find_resume_checkpoint

    try:
        return find_resume_checkpoint(args.load)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"--load {args.load}: {exc}"


def _warn_resume_past_the_end(args: TrainArgs, choice: Any) -> None:
    """A resume whose checkpoint already reached ``--num-rollout`` trains nothing: say so before it starts."""
    if choice is not None and choice.path is not None and choice.step >= args.num_rollout:
        log.warning("--load %s resumes at step %d and --num-rollout is %d: there is nothing left to train; raise "
                    "--num-rollout to go on", choice.path, choice.step, args.num_rollout)


class _StopRequested(Exception):
    """SIGTERM/SIGINT arrived while the driver waited (for data, for the initial engines)."""


class _RunFailed(Exception):
    """A part of the run failed and the driver has said so in one line (:func:`fatal_line`): exit code 1."""


@dataclass
class _Stop:
    requested: bool = False
    signal_name: str = ""


class Driver:
    def __init__(self, args: TrainArgs, plan: Plan, autoscaler_config: Any = None,
                 secrets: dict[str, str] | None = None) -> None:
        self.args = args
        self.plan = plan
        self.autoscaler_config = autoscaler_config
        # the driver's own secrets (relax.cluster.secret_env.DRIVER_ONLY), out of the environment Ray inherits
        self.secrets = dict(secrets or {})
        self.stop = _Stop()
        self.run_dir = Path(args.output_dir)
        self.groups: list[Any] = []
        self.mode: str | None = None  # "embedded" or "cluster", once connected
        self.manager: Any = None
        self.trainer: Any = None
        self.control_plane: Any = None
        self.backend = args.rollout_backend  # `auto` until _resolve_backend asks an engine's node
        self._token: tuple[str, list[Path]] | None = None  # the control plane's token and its lookup files
        self.tracking: tracking.Tracking = tracking.NO_TRACKING  # W&B with --use-wandb (relax.training.tracking)
        self._step_times: collections.deque[float] = collections.deque(maxlen=ETA_WINDOW)  # the console ETA
        self._migration: dict[str, Any] = {}  # the manager's migration counters at the previous step's row
        self._report: dict[str, Any] | None = None  # the last step's figures for the manager, not yet sent
        self._status: dict[str, Any] = {}  # the rollout's newest RunStatus (rollout.run_status)

    # ------------------------------------------------------------------ setup
    def _install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.stop.requested:  # second signal: stop now
                raise KeyboardInterrupt
            self.stop.requested = True
            self.stop.signal_name = signal.Signals(signum).name
            log.warning("%s received: stopping after the current step", self.stop.signal_name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _rollout_settings(self) -> Any:
        """The rollout's settings (``rollout.settings``): the flags, the plan and what this driver learnt."""
        from relax.rollout.settings import RunFacts, rollout_settings

        return rollout_settings(self.args, self.plan, RunFacts(
            backend=self.backend,  # `auto` decided on an engine's node (_resolve_backend)
            broadcast_backend=self._broadcast_backend(), engines_per_node=self._engines_per_node(),
            engine_log_dir=str((self.run_dir / "engines").resolve()), engine_api_key=engine_secret(),
            engine_generation_key=api_key_from_env(), external_engine_api_key=external_engine_key(),
            sglang_router_api_key=os.environ.get("RELAX_SGLANG_ROUTER_API_KEY") or None,
        ))

    def _engines_per_node(self) -> int:
        """How many engines share a node's cores: all the initial ones on a one-machine cluster, else one a node."""
        import ray

        addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")} if ray.is_initialized() else set()
        return max(1, self.plan.initial_engines) if len(addresses) <= 1 else 1

    def _broadcast_backend(self) -> str:
        """NCCL when the trainer computes on CUDA (engines then sit on GPUs too), else gloo.

        Decided by the driver's view of the machine: a local run's logical GPUs are not CUDA devices.
        """
        import torch

        return "nccl" if torch.cuda.is_available() and self.plan.trainer_bundles[0].gpu > 0 else "gloo"

    def _start(self) -> int:
        import ray

        from relax.cluster import scratch
        from relax.cluster.connect import connect
        from relax.cluster.placement import create_groups
        from relax.rollout.control.server import spawn_control_plane
        from relax.rollout.manager import spawn_rollout_manager
        from relax.training.actor import TrainerConfig
        from relax.training.group import TrainerGroup

        # Every process of this run shares one scratch directory per node, and no other run's (weight copies).
        run_id = os.environ.get(scratch.RUN_ID_ENV) or scratch.new_run_id()
        mode = self.mode = connect(
            self.plan,
            runtime_env={
                "env_vars": {
                    "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    LOG_LEVEL_ENV: self.args.log_level,  # every actor logs at the run's --log-level
                    "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", ""),
                    scratch.RUN_ID_ENV: run_id,
                }
            },
        )
        log.info("run %s: scratch space %s/%s%s on each node", run_id, scratch.scratch_base(), scratch.PREFIX,
                 run_id)
        self._install_signals()  # after ray.init: Ray's core worker installs its own SIGTERM handler
        problems = validate_plan_against_cluster(self.plan, ray.cluster_resources())
        if problems:
            raise ConfigError("; ".join(problems))
        named = [("relax-trainer", self.plan.trainer_bundles)]
        named += [(f"relax-engine-{i}", b) for i, b in enumerate(self.plan.initial_engine_bundles)]
        self.groups = create_groups(named)
        log.info("cluster mode %s; placement groups ready: %s", mode, ", ".join(n for n, _ in named))
        self.backend = self._resolve_backend()

        self.manager = spawn_rollout_manager(self._rollout_settings(), resources=self.plan.control_plane_options())
        # The engines load their model while the trainer ranks initialise: the two are independent, and each
        # takes seconds to tens of seconds (the first step waits for both).
        engines_ref = self.manager.start_initial_engines.remote([(g, 0) for g in self.groups[1:]])
        self.trainer = TrainerGroup(
            TrainerConfig.from_args(self.args, hf_checkpoint=str(Path(self.args.hf_checkpoint).resolve()),
                                    lr_decay_iters=self.args.lr_decay_iters or self.plan.num_rollout),
            self.groups[0], while_starting=self._raise_if_stopped,
        )
        engines = self._result(engines_ref)
        log.info("%d initial engine(s) ACTIVE: %s", len(engines), ", ".join(e["engine_id"] for e in engines))
        from relax.cluster.api_token import publish_token, run_token, write_token

        token = run_token(self.secrets)  # every run has one: RELAX_API_TOKEN, else a fresh one
        self.control_plane, url = spawn_control_plane(
            self.manager, self.args.api_host, self.args.api_port, token,
            self.plan.control_plane_options() or None, autoscaler_factory=self._autoscaler_factory(),
        )
        token_file = write_token(token, self.run_dir)
        # The CLI's lookup names a listening address of this machine: written only when the control plane
        # serves here, for the port it actually bound (``--api-port 0`` included).
        here = self._result(self.control_plane.node_ip.remote()) == ray.util.get_node_ip_address()
        wildcard = self.args.api_host if self.args.api_host in ("0.0.0.0", "::") else None
        self._token = (token, publish_token(token, url, wildcard=wildcard) if here else [])
        found = ("the relax CLI on this machine finds it" if here else
                 "the control plane serves on another node: set RELAX_API_TOKEN from it there")
        log.info("control plane at %s (REST: %s/rollout/engines, metrics: %s/metrics); its token is in %s "
                 "(mode 0600): %s", url, url, url, token_file, found)
        port = url.rsplit(":", 1)[-1]
        reach = (f"this node only; from another machine: ssh -L {port}:127.0.0.1:{port} <this node>, docs/elastic.md"
                 if is_loopback_host(self.args.api_host) else "reachable from other machines with RELAX_API_TOKEN")
        print(f"relax API: {url} ({reach})", flush=True)
        return 0

    def _resolve_backend(self) -> str:
        """The engines' backend: ``auto`` (and SGLang's presence) is decided on the first engine's node, holding
        its GPUs, so a GPU node without SGLang fails here, in one line, not as engines that never come up."""
        from relax.rollout.pool.launcher import probe_engine_node, resolve_backend

        a, python = self.args, self.args.sglang_interpreter()
        found = ""
        if a.rollout_backend == "builtin" or len(self.groups) < 2:
            backend = resolve_backend(a.rollout_backend)  # no engine to ask: the driver's own view
        else:
            facts = self._result(probe_engine_node(self.groups[1], 0, self.plan.gpus_per_engine, a.rollout_backend,
                                                   python))
            if facts.problem:
                cuda = "CUDA GPUs there, so auto means SGLang; " if a.rollout_backend == "auto" else ""
                raise ConfigError(f"--rollout-backend {a.rollout_backend}: {cuda}{facts.problem}")
            backend = facts.backend
            python = facts.python if backend == "sglang" else python
            found = f"; SGLang {facts.sglang_version}" if facts.sglang_version else ""
            if a.rollout_backend == "auto":
                found += f"; auto: {'CUDA' if facts.cuda else 'no CUDA'} devices on the first engine's node"
        log.info("rollout engines: %s%s", engines_text(self.plan.initial_engines, backend, python,
                                                       self.plan.gpus_per_engine), found)
        return backend

    def _autoscaler_factory(self) -> Any:
        """Built inside the control-plane actor: the autoscaler runs beside the REST API.

        A given config is mounted whatever its ``enabled`` says: ``enabled: false`` means "watch, do not
        act" (the service keeps scraping and evaluating, so ``/autoscaler/conditions`` shows what it would
        do), and ``POST /autoscaler/enable`` must be able to turn it on at run time. Only a run without
        ``--autoscaler-config`` has no autoscaler (and no ``/autoscaler`` routes).
        """
        config = self.autoscaler_config
        if config is None:
            return None
        from relax.autoscaler.config import effective_bounds
        from relax.autoscaler.mount import AutoscalerFactory

        floor, ceiling, notes = effective_bounds(config, self.plan.initial_engines)
        state = ("enabled" if config.enabled
                 else 'disabled (watching only; POST /autoscaler/enable {"enabled": true} turns it on)')
        log.info("autoscaler mounted, %s: pool between %d and %d engines%s", state, floor, ceiling,
                 "; " + "; ".join(notes) if notes else "")
        return AutoscalerFactory(config, self.manager)

    # ------------------------------------------------------------------ loop
    def _publish(self, version: int) -> float:
        from relax.training.publisher import checksum_layout, publication_dtype, publish

        publication = publish(self.trainer, self.manager, version, self.args.weight_sync,
                              dtype=publication_dtype(self.backend), layout=checksum_layout(self.backend),
                              backend=self._broadcast_backend(), bucket_bytes=self.args.update_weight_buffer_size)
        return publication.gather_s

    def run(self) -> int:
        import ray

        from relax.training.report import MetricsLog, plot, resume_records, summarize

        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics = MetricsLog(
            self.run_dir, self.args.resolved_tensorboard_dir and Path(self.args.resolved_tensorboard_dir)
        )
        versions_log = (self.run_dir / "sample_versions.jsonl").open("a", encoding="utf-8")
        try:
            try:
                self._start()
            except _StopRequested:
                log.warning("%s during start-up: stopping before the first step", self.stop.signal_name)
                return 0
            start_step, cursor = self._maybe_resume()
            self.tracking = tracking.start(self.args, self.run_dir, resuming=start_step > 0,
                                           api_key=self.args.wandb_key or self.secrets.get(WANDB_KEY_ENV))
            if start_step > 0:
                metrics.resume(start_step)  # one row per step across the segments; the summary covers them all
                versions_log.close()  # and the per-sample records of the steps done again
                resume_records(self.run_dir, start_step)
                versions_log = (self.run_dir / "sample_versions.jsonl").open("a", encoding="utf-8")
                self._publish(start_step)
            if self.args.eval_prompt_data and not self.args.skip_eval_before_train and start_step == 0:
                self._evaluate(metrics, start_step)
            ray.get(self.manager.start_generation.remote(start_step, cursor))
            total = self.plan.num_rollout
            last_done: tuple[int, dict[str, int] | None] | None = None
            last_saved = -1
            try:
                for step in range(start_step, total):
                    if self.stop.requested:
                        break
                    cursor_end = self._train_one(step, total, metrics, versions_log)
                    done = step + 1
                    last_done = (done, cursor_end)
                    if self.args.eval_interval and done % self.args.eval_interval == 0 and self.args.eval_prompt_data:
                        self._evaluate(metrics, done)
                    if self.args.save and self.args.save_interval and done % self.args.save_interval == 0:
                        self._save(done, cursor_end)
                        last_saved = done
            except _StopRequested:
                pass
            if self._report is not None:  # the last step's figures: the control plane shows the run's end
                self.manager.report_training.remote(self._report)
            if self.stop.requested:
                log.warning("%s: stopping after step %s", self.stop.signal_name, last_done[0] if last_done else "-")
                if self.args.save and last_done is not None and last_done[0] != last_saved:
                    self._save(*last_done)
            train_rows = metrics.train_rows  # read back from metrics.jsonl once, for the summary and the plot
            summary = summarize(train_rows, metrics.wall_seconds(), self._status)
            self._finish(summary, metrics, train_rows, plot)
            self.tracking.end(summary, self.run_dir / "training.png")
            return 0
        except Exception as exc:
            if not _is_run_failure(exc):
                raise  # a bug of Relax's own: its traceback is what a report needs
            log.debug("the run's failure", exc_info=exc)
            log.error("%s", fatal_line(exc))  # the cause first, then the shutdown's lines
            raise _RunFailed from None
        finally:
            self.tracking.finish()  # a run that did not reach end() is marked failed
            versions_log.close()
            metrics.close()
            self._shutdown()

    def _train_one(self, step: int, total: int, metrics: Any, versions_log: Any) -> dict[str, int] | None:
        """Rollout step `step` → one training step → publish version step+1; returns the data position.

        Two calls to the rollout manager per step: :meth:`_take_step` (the samples go to the trainer ranks by
        reference, never through this process; the previous step's figures go back with it) and the
        publication."""
        from relax.training.report import migration_row

        wait_began = time.monotonic()
        part = self._take_step(step)
        waited = time.monotonic() - wait_began
        versions_log.write(json.dumps(part["versions"]) + "\n")
        versions_log.flush()
        if part["sample_rows"] is not None:
            self._record_samples(part["sample_rows"])
        train_began = time.monotonic()
        train_metrics = self.trainer.train_sharded(part["shards"], part["denominator"], part["num_micro_batches"],
                                                   part["aggregation"])
        trained = time.monotonic() - train_began
        publish_s = self._publish(step + 1)
        status = part["status"]
        step_time = time.monotonic() - wait_began
        row = {
            **part["metrics"],
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "time/step_s": step_time,
            "time/trainer_wait_s": waited,
            "time/train_s": trained,
            "time/publish_s": publish_s,
            "time/trainer_wait_fraction": waited / step_time if step_time else 0.0,
            "engines/active": status["active_engines"],
            "engines/weight_version": status["engine_weight_version"],
            "rollout/staleness_blocked_fraction": status["staleness_blocked_fraction"],
            **migration_row(self._migration, status["migration"]),
        }
        self._migration = status["migration"]
        self._status = status
        metrics.log(step + 1, row)
        self.tracking.log(metrics.last_row)
        seconds = row.get("rollout/seconds")
        self._report = {  # sent with the next step's call (and at the end of the run)
            "step": step + 1, "staleness_mean": row.get("staleness/mean", 0.0),
            "trainer_wait_fraction": row["time/trainer_wait_fraction"],
            "rollout_tokens_per_s": part["response_tokens"] / seconds if seconds else 0.0,
        }
        self._step_times.append(step_time)
        log.info("%s", StepLine(
            step=step + 1, total=total, reward=row.get("rollout/reward_mean"), staleness_max=row.get("staleness/max"),
            active_engines=status["active_engines"], step_s=step_time,
            eta_s=eta_seconds(list(self._step_times), total - step - 1),
        ).render(tty=sys.stderr.isatty()))
        log.debug("step %d: response len %.1f, loss %.4f, train %.2fs, publish %.2fs", step + 1,
                  row.get("rollout/response_len_mean", float("nan")), train_metrics.get("loss", float("nan")),
                  trained, publish_s)
        return part["cursor_end"]

    def _record_samples(self, rows: list[dict[str, Any]]) -> None:
        """``--record-samples``: what the model wrote, one JSON line per trained sample
        (``rollout.dispatch.handoff``)."""
        with (self.run_dir / "samples.jsonl").open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    def _take_step(self, step: int) -> dict[str, Any]:
        report, self._report = self._report, None
        return self._result(self.manager.take_step.remote(step, self.trainer.batch_plan(), PARTITION_TIMEOUT_S,
                                                          report, self.args.record_samples))

    def _result(self, ref: Any) -> Any:
        """``ray.get(ref)``, polled, so that a SIGTERM is honoured while the driver waits (for data, for the
        engines to start): :class:`_StopRequested` instead of finishing what nobody wants any more; and a lost
        trainer rank ends the wait (:class:`~relax.training.group.TrainerRankError`)."""
        import ray

        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)
            self._raise_if_stopped()
            if self.trainer is not None:  # a rank that died stops the run now, not at the next training call
                self.trainer.raise_if_lost()

    def _raise_if_stopped(self) -> None:
        if self.stop.requested:
            raise _StopRequested

    def _evaluate(self, metrics: Any, step: int) -> None:
        import ray

        began = time.monotonic()
        result = ray.get(self.manager.evaluate.remote())
        row = {k if k.startswith("eval/") else f"eval/{k}": v for k, v in result.items()}
        row["time/eval_s"] = time.monotonic() - began
        metrics.log(step, row, kind="eval")
        self.tracking.log(metrics.last_row)
        log.info(
            "evaluation at step %d: %s",
            step,
            ", ".join(f"{k}={v:.3f}" for k, v in sorted(result.items()) if isinstance(v, float)),
        )

    def _maybe_resume(self) -> tuple[int, dict[str, int] | None]:
        """``--load``: a checkpoint directory, or a ``--save`` directory whose newest complete checkpoint is used.

        The choice is ``find_resume_checkpoint``'s (the ``latest`` pointer may be stale after a crash), and the
        log says which checkpoint and why. A ``--load`` with no checkpoint in it (the ``--save`` directory on a
        first start; pre-flight has refused a missing one that is not ``--save``) starts from
        ``--hf-checkpoint``, with one warning line.
        """
        if not self.args.load:
            return 0, None
        from relax.training.checkpoint import find_resume_checkpoint, repair_latest

        choice = find_resume_checkpoint(self.args.load)
        if choice.path is None:  # slime's idiom: --load DIR --save DIR from the first start on
            log.warning("--load %s holds no checkpoint (%s): starting from --hf-checkpoint %s", self.args.load,
                        choice.reason, self.args.hf_checkpoint)
            return 0, None
        log.info("resuming from %s", choice.reason)
        path = choice.path
        if repair_latest(self.args.load, choice.path):  # ``latest`` names the newest complete checkpoint
            log.info("--load %s: %s now names %s", self.args.load, "latest", choice.path.name)
        extra = self.trainer.load(str(path))
        step = int(extra["step"])
        log.info("resumed from %s at step %d (data position %s)", path, step, extra.get("cursor"))
        return step, extra.get("cursor")

    def _save(self, step: int, cursor: dict[str, int] | None) -> None:
        """Write the checkpoint, then (only once it is complete on disk) point ``latest`` at it, atomically; then
        ``--keep-checkpoints`` deletes the complete checkpoints beyond the newest N (never the one just saved)."""
        from relax.training.checkpoint import checkpoint_name, rotate_checkpoints, write_latest

        path = Path(self.args.save) / checkpoint_name(step)
        self.trainer.save(str(path), {"step": step, "cursor": cursor})  # returns once rank 0's rename is done
        write_latest(self.args.save, path)
        log.info("checkpoint saved: %s", path)
        rotate_checkpoints(self.args.save, self.args.keep_checkpoints)  # a failure logs a line, never raises

    def _finish(self, summary: dict[str, Any], metrics: Any, train_rows: list[dict[str, Any]], plot_fn: Any) -> None:

        out = self.run_dir / "summary.json"
        out.write_text(json.dumps(summary, indent=2) + "\n")
        png = plot_fn(train_rows, self.run_dir / "training.png") if metrics.last_row is not None else None
        log.info("summary: %s", json.dumps(summary))
        print(
            f"\nRelax run finished: {summary['training_steps']} training steps, mean reward "
            f"{_fmt(summary['reward_first5_mean'])} (first 5 steps) -> {_fmt(summary['reward_last5_mean'])} "
            f"(last 5 steps), mean staleness {_fmt(summary['staleness_mean'])}, "
            f"{_fmt(summary['samples_per_second'])} samples/s"
        )
        print(f"metrics: {metrics.path}\nsummary: {out}\nplot:    {png}")

    def _shutdown(self) -> None:
        import ray

        from relax.cluster.placement import remove_groups

        if self.control_plane is not None:
            try:
                ray.get(self.control_plane.stop.remote(), timeout=30)
            except Exception as exc:
                log.warning("control plane shutdown: %s", exc)
            ray.kill(self.control_plane, no_restart=True)
        if self._token is not None:
            from relax.cluster.api_token import withdraw_token

            withdraw_token(self._token[1], self._token[0])
        if self.manager is not None:
            try:
                ray.get(self.manager.shutdown.remote(), timeout=60)
            except Exception as exc:
                log.warning("rollout manager shutdown: %s", exc)
            ray.kill(self.manager, no_restart=True)
        if self.trainer is not None:
            self.trainer.shutdown()
        remove_groups(self.groups)
        from relax.cluster.embedded import current_session_dir, stop_session

        session = current_session_dir() if self.mode == "embedded" else None
        if ray.is_initialized():
            ray.shutdown()
        if session is not None:  # nothing of the embedded cluster outlives the driver (Ray's agents can)
            stop_session(session, why="the driver is exiting")
        from relax.cluster import scratch

        scratch.sweep()  # this run's scratch on this node, now that its processes are gone (never another run's)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


_OUT_OF_MEMORY = re.compile(r"low on memory|out of memory|OutOfMemoryError|memory monitor", re.IGNORECASE)


def _is_run_failure(exc: BaseException) -> bool:
    """A part of the run failed (a trainer rank, an actor Ray lost): the operator needs one line, not a traceback."""
    from relax.training.group import TrainerRankError, TrainerTimeoutError

    ray_exceptions = sys.modules.get("ray.exceptions")
    ray_error = () if ray_exceptions is None else (ray_exceptions.RayError,)
    return isinstance(exc, (TrainerRankError, TrainerTimeoutError, *ray_error))


def fatal_line(exc: BaseException) -> str:
    """The one line a failed run ends with: what failed, why, and for memory what to change."""
    from relax.training.group import TrainerRankError, TrainerTimeoutError

    cause = str(exc) if isinstance(exc, (TrainerRankError, TrainerTimeoutError)) else failure_cause(exc)
    hint = ("; the node ran out of memory (Ray's memory monitor or the kernel ended the process): lower "
            "--max-tokens-per-gpu or --micro-batch-size, or give the node more memory") if _OUT_OF_MEMORY.search(
        cause) else ""
    return f"training stopped: {cause}{hint}"


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse_args_or_exit(argv)
    os.environ[LOG_LEVEL_ENV] = args.log_level
    setup_logging()
    if not sys.stderr.isatty():  # a file or a job log: Ray's prefixes of actors' lines without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        autoscaler = load_autoscaler_config(args.autoscaler_config) if args.autoscaler_config else None
        plan = build_plan(args, os.environ, autoscaler=autoscaler)
    except ConfigError as exc:
        fail(exc)
    if args.dry_run:
        dry_run_checks(args)
        print(format_plan(plan))
        return manifest_check(args, plan) if args.ray_cluster_manifest else 0
    preflight(args)
    # before Ray starts: its daemons, workers and the engine servers inherit the driver's environment
    driver = Driver(args, plan, autoscaler, secrets=withhold(os.environ, DRIVER_ONLY))
    try:
        return driver.run()
    except ConfigError as exc:
        fail(exc)
    except _RunFailed:  # said in one line already
        return 1
    except KeyboardInterrupt:
        log.warning("stopped by %s", driver.stop.signal_name or "interrupt")
        return 130


if __name__ == "__main__":
    sys.exit(main())
