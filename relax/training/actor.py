"""One trainer rank: an FSDP2-sharded HF causal LM that computes GRPO updates (docs/architecture.md, "Training").

``TrainerActor`` is a plain class; ``relax.training.group.TrainerGroup`` wraps it with ``ray.remote`` and
runs N of them as one ``torch.distributed`` job (gloo on CPU, NCCL on GPUs). Every public method except
``node_ip``/``free_port`` is a *collective*: all ranks must call it, with the same number of
micro-batches, or FSDP's all-gathers hang. The group guarantees that; ranks with fewer samples than
others run zero-loss dummy passes to keep the collectives in step.

How a global batch becomes one optimizer step with the same gradient whatever the split:

* the group computes the *global* denominator of the loss (loss tokens for token-mean, samples with
  loss tokens for sample-mean) and every micro-batch divides its partial sum by it, so the partial
  losses of all micro-batches on all ranks add up to the loss of the whole batch;
* FSDP2 averages gradients over ranks (reduce-scatter with AVG; gloo has no PREMUL_SUM, so
  ``set_gradient_divide_factor`` is not an option), hence each rank scales its loss by the world size;
* gradients accumulate over micro-batches (sharded: FSDP reduces after every backward, which keeps
  memory at 1/N of the model instead of holding unsharded gradients across micro-batches).

``old_log_probs`` are the detached current log-probs: one optimizer step per global batch means the
policy that the PPO ratio compares against *is* the current one, so the ratio is exactly 1 and the clip
only matters for its metrics; the gap that matters, engine vs trainer, is what TIS corrects.

Precision (``TrainerConfig.precision``, docs/training.md "Precision on GPU"): on CUDA the default is FSDP2
mixed precision, bf16 compute with fp32 master weights, fp32 gradient reduction and fp32 AdamW state, TF32
for the fp32 matmuls that remain, SDPA attention, and the model loaded once on rank 0 and broadcast
shard by shard instead of a full fp32 copy on every GPU. On CPU the trainer computes in fp32, as the CPU
tests expect bit for bit.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from relax.config.flags import KLLossType, LRDecayStyle
from relax.logs import setup_logging
from relax.training.batching import MicroBatch, collate
from relax.training.grpo import (
    LossAggregation,
    PolicyLossConfig,
    entropy_from_logits,
    policy_loss,
    token_log_probs,
)
from relax.training.lr_schedule import LRSchedule
from relax.training.precision import (
    PRECISIONS,
    Precision,
    mixed_precision_for,
    precision_fallback_warning,
    resolve_precision,
)
from relax.training.sender import BROADCAST_BUCKET_BYTES, WeightSender
from relax.training.sharding import (
    check_samples,
    loss_denominator,
    num_micro_batches,
    pack_by_tokens,
    sample_tokens,
    split_evenly,
)
from relax.weights.flat_bucket import dtype_from_name
from relax.weights.publication import WeightManifest

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from relax.config.flags import TrainArgs

__all__ = [
    "PRECISIONS",
    "MicroBatch",
    "Precision",
    "TrainerActor",
    "TrainerConfig",
    "check_samples",
    "collate",
    "loss_denominator",
    "mixed_precision_for",
    "num_micro_batches",
    "precision_fallback_warning",
    "resolve_precision",
    "split_evenly",
]

logger = logging.getLogger(__name__)

#: Metrics that are partial sums (their sum over micro-batches and ranks is the global value).
SUM_METRICS = frozenset({"loss", "pg_loss", "num_tokens", "num_samples"})



# --------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class TrainerConfig:
    """What a trainer rank needs from the flags, as a small picklable record (no argparse objects)."""

    hf_checkpoint: str
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # the driver sets the run's length when --lr-decay-iters is not given
    lr_decay_style: LRDecayStyle = LRDecayStyle.CONSTANT
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # <= 0: no clipping (the norm is still reported)
    eps_clip: float = 0.2
    eps_clip_high: float | None = 0.28
    use_tis: bool = False
    tis_clip: float = 2.0
    kl_loss_coef: float = 0.0
    use_kl_loss: bool = False  # the reference model is loaded and the KL logged even at coef 0 (slime's flag)
    kl_loss_type: KLLossType = KLLossType.LOW_VAR_KL
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = False
    rollout_temperature: float = 1.0
    seed: int = 1234
    micro_batch_size: int | None = None  # samples per forward/backward on one rank; None = all at once
    balance_data: bool = False  # --balance-data: ranks get even token counts (training.sharding.split_by_tokens)
    use_dynamic_batch_size: bool = False  # --use-dynamic-batch-size: micro-batches by --max-tokens-per-gpu
    max_tokens_per_gpu: int | None = None
    gradient_checkpointing: bool = False
    dist_timeout_s: float = 600.0  # torch.distributed collective timeout
    precision: Precision = "auto"  # compute dtype on CUDA (CPU always fp32); see resolve_precision

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.rollout_temperature <= 0:
            raise ValueError(f"rollout_temperature must be > 0, got {self.rollout_temperature}")
        self.loss_config()  # validates the clip / TIS settings early, on the driver

    @classmethod
    def from_args(cls, args: TrainArgs, **overrides: Any) -> TrainerConfig:
        """Take the same-named fields of ``TrainArgs``; ``overrides`` win (e.g. a resolved checkpoint path)."""
        names = {f.name for f in fields(cls)}
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        values.update(overrides)
        if not values.get("hf_checkpoint"):
            raise ValueError("TrainerConfig needs hf_checkpoint")
        return cls(**values)

    @property
    def aggregation(self) -> LossAggregation:
        return LossAggregation.TOKEN_MEAN if self.calculate_per_token_loss else LossAggregation.SAMPLE_MEAN

    @property
    def needs_reference(self) -> bool:
        """A frozen reference copy is sharded on every rank: KL in the loss, or only logged (``--use-kl-loss``)."""
        return self.kl_loss_coef > 0 or self.use_kl_loss

    @property
    def token_budget(self) -> int | None:
        """Tokens per micro-batch on one rank, padding included (``training.sharding.pack_by_tokens``)."""
        return self.max_tokens_per_gpu if self.use_dynamic_batch_size else None

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(lr=self.lr, min_lr=self.min_lr, warmup_iters=self.lr_warmup_iters,
                          decay_iters=self.lr_decay_iters, style=LRDecayStyle(self.lr_decay_style))

    def loss_config(self, aggregation: LossAggregation | None = None) -> PolicyLossConfig:
        return PolicyLossConfig(
            eps_clip=self.eps_clip,
            eps_clip_high=self.eps_clip_high,
            use_tis=self.use_tis,
            tis_clip=self.tis_clip,
            kl_coef=self.kl_loss_coef,
            kl_type=KLLossType(self.kl_loss_type),
            log_kl=self.use_kl_loss,
            entropy_coef=self.entropy_coef,
            aggregation=aggregation or self.aggregation,
        )


class _MetricSum:
    """Sums partial-sum metrics and token-weights mean metrics over a rank's micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.tokens = 0

    def add(self, metrics: Mapping[str, float], tokens: int) -> None:
        self.tokens += tokens
        for k, v in metrics.items():
            if k in SUM_METRICS:
                self.sums[k] = self.sums.get(k, 0.0) + v
            else:
                self.weighted[k] = self.weighted.get(k, 0.0) + v * tokens

    def result(self) -> dict[str, float]:
        out = dict(self.sums)
        out.update({k: v / max(self.tokens, 1) for k, v in self.weighted.items()})
        return out


# --------------------------------------------------------------------------------------------------
# Model helpers


def _hf_save_keys(model: torch.nn.Module) -> list[str]:
    """State-dict keys ``save_pretrained`` would write (tied aliases and ignored keys dropped).

    Computed once on the unsharded model, with transformers' own rule when it is available, so a
    published version loads with strict keys wherever the original checkpoint loads.
    """
    state = dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return list(remove_tied_weights_from_state_dict(state, model).keys())
    except ImportError:  # pragma: no cover - older/newer transformers: keep the first name of each storage
        seen: set[int] = set()
        keys = []
        for name, t in state.items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                keys.append(name)
        return keys


def _revert_weight_conversion(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names for models whose in-memory layout differs (transformers 5 fuses some MoE weights)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover
        return state
    return dict(revert_weight_conversion(model, state))


def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the modules HF declares unsplittable (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if units:
        return units
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def _shard(model: torch.nn.Module, mesh: Any, mp_policy: MixedPrecisionPolicy | None = None) -> Any:
    """``fully_shard`` every decoder layer, then the root; all of them get the same precision policy."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    for unit in _shard_units(model):
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _load_hf_model(checkpoint: str, attn_implementation: str | None = None) -> torch.nn.Module:
    """The full model on CPU in float32 (the master weights), via ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **kwargs)


def _sharded_from_rank0(
    full: torch.nn.Module | None,
    checkpoint: str,
    mesh: Any,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy | None,
    *,
    attn_implementation: str | None = "sdpa",
    prepare: Callable[[torch.nn.Module], object] | None = None,
) -> Any:
    """An FSDP2 model whose weights come from rank 0's ``full`` CPU copy (``None`` on the other ranks).

    Why: ``from_pretrained`` on every rank followed by ``.to(cuda)`` puts a whole fp32 model on every GPU
    before sharding (16 GB for a 4B model) and makes every rank read the checkpoint. Here every rank builds
    the model on the meta device (no memory), ``prepare``s it (gradient checkpointing must precede
    ``fully_shard``), shards it, allocates only its own shards (``to_empty``), and
    ``set_model_state_dict(..., broadcast_from_rank0=True)`` streams rank 0's tensors one at a time into
    them: a GPU holds its shards plus one full tensor at most. This is the FSDP2 pattern torch supports
    directly (the same call ``load_checkpoint`` makes). The alternative, every rank reading its own slices of
    the safetensors, spares rank 0's host copy but must redo ``from_pretrained``'s checkpoint->memory name
    and layout conversions (transformers 5 fuses MoE experts) and weight tying; one ``from_pretrained`` on
    rank 0 gets them right by construction. Non-persistent buffers (rotary ``inv_freq``) are in no state
    dict, and ``to_empty`` leaves them uninitialised: they are broadcast from rank 0's copy as well.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf_config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **kwargs)
    if prepare is not None:
        prepare(model)
    _shard(model, mesh, mp_policy)
    model.to_empty(device=device)
    state = dict(full.state_dict()) if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = set(model.state_dict())
    source = dict(full.named_buffers()) if full is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in persistent:
                continue
            if full is not None:
                buffer.copy_(source[name])
            dist.broadcast(buffer, src=0)
    if full is not None and hasattr(full, "_weight_conversions"):
        # How from_pretrained mapped checkpoint names; full_state_dict (rank 0) reverts it on publication.
        model._weight_conversions = full._weight_conversions
    return model


def _pad_token_id(hf_config: Any) -> int:
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(hf_config, "eos_token_id", None)
    return int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0


def _allow_tf32() -> None:
    """Let the fp32 matmuls and convolutions that remain on CUDA use TF32 tensor cores (process-wide)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


# --------------------------------------------------------------------------------------------------
# The actor


class TrainerActor:
    """Rank ``r`` of ``N``: owns one FSDP2 shard of the policy (and of the reference, when KL is on)."""

    def __init__(self) -> None:
        self.rank = -1
        self.world_size = 0
        self.config: TrainerConfig | None = None
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.device = torch.device("cpu")
        self.precision = "fp32"  # resolved in init: what the forward/backward compute in
        self.grad_scaler: Any = None  # dynamic loss scaling, fp16 only (bf16 has fp32's exponent range)
        self.pad_token_id = 0
        self.step = 0  # optimizer steps taken (restored by load_checkpoint)
        self._warned_over_budget = False  # a sample over the token budget is said once
        self._hf_keys: list[str] = []
        self.sender: WeightSender | None = None  # rank 0, once it holds weights for broadcast

    # ---- placement helpers (not collective)

    def node_ip(self) -> str:
        from relax.cluster.network import node_ip

        return node_ip()

    def free_port(self) -> int:
        from relax.cluster.network import free_port

        return free_port(self.node_ip())

    # ---- lifecycle

    def init(self, rank: int, world_size: int, master_addr: str, master_port: int, config: TrainerConfig) -> dict:
        """Join the process group, load and shard the model, build AdamW. Returns a short description."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        torch.set_num_threads(1)
        _quiet_transformers()
        if not logging.getLogger().handlers:
            setup_logging()
        self.rank, self.world_size, self.config = rank, world_size, config
        os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(world_size))
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each rank one visible GPU
            self.device, backend = torch.device("cuda", 0), "nccl"
        else:
            self.device, backend = torch.device("cpu"), "gloo"
        timeout = timedelta(seconds=config.dist_timeout_s)
        if rank == 0:  # the group's store listens on master_addr only, not on every interface
            from relax.weights.rendezvous_store import bound_store

            store = bound_store(str(master_addr), int(master_port), world_size, config.dist_timeout_s)
        else:
            store = dist.TCPStore(str(master_addr), int(master_port), world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        _seed_everything(config.seed)
        self.precision = resolve_precision(config.precision, self.device.type)
        warning = precision_fallback_warning(config.precision, self.device.type)
        if warning and rank == 0:
            logger.warning(warning)
        mp_policy = mixed_precision_for(config.precision, self.device.type)

        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (world_size,))
        if self.device.type == "cuda":
            _allow_tf32()
            self._load_from_rank0(config, mesh, mp_policy)
        else:
            self._load_on_every_rank(config, mesh)
        self.model.train()
        if self.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.grad_scaler = ShardedGradScaler(device=self.device.type)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps, weight_decay=config.weight_decay,
        )
        num_params = sum(p.numel() for p in self.model.parameters())
        elapsed = time.perf_counter() - t0
        logger.info("trainer rank %d/%d: ready on %s (%s), precision %s, %d params, reference=%s, %.1fs", rank,
                    world_size, self.device, backend, self.precision, num_params, self.ref_model is not None,
                    elapsed)
        return {"rank": rank, "device": str(self.device), "backend": backend, "precision": self.precision,
                "num_params": num_params, "init_s": elapsed}

    @staticmethod
    def _prepare_policy(model: torch.nn.Module, config: TrainerConfig) -> None:
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    def _load_on_every_rank(self, config: TrainerConfig, mesh: Any) -> None:
        """CPU: every rank loads the fp32 checkpoint and keeps its shard (the models CPU runs fit in RAM)."""
        model = _load_hf_model(config.hf_checkpoint)
        self._hf_keys = _hf_save_keys(model)
        self.pad_token_id = _pad_token_id(model.config)
        self._prepare_policy(model, config)
        self.model = _shard(model.to(self.device), mesh)
        if config.needs_reference:
            ref = _load_hf_model(config.hf_checkpoint)
            ref.requires_grad_(False)
            self.ref_model = _shard(ref.to(self.device), mesh).eval()

    def _load_from_rank0(self, config: TrainerConfig, mesh: Any, mp_policy: MixedPrecisionPolicy | None) -> None:
        """CUDA: rank 0 loads the checkpoint once, on CPU; policy and reference are filled from that copy.

        See ``_sharded_from_rank0`` for why. A rank-0 load failure is shared with every rank, so the others
        raise too instead of waiting in the broadcast.
        """
        import torch.distributed as dist

        full: torch.nn.Module | None = None
        box: list[Any] = [None, []]
        if self.rank == 0:
            try:
                full = _load_hf_model(config.hf_checkpoint, attn_implementation="sdpa")
                box[1] = _hf_save_keys(full)  # needs real storages to tell tied aliases apart
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                box[0] = f"loading {config.hf_checkpoint} failed: {type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RuntimeError(f"rank 0: {box[0]}")
        self._hf_keys = list(box[1])
        self.model = _sharded_from_rank0(full, config.hf_checkpoint, mesh, self.device, mp_policy,
                                         prepare=lambda m: self._prepare_policy(m, config))
        if config.needs_reference:
            self.ref_model = _sharded_from_rank0(full, config.hf_checkpoint, mesh, self.device, mp_policy,
                                                 prepare=lambda m: m.requires_grad_(False)).eval()
        del full
        self.pad_token_id = _pad_token_id(self.model.config)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.sender is not None:
            self.sender.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        logger.info("trainer rank %d/%d: shut down", self.rank, self.world_size)

    # ---- forward passes

    def _cfg(self) -> TrainerConfig:
        if self.config is None or self.model is None:
            raise RuntimeError("trainer rank is not initialised; call init() first")
        return self.config

    def _response_logits(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """Logits that predict each response token: ``[B, T, V]``."""
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                    logits_to_keep=mb.logits_to_keep, use_cache=False)
        logits = out.logits
        index = mb.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)

    def _dummy_forward(self, model: Any) -> torch.Tensor:
        """A one-token pass that keeps FSDP's collectives in step on a rank with no samples left."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits

    def _micro_batches(self, samples: Sequence[Mapping[str, Any]], n: int | None) -> list[list[int]]:
        """This rank's shard cut as ``training.sharding.micro_batches`` cuts it (by the token budget, else
        evenly): the indices of each micro-batch, padded with empty ones to the ``n`` every rank runs."""
        cfg = self._cfg()
        budget = cfg.token_budget
        if budget is None:
            count = n or num_micro_batches([len(samples)], cfg.micro_batch_size)
            return split_evenly(list(range(len(samples))), count)
        packs = pack_by_tokens([sample_tokens(s) for s in samples], budget, cfg.micro_batch_size)
        over = [sample_tokens(samples[p[0]]) for p in packs if sample_tokens(samples[p[0]]) > budget]
        if over and not self._warned_over_budget:
            self._warned_over_budget = True
            logger.warning("trainer rank %d: a sample of %d tokens is over --max-tokens-per-gpu %d: it is trained "
                           "in a micro-batch of its own (said once)", self.rank, max(over), budget)
        n = len(packs) if n is None else n
        if n < len(packs):
            raise ValueError(f"{len(packs)} micro-batches needed, {n} planned: the plan used another budget")
        return packs + [[] for _ in range(n - len(packs))]

    # ---- training

    def train_step(
        self,
        samples: Sequence[Mapping[str, Any]],
        global_denominator: float,
        *,
        num_micro_batches: int | None = None,
        aggregation: LossAggregation | str | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard of a global batch (collective).

        ``global_denominator``: ``loss_denominator(all samples of the global batch, aggregation)``.
        ``num_micro_batches``: the same on every rank (``num_micro_batches(shard sizes, mbs)``); defaults to
        what this rank's shard needs, which is only safe with one rank.
        ``aggregation`` overrides the configured one (token-mean vs sample-mean) for this step.

        Metrics are rank-local: ``loss``, ``pg_loss``, ``num_tokens``, ``num_samples`` are this rank's
        partial sums (their sum over ranks is the global value), the others are means over this rank's
        loss tokens, ``grad_norm`` is the global norm before clipping (the same on every rank).
        """
        cfg = self._cfg()
        t0 = time.perf_counter()
        agg = LossAggregation(aggregation) if aggregation is not None else None
        loss_cfg = cfg.loss_config(agg)
        if global_denominator <= 0:
            raise ValueError(f"global_denominator must be > 0, got {global_denominator}")
        self.model.train()
        acc = _MetricSum()
        for pack in self._micro_batches(samples, num_micro_batches):
            if pack:
                metrics, tokens = self._train_micro_batch([samples[i] for i in pack], loss_cfg, global_denominator)
                acc.add(metrics, tokens)
            else:
                self._dummy_backward()
        lr = cfg.lr_schedule().at(self.step)  # from the step counter: a resumed run continues the schedule
        grad_norm, skipped = self._clip_and_step(lr)
        self.step += 1
        out = acc.result()
        out.update(grad_norm=grad_norm, skipped=float(skipped), lr=lr, num_tokens=float(acc.tokens),
                   num_samples=float(len(samples)), step=float(self.step), step_time_s=time.perf_counter() - t0,
                   peak_memory_mb=_peak_memory_mb(self.device))
        if self.grad_scaler is not None:
            out["loss_scale"] = float(self.grad_scaler.get_scale())
        logger.debug("trainer rank %d/%d: step %d, %d samples, %d tokens, loss %.5f, grad_norm %.4f, %.3fs%s",
                    self.rank, self.world_size, self.step, len(samples), acc.tokens, out.get("loss", 0.0),
                    grad_norm, out["step_time_s"], " (skipped: non-finite grad norm)" if skipped else "")
        return out

    def _train_micro_batch(
        self, chunk: Sequence[Mapping[str, Any]], loss_cfg: PolicyLossConfig, denominator: float
    ) -> tuple[dict[str, float], int]:
        cfg = self._cfg()
        mb = collate(chunk, self.pad_token_id, self.device, need_rollout_log_probs=loss_cfg.use_tis)
        logits = self._response_logits(self.model, mb)
        log_probs = token_log_probs(logits, mb.targets, cfg.rollout_temperature)
        if loss_cfg.entropy_coef:
            entropy = entropy_from_logits(logits, cfg.rollout_temperature)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), cfg.rollout_temperature)
        ref_log_probs = None
        if loss_cfg.kl_coef or loss_cfg.log_kl:
            with torch.no_grad():
                ref_logits = self._response_logits(self.ref_model, mb)
                ref_log_probs = token_log_probs(ref_logits, mb.targets, cfg.rollout_temperature)
        loss, metrics = policy_loss(
            log_probs, log_probs.detach(), mb.advantages, mb.loss_mask, loss_cfg,
            rollout_log_probs=mb.rollout_log_probs, ref_log_probs=ref_log_probs, entropy=entropy,
            denominator=denominator,
        )
        # FSDP averages gradients over ranks; the loss is already a share of the global mean.
        loss = loss * self.world_size
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()
        return metrics, mb.num_loss_tokens

    def _dummy_backward(self) -> None:
        """Mirror ``_train_micro_batch``'s collectives in the same order: policy forward, reference
        forward, policy backward (another order pairs one rank's all-gather with another's and aborts)."""
        logits = self._dummy_forward(self.model)
        if self.ref_model is not None:
            with torch.no_grad():
                self._dummy_forward(self.ref_model)
        (logits.sum() * 0.0).backward()

    def _clip_and_step(self, lr: float) -> tuple[float, bool]:
        """Clip to ``clip_grad`` (global norm over the DTensor shards) and step at rate ``lr``; skip non-finite
        updates.

        With fp16 the gradients are unscaled first, so norm, clip and step see the true ones; an overflow
        (a non-finite norm) skips the step and the scaler backs off, as in Megatron's dynamic loss scaling.
        """
        cfg = self._cfg()
        assert self.optimizer is not None
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        skipped = not math.isfinite(grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._weights_may_change()
        if not skipped and scaler is not None:
            scaler.step(self.optimizer)
        elif not skipped:
            self.optimizer.step()
        if scaler is not None:
            scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    # ---- inference

    @torch.no_grad()
    def compute_log_probs(
        self, samples: Sequence[Mapping[str, Any]], *, num_micro_batches: int | None = None
    ) -> list[list[float]]:
        """Per-token log-probs of each response (at the rollout temperature), without gradient (collective)."""
        cfg = self._cfg()
        out: list[list[float]] = [[] for _ in samples]
        for pack in self._micro_batches(samples, num_micro_batches):
            if not pack:
                self._dummy_forward(self.model)
                continue
            mb = collate([samples[i] for i in pack], self.pad_token_id, self.device, need_advantages=False)
            lp = token_log_probs(self._response_logits(self.model, mb), mb.targets, cfg.rollout_temperature)
            lp = lp.float().cpu()
            for row, (i, n) in enumerate(zip(pack, mb.response_lengths, strict=True)):  # in the samples' order
                out[i] = lp[row, :n].tolist()
        return out

    # ---- weights and checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather the full weights (collective): rank 0 gets CPU float32 tensors with HF names, others None."""
        from torch.distributed.tensor import DTensor

        self._cfg()
        t0 = time.perf_counter()
        state = self.model.state_dict()
        out: dict[str, torch.Tensor] = {}
        for name in self._hf_keys:
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
            if self.rank == 0:
                out[name] = full.detach().to("cpu", torch.float32)
            del full
        if self.rank != 0:
            return None
        out = _revert_weight_conversion(self.model, out)
        logger.debug("trainer rank %d/%d: gathered %d tensors (%.1f MiB) in %.3fs", self.rank, self.world_size,
                    len(out), sum(t.numel() * 4 for t in out.values()) / 2**20, time.perf_counter() - t0)
        return out

    # ---- broadcast weight updates (relax.training.sender; the manager drives them)

    def hold_weights(self, version: int, dtype: str | None = None, backend: str = "gloo",
                     bucket_bytes: int = BROADCAST_BUCKET_BYTES, layout: str = "hf") -> WeightManifest | None:
        """Gather the full weights (collective) and keep them on rank 0 for broadcast as ``version``.

        Returns the manifest (rank 0; others None) as soon as the weights are gathered: the bytes stay here and are
        copied into the send buffers in the background, only their description travels. ``layout`` is how the
        engines hold the model, which is what the version's checksums are of (``relax.weights.digest``).
        """
        state = self.full_state_dict()
        if self.rank != 0:
            return None
        assert state is not None
        if self.sender is None:
            from relax.cluster.network import node_ip

            device = self.device if backend == "nccl" else torch.device("cpu")
            self.sender = WeightSender(node_ip(), device=device)
        return self.sender.hold(version, state, dtype=dtype_from_name(dtype) if dtype else None,
                                bucket_bytes=bucket_bytes, layout=layout)

    def _weights_may_change(self) -> None:
        """Before the weights change in place: a version held for broadcast is copied in behind its hold, from
        tensors that may share memory with the parameters, so its copies must be done first."""
        if self.sender is not None:
            self.sender.wait_copied()

    def _sender(self) -> WeightSender:
        if self.sender is None:
            raise RuntimeError(f"trainer rank {self.rank} holds no weights for broadcast (only rank 0 sends, "
                               "after hold_weights)")
        return self.sender

    # These run in the actor's "weights" concurrency group: never behind a training step.
    def weights_open(self, name: str, world_size: int, backend: str, timeout_s: float) -> dict[str, Any]:
        return self._sender().open(name, world_size, backend, timeout_s)

    def weights_wait_open(self, name: str, timeout_s: float) -> None:
        self._sender().wait_open(name, timeout_s)

    def weights_acquire(self, version: int, lease_s: float) -> bool:
        return self._sender().acquire(version, lease_s)

    def weights_release(self, version: int) -> None:
        self._sender().release(version)

    def weights_checksums(self, version: int, timeout_s: float, algorithm: str = "sha256") -> dict[str, str]:
        return self._sender().checksums(version, timeout_s, algorithm)

    def weights_broadcast(self, name: str, version: int, index: int) -> int:
        return self._sender().broadcast(name, version, index)

    def weights_close(self, name: str) -> bool:
        return self.sender.close(name) if self.sender is not None else False

    def _rank0_outcome(self, error: str | None) -> None:
        """Share rank 0's success or error with every rank, so no rank waits on a failed rank 0."""
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RuntimeError(f"rank 0: {box[0]}")

    def save_checkpoint(self, ckpt_dir: str, extra: dict | None = None) -> str:
        """Write a checkpoint (collective; rank 0 writes). See ``relax.training.checkpoint`` for the layout."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from relax.training.checkpoint import TrainerCheckpoint, write_checkpoint

        cfg = self._cfg()
        t0 = time.perf_counter()
        weights = self.full_state_dict()
        optim = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        error = None
        if self.rank == 0:
            try:
                assert weights is not None
                write_checkpoint(ckpt_dir, model_state=weights, optimizer_state=optim, hf_dir=cfg.hf_checkpoint,
                                 state=TrainerCheckpoint(self.step, self.world_size, dict(extra or {})))
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = f"saving {ckpt_dir} failed: {type(exc).__name__}: {exc}"
        self._rank0_outcome(error)
        logger.debug("trainer rank %d/%d: saved checkpoint %s (step %d) in %.2fs", self.rank, self.world_size,
                    ckpt_dir, self.step, time.perf_counter() - t0)
        return str(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore weights, optimizer moments and the step counter from ``ckpt_dir`` (collective).

        Rank 0 reads the files and the state is broadcast, so the saving world size does not matter.
        Hyper-parameters (lr, betas, eps, weight decay) come from this run's config, not the checkpoint:
        a resumed run may change them on purpose. Returns the ``extra`` dict given to ``save_checkpoint``.
        """
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from relax.training.checkpoint import read_optimizer_state, read_trainer_state

        self._cfg()
        t0 = time.perf_counter()
        weights: dict[str, torch.Tensor] = {}
        optim: dict[str, Any] = {}
        state = None
        error = None
        if self.rank == 0:
            try:
                from transformers import AutoModelForCausalLM

                state = read_trainer_state(ckpt_dir)
                # from_pretrained applies the checkpoint->memory name conversions and re-ties aliases.
                loaded = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
                weights = dict(loaded.state_dict())
                optim = read_optimizer_state(ckpt_dir)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = f"loading {ckpt_dir} failed: {type(exc).__name__}: {exc}"
        self._rank0_outcome(error)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        self._weights_may_change()
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)
        self._apply_hyperparameters()
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
        assert state is not None
        self.step = state.step
        logger.info("trainer rank %d/%d: loaded checkpoint %s (step %d, saved by %d ranks) in %.2fs", self.rank,
                    self.world_size, ckpt_dir, self.step, state.world_size, time.perf_counter() - t0)
        return state.extra

    def _apply_hyperparameters(self) -> None:
        cfg = self._cfg()
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group.update(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                         weight_decay=cfg.weight_decay)

    # ---- introspection (tests, debugging)

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "step": self.step, "device": str(self.device),
                "precision": self.precision, "pid": os.getpid(), "reference": self.ref_model is not None}


def _peak_memory_mb(device: torch.device) -> float:
    """The rank's high-water mark so far: CUDA memory allocated on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
