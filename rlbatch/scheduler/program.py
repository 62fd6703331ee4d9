"""``program=train``: the RL pipeline. The controller's loop reads like the algorithm.

    python -m rlbatch.launch                       # the default experiment (GRPO, synthetic task)
    python -m rlbatch.launch roles=disaggregated steps=20

The scheduler behind the role handles knows from the Placement which roles share a GPU and
offloads/reloads at each phase boundary by itself. ``algo.name`` picks the loop from
``rlbatch.algos.registry.PROGRAMS``; the advantage estimator and the loss come from the other
registries, so a new algorithm whose loop is this one is registry entries only.
Checkpoints are taken at step boundaries (save_every, the end, preemption or walltime), and a
run resumes from the newest complete one in its run_dir (resume=auto).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlbatch.algos.advantages import overlong_penalty, zero_variance_groups
from rlbatch.algos.registry import ADVANTAGES, PROGRAMS
from rlbatch.config.schema import RLBatchConfig
from rlbatch.data.source import make_stream
from rlbatch.runtime import heap
from rlbatch.runtime.env import read_env
from rlbatch.runtime.rundir import RunDir
from rlbatch.runtime.world import World
from rlbatch.scheduler.checkpointing import Checkpointer
from rlbatch.scheduler.controller import Pipeline, Role
from rlbatch.scheduler.metrics import Metrics, step_row
from rlbatch.scheduler.preemption import Preemption
from rlbatch.scheduler.rank_runtime import RankRuntime
from rlbatch.scheduler.sampling import dynamic_batch
from rlbatch.scheduler.scoring import Scoring


def advantage_stats(advantages: torch.Tensor | list[torch.Tensor]) -> dict[str, float]:
    """Mean and std of the advantages over samples (per-sequence) or over tokens (per-token)."""
    flat = advantages if isinstance(advantages, torch.Tensor) else torch.cat([x.reshape(-1) for x in advantages])
    flat = flat.float()
    return {"adv_mean": float(flat.mean()) if flat.numel() else 0.0,
            "adv_std": float(flat.std()) if flat.numel() > 1 else 0.0}


def handlers(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, Any]:
    return RankRuntime(world, cfg).handlers()


def controller(world: World, cfg: RLBatchConfig, run: RunDir) -> None:
    PROGRAMS.get(str(cfg.algo.name))(world, cfg, run)


def policy_gradient(world: World, cfg: RLBatchConfig, run: RunDir) -> None:
    """The critic-free loop (GRPO and its relatives): advantages from the rewards alone."""
    a = cfg.algo
    estimate_advantages = ADVANTAGES.get(str(a.advantage))
    pipe = Pipeline(world, cfg)
    print(f"engines ready on every rank in {pipe.wait_ready():.1f}s", flush=True)
    actor_infer, actor_train, scoring = Role(pipe, "actor_infer"), Role(pipe, "actor_train"), Scoring(pipe, cfg)
    reference = Role(pipe, "reference") if "reference" in world.placement.roles else None
    data, fingerprint = make_stream(cfg.data, int(cfg.seed))
    ckpt = Checkpointer(pipe, run, cfg, data, fingerprint)
    start = ckpt.resume()
    heap.settle()  # the controller's long-lived objects exist now: keep them out of collections
    if start > 0:
        actor_train.sync_weights(actor_infer)  # inference weights are not checkpointed
    preemption = Preemption(cfg.cluster, read_env())
    metrics = Metrics(run, int(cfg.steps), start)
    n, per_step = int(a.samples_per_prompt), int(a.prompts_per_step) * int(a.samples_per_prompt)
    reuse_batch = a.mini_batches > 1 or a.epochs > 1
    kl_in_reward = bool(a.kl_in_reward) and a.kl_coef > 0 and reference is not None
    stop = None

    for step in metrics.progress(range(start, int(cfg.steps))):
        pipe.begin_step()
        t0 = time.perf_counter()
        extra: dict[str, float] = {}
        if a.dynamic_sampling:  # DAPO: rounds of generate + score until the batch's groups vary
            rollouts, rewards, generated, extra = dynamic_batch(actor_infer, scoring, data, step, int(cfg.seed), a)
            extra["reward_batch_mean"] = float(rewards.mean())
            scoring_pending = False
        else:
            prompts = data.next_batch(int(a.prompts_per_step))
            rollouts = actor_infer.generate(prompts, n, first_id=step * per_step, seed=int(cfg.seed) * 100_003 + step)
            scoring.start(rollouts)  # scored alongside the log-prob phases
            scoring_pending = True
        if reference is not None and a.kl_coef > 0:
            reference.logprobs(rollouts)
        kl = None
        if reuse_batch or kl_in_reward:  # the policy before this step's updates
            kl = actor_train.logprobs(rollouts, kl_estimator=a.kl_estimator if kl_in_reward else None,
                                      skip_first_mini_batch=a.epochs == 1 and not kl_in_reward)
        if scoring_pending:
            rewards, counts = scoring.result()
            generated = rewards
            extra |= counts
            extra["sampling/zero_variance_frac"] = float(zero_variance_groups(rewards, n).float().mean())
        lengths = [rollouts.response_len[i] for i in rollouts.ids]
        shaped = rewards + overlong_penalty(torch.tensor(lengths), int(a.max_new_tokens), int(a.overlong_buffer),
                                            float(a.overlong_penalty))
        token_kl = [torch.tensor(kl[i]) for i in rollouts.ids] if kl_in_reward and kl is not None else None
        advantages = estimate_advantages(shaped, n, a, lengths=lengths, kl=token_kl)
        stats = actor_train.train(rollouts, advantages)
        actor_train.sync_weights(actor_infer)
        pipe.forget(rollouts.ids)
        step_s = time.perf_counter() - t0
        extra |= advantage_stats(advantages) | {"reward_shaped_mean": float(shaped.mean())}
        # reward_mean: over every sample generated this step (dynamic sampling trains on a biased subset)
        metrics.log(step_row(step, generated, rollouts, stats, pipe.phase_seconds, pipe.records, step_s) | extra)

        last = step == int(cfg.steps) - 1
        stop = None if last else preemption.reason_to_stop(step_s, ckpt.last_save_s)
        if last or stop or (cfg.save_every and (step + 1) % int(cfg.save_every) == 0):
            ckpt.save(step, stop or ("end of run" if last else "save_every"))
        if stop:
            break

    pipe.ctl.shutdown(pipe.workers())
    metrics.close()
    if stop:
        print(f"stopping after step {step}: {stop}; checkpoint saved", flush=True)
        if preemption.requeue():
            print("requeued: the job restarts in this run_dir and resumes", flush=True)
        return
    last_row = metrics.history[-1] if metrics.history else {}
    print(f"done: {len(metrics.history)} steps, final reward_mean {last_row.get('reward_mean', float('nan')):.3f}; "
          f"metrics in {metrics.path}", flush=True)
