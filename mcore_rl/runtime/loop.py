"""The RL loop driver, `mcore-rl train` (docs/design.md#data-flow):

    prompts -> rollout scheduler -> engine(s): tokens, μ, policy version -> rewards
    -> learner: π_old (and π_ref), advantages, mismatch correction, optimizer steps over mini-batches
    -> weight sync to the engine(s) -> periodic held-out evaluation -> checkpoints -> next step.

Paper methods that need more than a pure tensor function act through the hooks of their recipe
(`mcore_rl/hooks.py`, one module each in `mcore_rl/recipes/`); the loop calls the hooks of the
active recipes at fixed points of the step and names none of them.

Rollouts take one path (`runtime/rollouts.py` over `runtime/scheduler.py`) in two schedules.
Synchronous (`rollout.runtime: sync`): the engines generate one batch with the current weights, in
rounds the scheduler submits together, the learner trains on it, the new weights are synced, and
only then is the next batch generated. Asynchronous (`rollout.runtime: async`): the engines are
processes that generate all the time; the scheduler on rank 0 streams groups within the staleness
bound and the learner takes each batch from its buffer. With `max_staleness: 0` it gives the
synchronous schedule's samples and losses. Global rank 0 holds the engines (embedded `EngineCore`s,
or clients of HTTP servers) and broadcasts each batch of samples to the other ranks; every rank
runs the learner.

A checkpoint (after a rollout step) holds the model, optimizer moments, LR schedule, RNG streams,
the prompt streams' positions, the recipes' states, the step/version counters, the scheduler's
sample ledger, buffered groups and prompts in flight, so a resumed run draws the same prompts,
neither repeats nor skips one, and continues the same metrics a run without interruption would
(records a killed run logged after its last checkpoint are dropped first, so each step appears
once). `accounting.json` in the run directory says where every drawn prompt went.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

import torch.distributed as dist

from mcore_rl import hooks
from mcore_rl.config import RLConfig, config_to_dict, save_config, validate_rl_config
from mcore_rl.data.samples import Sample
from mcore_rl.parallel.preemption import preempted, stop_requested
from mcore_rl.runtime.accounting import record_trained_prompts
from mcore_rl.observe import ttfs
from mcore_rl.observe.plot import plot_curves
from mcore_rl.observe.run import RunObserver
from mcore_rl.observe.sinks import read_metrics
from mcore_rl.progress import is_rank0 as _rank0
from mcore_rl.progress import log_line as _log
from mcore_rl.progress import progress
from mcore_rl.train.policy import build_policy
from mcore_rl.train import checkpoint
from mcore_rl.train.teachers import build_engine_teachers
from mcore_rl.train.policy import build_reference_model, copy_weights
from mcore_rl.rollout.pool import HTTPEnginePool  # lazy, as the trainer's other parts here
from mcore_rl.rollout.pool import build_engine_pool
from mcore_rl.train.hf_provenance import carry_provenance
from mcore_rl.train.checkpoint import checkpoint_dir
from mcore_rl.train.teachers import token_topk
from mcore_rl.train.hf_provenance import read_provenance
from mcore_rl.train.warm_start import load_initial_weights, sft_warm_start
from mcore_rl.train.teachers import build_teachers
from mcore_rl.rollout.classifier import RewardServerError, check_served_reward_model
from mcore_rl.rollout.judges import JudgeEngines
from mcore_rl.rollout.teacher import TeacherError

if TYPE_CHECKING:  # annotations only: the trainer's parts are imported when the run builds them
    from mcore_rl.rollout.pool import EmbeddedEnginePool
    from mcore_rl.runtime.rollout_manager import RolloutManager
    from mcore_rl.train.critic import Critic
    from mcore_rl.train.rl_step import Learner
    from mcore_rl.train.teachers import Teachers
    from mcore_rl.train.weight_sync import WeightSync

if TYPE_CHECKING:
    from mcore_rl.runtime.rollouts import Rollouts

logger = logging.getLogger(__name__)


@dataclass
class LoopState:
    rl_step: int = 0  # rollout steps done
    opt_step: int = 0  # optimizer steps done (updates a recipe rolled back included)
    version: int = 0  # weight version of the trainer's current weights (every sync makes a new one)
    samples_trained: int = 0


def broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_generative_judges(cfg: RLConfig, judge_urls: dict[str, list[str]], groups_only: bool = False) -> None:
    """Every `generative_rm` head's score tokens must each be one token of its judge's tokenizer (the
    judge's `/tokenize`), before any sample is scored: ValueError naming the head's `score_tokens`.
    The heads with a `url` (`groups_only` False), or those naming a judge group, once it is up."""
    from mcore_rl.rewards.generative_rm import SCORE_TOKENS, check_score_tokens  # lazy: aiohttp

    for i, d in enumerate(cfg.data.domains):
        for j, h in enumerate(d.rewards):
            if h.name != "generative_rm" or ("judge" in h.options) != groups_only:
                continue
            url = judge_urls.get(h.options["judge"]) if groups_only else h.options.get("url")
            if not url:
                continue
            try:
                check_score_tokens(url, h.options.get("score_tokens", SCORE_TOKENS), h.options.get("api_key"))
            except ValueError as err:
                raise ValueError(f"data.domains[{i}].rewards[{j}].options.{err}") from None


class RLRun:
    """All state of one `mcore-rl train` process (one rank)."""

    def __init__(self, cfg: RLConfig) -> None:
        from mcore_rl.agent.groups import environment_examples  # lazy: the engine stack
        from mcore_rl.data.prompts import build_prompt_sets  # lazy: numpy

        self.t0 = time.perf_counter()
        self.cfg = cfg
        policy = build_policy(cfg, validate_rl_config, max(1, cfg.train.num_steps * cfg.optimizer_steps_per_rollout))
        self.world, self.tokenizer = policy.world_size, policy.tokenizer
        self.chunks, self.optimizer = policy.chunks, policy.optimizer
        self.rank0 = _rank0()
        self.state = LoopState()
        prompt_sets = build_prompt_sets(cfg, self.tokenizer, environment_examples)
        self.prompts, self.val_prompts = prompt_sets.train, prompt_sets.validation
        self.eval_prompts, self.held_out_texts = prompt_sets.eval_prompts, prompt_sets.held_out_texts
        self.ref_chunks: list | None = None
        self.critic: Critic | None = None  # the value model of an advantage that reads one (gae, steppo)
        self.recipes: list[hooks.Recipe] = hooks.active(cfg)  # the paper methods of the run, as plug-ins
        self.learner: Learner | None = None  # set by run_rl (its stateful distillation terms are checkpointed)
        self.engines: EmbeddedEnginePool | HTTPEnginePool | None = None
        self.weight_sync: WeightSync | None = None
        self.manager: RolloutManager | None = None
        self.rollout_source: Rollouts | None = None  # rank 0: the scheduler, in either schedule
        self.hf_provenance: dict = {}  # the source's HF config, dtype and assets, carried (train/hf_provenance.py)
        self.teachers: Teachers | None = None  # on-policy distillation (`teachers:`), train/teachers.py
        self.judges: JudgeEngines | None = None  # judge servers (`judges:`) the rewards call
        self._engine_teachers: list = []  # rank 0: connected before the Teachers set exists
        self._rollout_state: dict | None = None  # the scheduler's state from a checkpoint
        self._resumed_ledger: dict | None = None  # a checkpoint's ledger without scheduler state
        self.eval_history: list[dict[str, float]] = []
        self.init_metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- setup

    def initialise(self) -> None:
        """Resume, or start from init.checkpoint / the SFT warm start; then engines and first sync."""

        cfg = self.cfg
        engine_teachers = self._connect_teachers()  # an unreachable or mismatched teacher fails here, first
        self._check_reward_servers()  # so does a served reward model with another tokenizer
        resume = checkpoint.latest_checkpoint(cfg.checkpoint.load_dir) if cfg.checkpoint.load_dir else None
        if cfg.checkpoint.load_dir and resume is None:
            raise FileNotFoundError(f"checkpoint.load_dir {cfg.checkpoint.load_dir!r} holds no checkpoint")
        if resume is not None:
            common = checkpoint.load_checkpoint(resume, self.chunks, self.optimizer)

            self.hf_provenance = read_provenance(common, resume)
            if "rl" not in common:
                raise ValueError(
                    f"{resume} is not an `mcore-rl train` checkpoint (no RL state); start from it with "
                    "init.checkpoint instead of checkpoint.load_dir"
                )
            self.optimizer.reload_model_params()
            rl = common["rl"]
            self.state = LoopState(**rl["state"])
            self.prompts.load_state_dict(rl["prompts"])
            self.val_prompts.load_state_dict(rl["val_prompts"])
            self._rollout_state = rl.get("rollout")
            self._resumed_ledger = rl.get("ledger")
            for recipe in self.recipes:
                if recipe.state_key is not None and rl.get(recipe.state_key):
                    recipe.load_state_dict(rl[recipe.state_key])
            self._resume_common = rl
            ttfs.mark("checkpoint_load")
            _log(f"resumed from {resume} at rollout step {self.state.rl_step} (optimizer step {self.state.opt_step})")
        else:
            self._resume_common = None

            if cfg.init.checkpoint:
                self.hf_provenance = load_initial_weights(cfg.init.checkpoint, self.chunks, _log)
                self.optimizer.reload_model_params()
                ttfs.mark("checkpoint_load")
            if cfg.init.sft.train.train_iters > 0:
                self.init_metrics = sft_warm_start(
                    cfg, self.chunks, self.tokenizer, self.world, _log, self.held_out_texts
                )
                self.optimizer.reload_model_params()
                ttfs.mark("warm_start")
        self._build_reference(resume)
        ttfs.mark("reference_model")
        self._build_critic(resume)
        if cfg.teachers:
            self.teachers = build_teachers(cfg, self.tokenizer, self.chunks, engine_teachers, self.state.version)
        for recipe in self.recipes:
            recipe.setup(self)
        self._build_engines()
        ttfs.mark("engine_start")
        self.sync(new_version=resume is None)
        ttfs.mark("first_weight_sync")

    def _connect_teachers(self) -> list:
        """Rank 0 connects to (or starts) the engine teachers and checks them; every rank raises
        if one is unreachable or has another tokenizer."""
        if not any(t.kind == "engine" for t in self.cfg.teachers):
            return []

        made: list = []
        error = None
        if self.rank0:
            try:
                made = build_engine_teachers(self.cfg, self.tokenizer, os.path.join(self.cfg.run_dir, "teachers"))
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        error = broadcast(error)
        if error is not None:
            raise TeacherError(error)
        self._engine_teachers = made
        return made

    def _check_reward_servers(self) -> None:
        """Rank 0 probes every reward model a domain scores over `url` (`reward_model`, `prm`) and
        every rank raises if one is unreachable or does not read the policy's tokens
        (`rollout/classifier.py: check_served_reward_model`), before any sample is scored."""
        served = [
            (f"data.domains[{i}].rewards[{j}].options.url", h.options["url"], h.options.get("api_key"))
            for i, d in enumerate(self.cfg.data.domains)
            for j, h in enumerate(d.rewards)
            if h.name in ("reward_model", "prm") and isinstance(h.options.get("url"), str)
        ]
        judges = any(h.name == "generative_rm" and "url" in h.options for d in self.cfg.data.domains for h in d.rewards)
        if not served and not judges:
            return
        error = None
        if self.rank0:
            try:
                for who, url, api_key in served:
                    check_served_reward_model(url, self.tokenizer, who, api_key)
                check_generative_judges(self.cfg, {})
            except (RewardServerError, ValueError) as err:
                error = str(err)
        error = broadcast(error)
        if error is not None:
            raise RewardServerError(error)

    def _build_reference(self, resume: str | None) -> None:
        """π_ref for the KL term: a frozen copy of the starting weights (saved with the checkpoints)."""

        cfg = self.cfg
        if not cfg.algorithm.uses_reference():
            return
        self.ref_chunks = build_reference_model(cfg)
        if resume is not None:
            root = cfg.checkpoint.load_dir  # the save_dir, or one of its iter_* directories
            assert root is not None  # `resume` was found in it
            if os.path.exists(os.path.join(root, "metadata.json")):
                root = os.path.dirname(os.path.normpath(root))
            ref_dir = os.path.join(root, "reference")
            path = checkpoint.latest_checkpoint(ref_dir) if os.path.isdir(ref_dir) else None
            if path is None:
                raise FileNotFoundError(
                    f"the run keeps π_ref (algorithm.kl_coef > 0 or reference_model) but {ref_dir} "
                    "holds no reference-model checkpoint "
                    "to resume with"
                )
            checkpoint.load_checkpoint(path, self.ref_chunks, None)
            return
        copy_weights(self.ref_chunks, self.chunks)
        if cfg.checkpoint.save_dir:
            checkpoint.save_checkpoint(
                os.path.join(cfg.checkpoint.save_dir, "reference"),
                0,
                self.ref_chunks,
                None,
                {"model": config_to_dict(cfg.model)},
            )

    def _build_critic(self, resume: str | None) -> None:
        """The critic of an advantage that reads one (train/critic.py): the critic saved at the resumed
        step, else `algorithm.critic.init_checkpoint`, else the policy's starting weights."""
        from mcore_rl.algos import registry
        from mcore_rl.algos.critic import takes_values
        from mcore_rl.train.critic import build_critic  # lazy: megatron

        cfg = self.cfg
        if not takes_values(registry.get("advantage", cfg.algorithm.advantage)):
            return
        total = max(1, cfg.train.num_steps * cfg.optimizer_steps_per_rollout)
        self.critic = build_critic(cfg, total, self.tokenizer.pad_id)
        if resume is not None:
            assert cfg.checkpoint.load_dir is not None  # `resume` was found in it
            _log(f"critic resumed from {self.critic.resume(cfg.checkpoint.load_dir, self.state.rl_step)}")
        elif cfg.algorithm.critic.init_checkpoint:
            self.critic.load_value_model(cfg.algorithm.critic.init_checkpoint)
        else:
            self.critic.copy_policy(self.chunks)
        ttfs.mark("critic")

    def _http_engines(self) -> HTTPEnginePool:
        """The pool of the asynchronous runtime and of colocated engines: `mcore-rl serve` processes or
        servers (the validation allows no other)."""

        if not isinstance(self.engines, HTTPEnginePool):
            raise RuntimeError(f"this needs HTTP engines (mcore-rl serve or SGLang), not {type(self.engines).__name__}")
        return self.engines

    def _build_engines(self) -> None:
        from mcore_rl.runtime.rollout_manager import RolloutManager, build_reward_runner  # lazy: import cycle
        from mcore_rl.runtime.rollouts import PoolBackend, Rollouts, scheduler_config  # lazy: import cycle
        from mcore_rl.train.weight_sync import WeightSync  # lazy: transformers

        cfg, r = self.cfg, self.cfg.rollout
        transport = None
        if self.rank0:
            self.engines = build_engine_pool(
                r,
                cfg.model,
                self.tokenizer,
                cfg.train.seed,
                workdir=os.path.join(cfg.run_dir, "engines"),
                tokenizer_path=cfg.data.tokenizer_path,
            )
            transport = self.engines.weight_transport(r)
            if hasattr(transport, "pause_mode"):
                transport.pause_mode = r.pause_mode
            for recipe in self.recipes:
                recipe.engines_ready(self)  # e.g. a recipe's own engines (checked before training)
            if cfg.judges:  # judge servers the rewards name (started ones: this run's, stopped with it)
                self.judges = JudgeEngines(
                    cfg.judges,
                    workdir=os.path.join(cfg.run_dir, "engines"),
                    context_length=r.context_length,
                    startup_timeout_s=r.engine_startup_timeout_s,
                )
            judge_urls = self.judges.urls if self.judges is not None else None
            check_generative_judges(cfg, judge_urls or {}, groups_only=True)  # generative RMs in a judge group
            self.manager = RolloutManager(self.engines, self.prompts, build_reward_runner(cfg, judge_urls), cfg)
            if self._rollout_state is not None:
                self.prompts.load_state_dict(self._rollout_state["prompts"])
            # engine teachers score right after the rewards in the streaming schedule
            streaming = r.runtime == "async" and self.teachers is not None and self.teachers.engine_teachers
            backend = PoolBackend(
                self.engines,
                self.prompts,
                self.manager.rewards,
                self.manager,
                cfg,
                teachers=self.teachers if streaming else None,
                recipes=self.recipes,
            )
            self.rollout_source = Rollouts(
                self.engines,
                backend,
                scheduler_config(cfg),
                self._rollout_state,
                steps_done=self.state.rl_step,
                engine_loop=self.manager.engine_loop,  # one loop with the evaluation of agent domains
            )
            if self._rollout_state is None and self._resumed_ledger:  # a checkpoint of the synchronous loop
                self.rollout_source.scheduler.ledger.load_state_dict(self._resumed_ledger)
        self.weight_sync = WeightSync(
            self.chunks,
            cfg.model,
            transport,
            bucket_bytes=r.sync_bucket_mb << 20,
            quantization="fp8" if r.quantization == "fp8" else None,
        )

    def sync(self, new_version: bool = True) -> None:
        """Ship the trainer's weights to the engine(s) (collective); a new weight version unless
        re-shipping the weights of the current one (after a resume)."""
        if new_version:
            self.state.version += 1
        start = time.perf_counter()
        assert self.weight_sync is not None  # built with the engines
        self.weight_sync.sync(self.state.version)
        self.last_sync_s = time.perf_counter() - start

    # ---------------------------------------------------------------- one step

    def rollouts(self) -> tuple[list[Sample], dict[str, float]]:
        """The next training batch (every rank): from the rollout scheduler on rank 0, broadcast."""
        from mcore_rl.runtime.rollout_manager import reward_metrics

        start = time.perf_counter()
        per_domain = bool(self.cfg.data.domains)  # a multi-domain run: metrics by domain too
        while True:
            msg: Any = None
            if self.rank0:
                assert self.rollout_source is not None
                got = self.rollout_source.next_batch(self.state.version, self.state.rl_step)
                msg = (
                    ("resync",)
                    if got is None
                    else (
                        "batch",
                        [s for g in got[0] for s in g],
                        {**reward_metrics(got[0], per_domain=per_domain), **got[1]},
                    )
                )
            msg = broadcast(msg)
            if msg[0] == "batch":
                break
            _log("no engine serves: they wait for the current weights; syncing them again")
            self.sync(new_version=False)  # engines that came back get the weights, then serve
        _, samples, metrics = msg
        metrics["time/rollout_wait_s"] = time.perf_counter() - start
        for recipe in self.recipes:
            metrics.update(recipe.batch_step(samples, self))
        stale = [
            s.policy_version
            for s in samples  # (a recipe may keep samples that are stale by design)
            if self.state.version - s.policy_version > self.cfg.rollout.max_staleness
            and not any(recipe.stale_ok(s) for recipe in self.recipes)
        ]
        if stale:
            raise RuntimeError(
                f"{len(stale)} samples were generated with weight versions {sorted(set(stale))}, more "
                f"than rollout.max_staleness={self.cfg.rollout.max_staleness} behind the trainer's "
                f"version {self.state.version}"
            )
        return samples, metrics

    def evaluate(self) -> dict[str, float]:
        from mcore_rl.runtime.evaluate import evaluate  # lazy: import cycle

        out = None
        if self.rank0:
            start = time.perf_counter()
            assert self.manager is not None  # built on rank 0
            out = evaluate(self.manager, self.eval_prompts, self.cfg)
            out["time/eval_s"] = time.perf_counter() - start
        out = broadcast(out)
        self.eval_history.append({"rl_step": self.state.rl_step, **out})
        return out

    @contextlib.contextmanager
    def engines_asleep(self) -> Iterator[None]:
        """Colocated placement: engines pause (aborting in-flight requests, which the scheduler
        continues later) and release their memory while the learner trains; the weight sync that
        follows fills them again."""
        if not (self.rank0 and self.cfg.rollout.placement == "colocated"):
            yield
            return
        start = time.perf_counter()
        engines = self._http_engines()
        engines.call("pause_generation", {"mode": "abort"})
        engines.call("release_memory_occupation", {})
        self.released_s = time.perf_counter() - start
        try:
            yield
        finally:
            start = time.perf_counter()
            engines.call("resume_memory_occupation", {})
            self.released_s += time.perf_counter() - start

    def step_done(self) -> None:
        """The step's weights are synced (and evaluated, saved): the gate opens one step further."""
        if self.rollout_source is not None:
            self.rollout_source.step_done(self.state.version)

    def write_accounting(self) -> dict | None:
        """`accounting.json`: where every drawn prompt went (rank 0)."""
        if not self.rank0 or self.rollout_source is None:
            return None
        return self.rollout_source.write_report(os.path.join(self.cfg.run_dir, "accounting.json"))

    def save(self) -> str:
        from mcore_rl.train import checkpoint

        rollout_state = self.rollout_source.state_dict() if self.rollout_source is not None else None
        common = {
            "model": config_to_dict(self.cfg.model),
            "rl": {
                "state": asdict(self.state),
                "prompts": rollout_state["prompts"] if rollout_state is not None else self.prompts.state_dict(),
                "val_prompts": self.val_prompts.state_dict(),
                "ledger": rollout_state["ledger"] if rollout_state is not None else None,
                "rollout": rollout_state,
                "distill": self.learner.distill_state_dict() if self.learner is not None else {},
                **{r.state_key: r.state_dict() for r in self.recipes if r.state_key is not None},
            },
        }

        save_dir = self.cfg.checkpoint.save_dir
        if save_dir is None:
            raise ValueError("checkpoint.save_dir: not set, so there is nowhere to save")
        common = carry_provenance(self.hf_provenance, common, save_dir)
        if self.critic is not None:  # first: the policy's `latest` marker never points past its critic
            self.critic.save(save_dir, self.state.rl_step)
        return checkpoint.save_checkpoint(save_dir, self.state.rl_step, self.chunks, self.optimizer, common)

    def checkpoint_path(self) -> str | None:
        """Where `save` put (or would put) the checkpoint of the current step; None without save_dir."""

        return (
            checkpoint_dir(self.cfg.checkpoint.save_dir, self.state.rl_step) if self.cfg.checkpoint.save_dir else None
        )

    def teach(self, samples: list[Sample], learner: Any) -> dict[str, float]:
        """Fill `Sample.teacher` of the batch before the update (collective): engine teachers on
        rank 0 (what the asynchronous scheduler did not score yet), in-trainer ones on every rank."""
        if self.teachers is None:
            return {}

        tc = self.cfg.train

        def topk(k: int) -> Any:
            return lambda ss, t, chunks: token_topk(
                chunks or self.chunks,
                ss,
                t,
                k,
                seq_length=tc.seq_length,
                micro_batch_size=tc.micro_batch_size,
                pad_id=self.tokenizer.pad_id,
                temperature=learner.temperature,
                chunk_size=tc.logprob_chunk_size,
            )

        # a teacher scores the full distribution, not the student's sampling mask
        return self.teachers.score(
            samples,
            lambda ss, t, chunks: learner.token_logprobs(ss, t, chunks=chunks, sampling_masks=False)[0],
            broadcast,
            self.rank0,
            topk,
        )

    def close(self) -> None:
        if self.rollout_source is not None:
            self.rollout_source.close()
        if self.teachers is not None:
            self.teachers.close()
        else:  # initialise failed between connecting the engine teachers and building the set
            for t in self._engine_teachers:
                if t is not None:
                    t.close()
        if self.engines is not None:
            self.engines.close()
        for recipe in self.recipes:
            recipe.close()
        if self.manager is not None:
            self.manager.rewards.close()
        if self.judges is not None:
            self.judges.close()
        if self.manager is not None:
            if self.manager.episodes is not None:
                self.manager.episodes.close()  # agent domains: their proxies, any agent still running


def run_rl(cfg: RLConfig) -> dict[str, Any]:
    """Train as configured. Returns a summary (eval before/after, wall time) on every rank."""
    from mcore_rl.data.domains import stage_temperature  # lazy: numpy
    from mcore_rl.train.rl_step import Learner  # lazy: megatron

    ttfs.begin_run()  # time to first step: the process's clock, or a new one for a second run in it
    run = RLRun(cfg)
    rank0 = run.rank0
    observer = RunObserver(cfg, rank0, run.world, cfg.train.seq_length, _log)  # metrics, timers, MFU, profiles
    writer = observer.writer
    if rank0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    try:
        run.initialise()
        if run._resume_common is not None:
            writer.resume(run.state.opt_step)
        learner = run.learner = Learner(
            cfg,
            run.chunks,
            run.optimizer,
            run.ref_chunks,
            run.tokenizer.pad_id,
            recipes=run.recipes,
            critic=run.critic,
        )
        if run._resume_common is not None and run._resume_common.get("distill"):
            learner.load_distill_state(run._resume_common["distill"])
        st = run.state
        first_eval: dict[str, float] | None = None
        if run._resume_common is None and cfg.eval.at_start:
            first_eval = run.evaluate()
            ttfs.mark("eval_at_start")
            writer.write({"step": st.opt_step, "rl_step": st.rl_step, **run.init_metrics, **first_eval})
            _log(f"held-out before RL: {_eval_line(first_eval)}")
        bar = _progress(cfg, st.rl_step)
        last_eval = first_eval
        stopping = False  # a recipe ended the run after an evaluation
        while st.rl_step < cfg.train.num_steps and not stopping:
            step_start = time.perf_counter()
            samples, roll_metrics = run.rollouts()
            ttfs.mark("first_rollout")
            roll_metrics.update(run.teach(samples, learner))
            for recipe in run.recipes:
                recipe.before_update()
            learner.temperature = stage_temperature(cfg, st.rl_step)  # π at the temperature the batch was sampled with
            steps = (st.opt_step + 1, st.opt_step + cfg.optimizer_steps_per_rollout)
            with run.engines_asleep(), observer.profile(*steps):  # colocated: the engines give the devices away
                train_start = time.perf_counter()
                records, batch_metrics = learner.train(samples, st.rl_step)
                train_s = time.perf_counter() - train_start
            st.samples_trained += len(samples)
            first_step = observer.first_step_done()  # time to first step: {} after the first
            updated: dict[str, float] = {}
            for recipe in run.recipes:
                updated.update(recipe.after_optimizer(run, st.rl_step + 1))
            run.sync()
            extra: dict[str, float] = {
                "time/sync_s": run.last_sync_s,
                "time/train_s": train_s,
                "rollout/weight_version": float(st.version),
                **updated,
            }
            if cfg.rollout.placement == "colocated" and rank0:
                extra["time/engine_release_resume_s"] = run.released_s
            for recipe in run.recipes:
                extra.update(recipe.after_sync(run, learner))
            st.rl_step += 1
            if (cfg.eval.interval > 0 and st.rl_step % cfg.eval.interval == 0) or st.rl_step == cfg.train.num_steps:
                last_eval = run.evaluate()
                extra.update(last_eval)
                for recipe in run.recipes:
                    verdict, reason = recipe.after_eval(st.rl_step, last_eval)
                    extra.update(verdict)
                    if reason is not None:
                        stopping = True
                        _log(reason)
            extra["time/step_s"] = time.perf_counter() - step_start
            extra["time/trainer_idle_frac"] = roll_metrics["time/rollout_wait_s"] / max(extra["time/step_s"], 1e-9)
            extra["time/elapsed_s"] = time.perf_counter() - run.t0
            extra["time/idle_s"] = roll_metrics["time/rollout_wait_s"]  # the trainer waits for rollouts
            trained_tokens = cfg.algorithm.ppo_epochs * sum(len(s.prompt.ids) + len(s.response_ids) for s in samples)
            extra.update(observer.perf(trained_tokens, sum(r.get("time/train_step_s", 0.0) for r in records)))
            extra.update(observer.timer.take())  # the checkpoint saved after the previous step
            extra.update(first_step)
            for k, rec in enumerate(records):
                st.opt_step += 1
                record = {"step": st.opt_step, "rl_step": st.rl_step, **roll_metrics, **batch_metrics, **rec}
                if k == len(records) - 1:
                    record.update(extra)
                writer.write(record)
            if rank0:  # which prompts this step trained (before its checkpoint: see accounting.py)
                record_trained_prompts(cfg.run_dir, st.rl_step, (s.prompt.index for s in samples))
            stop = stop_requested() if st.rl_step < cfg.train.num_steps else None  # launch: pre-emption (collective)
            ck = cfg.checkpoint
            if ck.save_dir and ((ck.save_interval > 0 and st.rl_step % ck.save_interval == 0) or stop):
                with observer.timer.phase("checkpoint"):
                    _log(f"saved {run.save()}")
            if run.teachers is not None:
                run.teachers.step_done(st.rl_step, st.version)  # a frozen teacher may take a new copy
            run.step_done()  # after the last step the gate admits nothing (its total_steps = train.num_steps)
            if bar is not None:
                bar.set_postfix(_postfix(roll_metrics, batch_metrics, last_eval), refresh=False)
                bar.update(1)
            if cfg.logging.print_interval > 0 and st.rl_step % cfg.logging.print_interval == 0:
                _log(
                    f"step {st.rl_step:>4}/{cfg.train.num_steps} | reward {roll_metrics.get('reward/mean', float('nan')):.3f} | "
                    f"k3 {batch_metrics.get('mismatch/k3', float('nan')):.2e} | loss {records[-1].get('train/loss', float('nan')):.4f}"
                    + (f" | {_eval_line(extra)}" if "eval/score" in extra else "")
                )
            if stop:  # saved above; the finally below closes engines and workers
                raise preempted(cfg.run_dir, st.rl_step, stop, run.checkpoint_path())
        if bar is not None:
            bar.close()
        if cfg.checkpoint.save_dir and (cfg.checkpoint.save_interval <= 0 or st.rl_step % cfg.checkpoint.save_interval):
            _log(f"saved {run.save()}")
        wall = time.perf_counter() - run.t0
        summary: dict[str, Any] = {
            "eval_before": first_eval,
            "eval_after": last_eval,
            "wall_s": wall,
            "state": asdict(st),
            "accounting": run.write_accounting(),
        }
        for recipe in run.recipes:
            summary.update(recipe.summary())
        if rank0:
            observer.close()
            if cfg.logging.plot and os.path.exists(writer.path):
                png = plot_curves(read_metrics(writer.path), os.path.join(cfg.run_dir, "curves.png"), title=cfg.run_dir)
                summary["plot"] = png
            if first_eval and last_eval:
                _log(
                    f"held-out {_score_name(cfg)}: {first_eval['eval/score']:.1%} before RL -> "
                    f"{last_eval['eval/score']:.1%} after {st.rl_step} steps ({wall:.0f} s in all)"
                )
            _log(f"metrics: {writer.path}" + (f" | curves: {summary['plot']}" if "plot" in summary else ""))
        return summary
    finally:
        observer.close()
        try:
            run.write_accounting()  # also when the run failed: what was in flight is reported pending
        except Exception:
            logger.exception("could not write accounting.json")
        run.close()


def _score_name(cfg: RLConfig) -> str:
    return "greedy pass@1" if cfg.eval.score == "greedy" else f"avg@{cfg.eval.k}"


def _eval_line(ev: dict[str, float]) -> str:
    parts = [
        f"{k.removeprefix('eval/')} {v:.1%}"
        for k, v in ev.items()
        if k.startswith("eval/") and k != "eval/score" and "reward" not in k
    ]
    return " | ".join(parts)


def _progress(cfg: RLConfig, start: int) -> Any:
    if not (_rank0() and cfg.logging.progress_bar):
        return None

    return progress(cfg.train.num_steps, "rl", "step", initial=start)


def _postfix(roll: dict[str, float], batch: dict[str, float], ev: dict[str, float] | None) -> dict[str, str]:
    out = {
        "reward": f"{roll.get('reward/mean', float('nan')):.3f}",
        "k3": f"{batch.get('mismatch/k3', float('nan')):.1e}",
    }
    if ev:
        out["eval"] = f"{ev['eval/score']:.3f}"
    return out
