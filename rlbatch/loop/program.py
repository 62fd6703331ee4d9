"""``program=train``: the RL pipeline. The controller's loop reads like the algorithm.

    python -m rlbatch.launch                       # the default experiment (GRPO, synthetic task)
    python -m rlbatch.launch roles=disaggregated steps=20
    python -m rlbatch.launch algo=ppo              # PPO with a critic (colocated with actor_train)

The scheduler behind the role handles knows from the Placement which roles share a GPU and
offloads/reloads at each phase boundary by itself. ``algo.name`` picks the loop from
``rlbatch.algos.registry.LOOPS``; the advantage estimator and the loss come from the other
registries, so a new algorithm whose loop is this one is registry entries only.
Checkpoints are taken at step boundaries (save_every, the end, preemption or walltime), and a
run resumes from the newest complete one in its run_dir (resume=auto).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from rlbatch.algos.advantages import Actions, overlong_penalty, zero_variance_groups
from rlbatch.algos.registry import ADVANTAGES, LOOPS
from rlbatch.algos.value import explained_variance
from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.prompt_length import PromptCounts
from rlbatch.data.source import make_stream
from rlbatch.loop.ahead import GenerationQueue, async_plan, staleness_stats
from rlbatch.loop.batches import BatchLog
from rlbatch.loop.checkpointing import Checkpointer
from rlbatch.loop.controller import Pipeline, Role, Rollouts
from rlbatch.loop.evaluation import Evaluation
from rlbatch.loop.metrics import Metrics, step_row
from rlbatch.loop.preemption import Preemption
from rlbatch.loop.rank_runtime import RankRuntime
from rlbatch.loop.samples import SampleLog
from rlbatch.loop.sampling import dynamic_batch
from rlbatch.loop.scoring import Scoring
from rlbatch.loop.synccheck import SyncCheck
from rlbatch.phases import phase_for, reference_is_actor_base
from rlbatch.runtime import heap
from rlbatch.runtime.env import read_env
from rlbatch.runtime.rundir import RunDir
from rlbatch.runtime.world import World
from rlbatch.trackers.checks import TENSORBOARD


def advantage_stats(advantages: torch.Tensor | list[torch.Tensor]) -> dict[str, float]:
    """Mean and std of the advantages over samples (per-sequence) or over tokens (per-token)."""
    flat = advantages if isinstance(advantages, torch.Tensor) else torch.cat([x.reshape(-1) for x in advantages])
    flat = flat.float()
    return {"adv_mean": float(flat.mean()) if flat.numel() else 0.0,
            "adv_std": float(flat.std()) if flat.numel() > 1 else 0.0}


def kl_stats(kl: list[torch.Tensor] | None) -> dict[str, float]:
    """The mean per-token KL to the reference that went into the reward (absent when it did not)."""
    flat = torch.cat([k.reshape(-1).float() for k in kl]) if kl else torch.zeros(0)
    return {"kl_reward_mean": float(flat.mean())} if flat.numel() else {}


def handlers(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, Callable[..., object]]:
    return RankRuntime(world, cfg).handlers()


def controller(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, str]:
    """Run the loop of ``algo.name``; returns how it ended for the status file (``Loop.finish``)."""
    return LOOPS.get(str(cfg.algo.name))(world, cfg, run)


class Loop:
    """What every program's loop shares: engines ready, the roles, the data stream, resume,
    checkpoints at step boundaries, preemption and the per-step metrics."""

    def __init__(self, world: World, cfg: RLBatchConfig, run: RunDir) -> None:
        self.cfg, self.a = cfg, cfg.algo
        self.pipe = Pipeline(world, cfg)
        print(f"engines ready on every rank in {self.pipe.wait_ready():.1f}s", flush=True)
        self.actor_infer, self.actor_train = Role(self.pipe, "actor_infer"), Role(self.pipe, "actor_train")
        self.reference = Role(self.pipe, "reference") if "reference" in world.placement.roles else None
        self.scoring = Scoring(self.pipe, cfg)
        self.prompt_counts = PromptCounts()  # data.max_prompt_tokens: what the guard did, in every row
        self.data, fingerprint = make_stream(cfg.data, int(cfg.seed), cfg.model, int(cfg.eval.holdout),
                                             int(cfg.eval.holdout_seed), counts=self.prompt_counts)
        # model.lora: the reference is the policy's base model, its adapters off, on actor_train's ranks
        self.base_reference = self.reference is None and reference_is_actor_base(cfg.model.lora)
        if self.base_reference and self.a.kl_coef > 0:
            print("reference: actor_train's base model with its adapters off (model.lora), on actor_train's ranks",
                  flush=True)
        self.kl_in_reward = (bool(self.a.kl_in_reward) and self.a.kl_coef > 0
                             and (self.reference is not None or self.base_reference))
        self.critic = Role(self.pipe, "critic") if "critic" in world.placement.roles else None
        used_reference = self.reference if self.reference is not None and self.a.kl_coef > 0 else None
        consumers = [self.actor_train, *([used_reference] if used_reference else []),
                     *([self.critic] if self.critic is not None else [])]
        k, rider = async_plan(self.pipe, self.actor_infer, used_reference, int(self.a.max_staleness))
        self.queue = GenerationQueue(self.actor_infer, consumers, self.scoring, self.data, cfg, k, rider,
                                     partial=bool(self.a.partial_rollouts))
        # the checked sync (cluster.sync_check_every): a probe after the synchronous loop's syncs
        self.sync_check = SyncCheck(self.pipe, self.actor_train, self.actor_infer, cfg, self.data, k == 0)
        self.ckpt = Checkpointer(self.pipe, run, cfg, self.data, fingerprint, parts=(self.queue, self.sync_check))
        self.start = self.ckpt.resume()
        if self.start == 0:
            self.sync_check.calibrate()  # both engines hold the weights they loaded: their own mismatch
        self.version = self.queue.version
        """The policy version: actor updates so far."""
        self.evaluation = Evaluation(self.pipe, cfg, self.start)  # at_start (start 0): the initial weights, now
        heap.settle()  # the controller's long-lived objects exist now: keep them out of collections
        heap.fewer_collections()  # and collect its step's short-lived ones rarely
        if self.start > 0:
            self.actor_train.sync_weights(self.actor_infer, self.version)  # inference weights are not checkpointed
            self.sync_check.after_sync(self.start - 1, self.version)
        self.preemption = Preemption(cfg.cluster, read_env())
        self.metrics = Metrics(run, int(cfg.steps), self.start, tensorboard=TENSORBOARD in cfg.logger,
                               plot_every=int(cfg.watch.plot_every))
        self.samples = SampleLog(run.path, cfg.watch, int(cfg.steps), self.start, self.metrics)  # samples.jsonl
        self.batches = BatchLog(run.path, cfg.watch, str(self.a.name))  # batches/step_<N>.pt
        self.n = int(self.a.samples_per_prompt)
        self.reuse_batch = self.a.mini_batches > 1 or self.a.epochs > 1
        self.stop: str | None = None
        self.t0 = self.t0_wall = 0.0

    def steps(self) -> Iterator[int]:
        for step in self.metrics.progress(range(self.start, int(self.cfg.steps))):
            self.pipe.begin_step()
            self.step = step
            self.scoring.show, self.scoring.shown = self.samples.wanted(step), {}
            self.t0, self.t0_wall = time.perf_counter(), time.time()
            yield step
            if self.stop:
                break

    def generate(self, step: int) -> Rollouts:
        """The step's rollouts, scoring started alongside (``scoring.result()`` waits): generated
        now, or ahead of time with ``algo.max_staleness`` (``rlbatch.loop.ahead``). A held-out
        evaluation waiting to run alongside the training is queued behind it on the inference ranks."""
        return self.queue.take(step, behind=self.evaluation.behind())

    def train_actor(self, rollouts: Rollouts, targets: dict[str, torch.Tensor | list[torch.Tensor]],
                    ) -> dict[str, float]:
        """One batch of actor updates; the rollouts' staleness (policy versions between the one
        that generated their oldest token and the one trained) is checked against max_staleness and
        logged (min, mean, max over the samples; ``stale_dropped``: samples left out past it)."""
        staleness = staleness_stats(rollouts, self.version, self.queue.k)  # by each sample's oldest token
        stats = self.actor_train.train(rollouts, targets)
        self.version += 1
        return stats | staleness | {"stale_dropped": float(self.queue.dropped)}

    def sync_follows(self) -> None:
        """Nothing reads the inference engine's weights before this step's sync overwrites them:
        an offload until then may discard them (vLLM sleeps at level 2, with no host copy). Only
        in the synchronous loop: with generation ahead (max_staleness > 0) another generation
        may read them first. A loop that does not say it loses nothing but the saving."""
        if self.queue.k == 0:
            self.pipe.announce(phase_for(self.actor_train.name, "sync").name)

    def sync(self) -> None:
        """The actor's weights to the inference engine (which finishes the generation it runs first,
        and a held-out evaluation of the weights it replaces).

        With ``algo.in_flight_updates`` the weights land during the generation in flight, and the
        loop goes on as soon as the trainer has sent them: the inference ranks' answer, which comes
        after that generation, is collected at the next sync, before a checkpoint (the generation
        queue's part of it) and at the end of the run (``Pipeline.settle``)."""
        self.evaluation.before_sync()
        self.pipe.settle()  # the previous sync's answer: in hand, the inference ranks answer in order
        self.actor_train.sync_weights(self.actor_infer, self.version,
                                      defer=bool(self.a.in_flight_updates) and self.queue.k > 0)
        self.queue.synced(self.version)
        self.sync_check.after_sync(self.step, self.version)  # when due: the inference engine computes our policy

    def log_probs(self, rollouts: Rollouts) -> list[torch.Tensor] | None:
        """The reference's log-probs (for a KL penalty) and the policy's before this step's updates
        (when the batch is reused, or the KL is in the reward); returns each sample's per-token KL
        when it goes into the reward."""
        a = self.a
        if self.reference is not None and a.kl_coef > 0 and self.queue.rider is None:  # else taken with generation
            self.reference.logprobs(rollouts)
        elif self.base_reference and a.kl_coef > 0:
            self.actor_train.logprobs(rollouts, op="base_logprobs")
        if not (self.reuse_batch or self.kl_in_reward):
            return None
        kl = self.actor_train.logprobs(rollouts, kl_estimator=a.kl_estimator if self.kl_in_reward else None,
                                       skip_first_mini_batch=a.epochs == 1 and not self.kl_in_reward)
        return [torch.tensor(kl[i]) for i in rollouts.ids] if self.kl_in_reward else None

    def shaped(self, rewards: torch.Tensor, rollouts: Rollouts) -> tuple[torch.Tensor, list[int]]:
        """Rewards after DAPO's overlong shaping (a no-op unless configured), and the lengths."""
        a = self.a
        lengths = [rollouts.response_len[i] for i in rollouts.ids]
        penalty = overlong_penalty(torch.tensor(lengths), int(a.max_new_tokens), int(a.overlong_buffer),
                                   float(a.overlong_penalty))
        return rewards + penalty, lengths

    def actions(self, rollouts: Rollouts, lengths: list[int]) -> Actions | None:
        """With an environment, each response's actions (its generated turns) for the per-token
        estimators; None for single-turn responses (every token an action)."""
        from rlbatch.envs.trajectories import action_masks, turn_rewards_of

        masks = action_masks(rollouts.episodes, rollouts.ids, lengths)
        return Actions(masks, turn_rewards_of(rollouts.episodes, rollouts.ids)) if masks is not None else None

    def end_step(self, step: int, rollouts: Rollouts, generated: torch.Tensor, stats: dict[str, float],
                 extra: dict[str, float],
                 trained: tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]] | None = None) -> None:
        """Drop the step's samples, log its row (reward_mean: over every sample generated this
        step), checkpoint when due, and decide whether to stop. The held-out evaluation of the
        weights just synced, when due, goes into the row (``rlbatch.loop.evaluation``): run
        now, or where the placement allows alongside the next step, the row then written at the
        next step's end, before that step's (a step whose checkpoint is saved is evaluated now).
        ``trained``: the batch's rewards and advantages, for the samples shown (``watch``)."""
        for held in self.evaluation.finished(self.pipe.records):  # the row of the step before, evaluated meanwhile
            self.metrics.log(held)
        if trained is not None:  # before the samples are dropped: a kept batch is read off the trainer's ranks
            self.batches.after_training(step, self.actor_train, rollouts, trained[0])
        rewards, advantages = trained if trained is not None else (generated, None)
        self.samples.record(step, rollouts, rewards, advantages, self.scoring.shown)
        self.pipe.forget(rollouts.ids)
        last = step == int(self.cfg.steps) - 1
        saving = last or bool(self.cfg.save_every and (step + 1) % int(self.cfg.save_every) == 0)
        extra = extra | self.evaluation.after_step(step, self.version, self.pipe.records, defer=not saving)
        step_s = time.perf_counter() - self.t0
        row = step_row(step, generated, rollouts, stats, self.pipe.phase_seconds, self.pipe.records, step_s,
                       self.t0_wall) | extra | self.prompt_counts.metrics()
        self.stop = None if last else self.preemption.reason_to_stop(step_s, self.ckpt.last_save_s)
        ready = self.evaluation.hold(row, now=bool(self.stop))  # None: it waits for an evaluation
        if ready is not None:
            self.metrics.log(ready)
        if saving or self.stop:
            self.pipe.settle()  # a checkpoint waits for every outstanding answer (an in-flight sync's)
            self.ckpt.save(step, self.stop or ("end of run" if last else "save_every"))

    def finish(self) -> dict[str, str]:
        """Shut the ranks down; returns how the loop ended (``Preemption.outcome``: empty when it
        ran every step), which the controller's status file records for the launcher."""
        self.pipe.settle()  # every answer in before the ranks go: a sync still outstanding may fail
        self.pipe.ctl.shutdown(self.pipe.workers())
        self.metrics.close()
        self.samples.close()
        if self.stop:
            print(f"stopping after step {self.metrics.history[-1]['step'] if self.metrics.history else '?'}: "
                  f"{self.stop}; checkpoint saved", flush=True)
            if self.preemption.requeue():
                print("requeued: the job restarts in this run_dir and resumes", flush=True)
            return self.preemption.outcome(self.stop)
        last_row = self.metrics.history[-1] if self.metrics.history else {}
        print(f"done: {len(self.metrics.history)} steps, final reward_mean {last_row.get('reward_mean', float('nan')):.3f}; "
              f"metrics in {self.metrics.path}", flush=True)
        return {}


def policy_gradient(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, str]:
    """The critic-free loop (GRPO and its relatives): advantages from the rewards alone."""
    loop, a = Loop(world, cfg, run), cfg.algo
    estimate_advantages = ADVANTAGES.get(str(a.advantage))
    for step in loop.steps():
        extra: dict[str, float] = {}
        if a.dynamic_sampling:  # DAPO: rounds of generate + score until the batch's groups vary
            rollouts, rewards, generated, extra = dynamic_batch(loop.actor_infer, loop.scoring, loop.data, step,
                                                                int(cfg.seed), a, loop.version)
            extra["reward_batch_mean"] = float(rewards.mean())
            loop.sync_follows()
            kl = loop.log_probs(rollouts)
        else:
            rollouts = loop.generate(step)
            loop.sync_follows()
            kl = loop.log_probs(rollouts)  # scored meanwhile
            rewards, counts = loop.scoring.result()
            generated = rewards
            extra |= counts
            extra["sampling/zero_variance_frac"] = float(zero_variance_groups(rewards, loop.n).float().mean())
        shaped, lengths = loop.shaped(rewards, rollouts)
        actions = loop.actions(rollouts, lengths)
        advantages = (actions.estimate(estimate_advantages, shaped, loop.n, a, kl=kl) if actions is not None
                      else estimate_advantages(shaped, loop.n, a, lengths=lengths, kl=kl))
        target = "advantage" if isinstance(advantages, torch.Tensor) else "advantages"
        stats = loop.train_actor(rollouts, {target: advantages})
        loop.sync()
        extra |= advantage_stats(advantages) | kl_stats(kl) | {"reward_shaped_mean": float(shaped.mean())}
        loop.end_step(step, rollouts, generated, stats, extra, (rewards, advantages))
    return loop.finish()


def ppo(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, str]:
    """PPO with a critic: the critic's values of each response token, GAE advantages from the
    per-token rewards (the task reward on the last token, minus kl_coef * KL_t with the KL in the
    reward), the critic regressed on the returns while the actor trains on the advantages. During
    ``critic_warmup_steps`` only the critic trains."""
    loop, a = Loop(world, cfg, run), cfg.algo
    critic = loop.critic
    assert critic is not None, "validation enables the critic for algo.name=ppo"
    estimate_advantages = ADVANTAGES.get(str(a.advantage))
    for step in loop.steps():
        actor_trains = step >= int(a.critic_warmup_steps)
        rollouts = loop.generate(step)
        if actor_trains:
            loop.sync_follows()
        kl = loop.log_probs(rollouts)
        values = critic.values(rollouts)
        rewards, counts = loop.scoring.result()
        shaped, lengths = loop.shaped(rewards, rollouts)
        actions = loop.actions(rollouts, lengths)
        advantages, returns = (actions.estimate(estimate_advantages, shaped, loop.n, a, kl=kl, values=values)
                               if actions is not None else
                               estimate_advantages(shaped, loop.n, a, lengths=lengths, kl=kl, values=values))
        critic_training = critic.start_train(rollouts, {"returns": returns})  # alongside the actor's
        stats = loop.train_actor(rollouts, {"advantages": advantages}) if actor_trains else {}
        stats |= {f"critic/{k}": v for k, v in critic_training.result().items()}
        if actor_trains:
            loop.sync()
        extra = counts | advantage_stats(advantages) | kl_stats(kl) | {
            "reward_shaped_mean": float(shaped.mean()), "critic/explained_variance": explained_variance(
                *((actions.take(values), actions.take(returns)) if actions is not None else (values, returns))),
            "critic/returns_mean": float(torch.cat(returns).mean()) if returns else 0.0,
            "critic/warmup": float(not actor_trains)}
        loop.end_step(step, rollouts, rewards, stats, extra, (rewards, advantages))
    return loop.finish()
