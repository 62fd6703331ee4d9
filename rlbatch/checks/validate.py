"""``check(cfg) -> Placement``: the whole configuration validated in one pass.

``place()`` checks the roles and the cluster; this adds the rest of the schema (algorithm, data,
model, run options), the rules that tie them to the placement, and (unless ``runnable=False``)
what this build and this machine can run (``rlbatch.checks.runnable``), and reports every problem
in one ConfigError. The modules in ``plugins`` are imported first: they may register engines and
algorithm parts. No torch; the only I/O is reading the paths and importing the modules the
config names.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rlbatch.algos.registry import (
    GROUP_ADVANTAGES,
    USES_CRITIC,
    VALUE_ADVANTAGES,
)
from rlbatch.checks.cluster_rules import cluster_problems
from rlbatch.checks.eval_rules import eval_problems
from rlbatch.checks.lora_rules import lora_problems
from rlbatch.checks.prompt_rules import prompt_length_problems
from rlbatch.checks.runnable import (
    engine_args_problems,
    engine_rule_problems,
    head_problems,
    program_name_problem,
    role_engines,
    runnable_problems,
)
from rlbatch.checks.vlm_rules import image_task_problems, vlm_problems
from rlbatch.config.parse import parse
from rlbatch.config.plain import to_plain
from rlbatch.config.schema import (
    AlgoConfig,
    ClusterConfig,
    RLBatchConfig,
)
from rlbatch.engines.registry import REGISTRY, spec_of
from rlbatch.envs.checks import env_problems
from rlbatch.errors import ConfigError
from rlbatch.phases import reference_is_actor_base
from rlbatch.placement import Placement, place
from rlbatch.trackers.checks import tracker_problems


def _code_task_problems(cfg: RLBatchConfig, strict: bool) -> list[str]:
    """The sandbox's settings; with ``strict`` (a train run of this build), also that a code task is
    scored by a code_sandbox role and a code_sandbox role has a code task to run (a placement
    preset such as ROLL's may name the role for the planner and a selftest without one)."""
    code_task = cfg.data.name in ("synthetic_code", "code_file")
    sandbox = cfg.enabled("code_sandbox")
    out = []
    if strict and code_task and not sandbox:
        out.append(f"roles.code_sandbox: data.name={cfg.data.name} is scored by running the responses' code: "
                   f"add the role, e.g. +roles.code_sandbox.world_size=1 (or experiment=code)")
    if strict and sandbox and not code_task:
        out.append(f"roles.code_sandbox: runs code against a problem's tests, but data.name={cfg.data.name} "
                   f"has none; use data.name=synthetic_code or code_file")
    sb = cfg.sandbox
    if sandbox:
        weights = {"code_weight": sb.code_weight, "rule_weight": sb.rule_weight}
        if not any(weights.values()):
            out.append(f"sandbox: code_weight and rule_weight are both 0 ({weights}): nothing would score the responses")
        elif sb.rule_weight > 0 and not cfg.enabled("reward"):
            out.append(f"roles.reward: sandbox.rule_weight={sb.rule_weight} adds data.reward_fn's score, "
                       f"which the reward role computes; enable it or set sandbox.rule_weight=0")
        # Asked for, namespaces are a requirement; a local run's sandbox runs on this node, so the
        # probe here is the workers' (on Slurm the worker refuses at start with the same reason).
        if strict and sb.isolation == "namespaces" and cfg.cluster.name == "local":
            from rlbatch.sandbox.isolation import namespaces_available

            ok, why = namespaces_available()
            if not ok:
                out.append(f"sandbox.isolation=namespaces: this node cannot give an execution its own namespaces ({why}); "
                           f"allow unprivileged user namespaces or run as root, or set sandbox.isolation=process "
                           f"(the file system is then isolated only where the kernel has Landlock; docs/sandbox.md)")
    return out


def _env_problems(cfg: RLBatchConfig, runnable: bool, train_run: bool, placement: Placement | None) -> list[str]:
    """The ``env`` section (``rlbatch.envs.checks``); a plugin env's module is imported only for a
    runnable check. A train run with an env: what multi-turn rollouts of this build do not combine with."""
    problems = env_problems(cfg, load=runnable)
    name = cfg.env.name
    if name is None:
        if cfg.data.name == "none":
            problems.append("data.name: 'none' gives every trajectory an empty task for an environment to draw from "
                            "its seed, and env.name is not set")
        if cfg.enabled("env"):
            problems.append(f"roles.env: hosts episodes of an environment (world_size={cfg.roles['env'].world_size}), "
                            f"but env.name is not set: name one (e.g. env.name=running_sum) or remove the role")
        return problems
    problems += _env_role_problems(cfg, placement)
    if not train_run:
        return problems
    env = f"env.name={name!r}"
    if cfg.enabled("code_sandbox"):
        problems.append(f"roles.code_sandbox: {env}: a trajectory is scored by its env (and env.reward_fn_weight); "
                        f"the sandbox runs single responses against tests: remove the role")
    if cfg.enabled("reward") and placement is not None and "reward" in placement.roles and placement.roles["reward"].is_gpu:
        problems.append(f"roles.reward: {env}: a reward model does not score trajectories in this build (their "
                        f"reward is the env's); use the CPU reward role (roles.reward.world_size)")
    if cfg.algo.overlong_filter or cfg.algo.overlong_buffer > 0:
        problems.append(f"algo.overlong_filter / algo.overlong_buffer: {env}: they judge a response by "
                        f"algo.max_new_tokens, and a trajectory's response spans its turns and observations")
    return problems


def _env_role_problems(cfg: RLBatchConfig, placement: Placement | None) -> list[str]:
    """The env role's size against a step's trajectories: a worker with none would sit idle."""
    if placement is None or "env" not in placement.roles:
        return []
    workers = placement.roles["env"].world_size
    prompts, n = cfg.algo.prompts_per_step, cfg.algo.samples_per_prompt
    if workers > prompts * n:
        return [f"roles.env.world_size: {workers} env workers for {prompts * n} trajectories a step "
                f"(algo.prompts_per_step={prompts} x algo.samples_per_prompt={n}): each worker hosts whole "
                f"trajectories, so at most {prompts * n} workers have any"]
    return []


INTERFACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
"""A Linux network interface name (at most 15 characters)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _check_rank_env(cluster: ClusterConfig) -> list[str]:
    """What the launchers export to every rank: ``cluster.env`` and ``cluster.network_interface``.
    Variable names go unquoted into the sbatch script's export lines, so they are identifiers and
    nothing else (values are quoted); NCCL and gloo read the interface as one interface name."""
    env = cluster.env
    problems = [f"cluster.env: {str(k)!r} is not an environment variable name (letters, digits, '_')"
                for k in env if not ENV_NAME.fullmatch(str(k))]
    name = cluster.network_interface
    if name is None:
        return problems
    if not INTERFACE_NAME.fullmatch(name):
        return [*problems, f"cluster.network_interface: expected one network interface name such as 'ib0' or 'eth0' "
                           f"(letters, digits, '_', '.', '-'; at most 15 characters), got {name!r}"]
    return problems + [f"cluster.env.{var}={env[var]!r} disagrees with cluster.network_interface={name!r}; set one of them"
                       for var in SOCKET_IFNAME_VARS if var in env and str(env[var]) != name]


def _check_groups(algo: AlgoConfig) -> list[str]:
    """The group-relative parts need groups; dynamic sampling and overlong shaping need sane sizes."""
    problems = []
    spp, adv = algo.samples_per_prompt, algo.advantage
    if spp < 2 and adv in GROUP_ADVANTAGES:
        problems.append(f"algo.samples_per_prompt: algo.advantage={adv} compares each sample with the others of "
                        f"its prompt's group, so it needs at least 2 samples per prompt, got {spp}")
    if spp < 2 and algo.dynamic_sampling:
        problems.append(f"algo.samples_per_prompt: algo.dynamic_sampling keeps groups whose rewards differ, so it "
                        f"needs at least 2 samples per prompt, got {spp}")
    if algo.dynamic_sampling and algo.max_sampling_rounds < 1:
        problems.append(f"algo.max_sampling_rounds: dynamic sampling needs a cap of at least one generation round "
                        f"per step, got {algo.max_sampling_rounds}")
    if algo.overlong_buffer > algo.max_new_tokens:
        problems.append(f"algo.overlong_buffer: {algo.overlong_buffer} tokens is longer than algo.max_new_tokens = "
                        f"{algo.max_new_tokens}; the shaping buffer must fit inside the longest response")
    return problems


def _check_async(algo: AlgoConfig) -> list[str]:
    """Asynchronous training and the off-policy corrections: settings in range, and a sampling
    distribution the trainer's log-probs describe."""
    problems = []
    stale, correction = algo.max_staleness, algo.off_policy
    if stale and algo.dynamic_sampling:
        problems.append(f"algo.max_staleness: asynchronous generation ({stale} steps ahead) is not built for DAPO's "
                        f"dynamic sampling, whose rounds depend on the step's scores; set algo.max_staleness=0 or "
                        f"algo.dynamic_sampling=false")
    if correction != "none" and (algo.temperature != 1.0 or algo.top_p != 1.0):
        problems.append(f"algo.off_policy: {correction!r} weighs tokens by the trainer's log-probs over the "
                        f"inference engine's, which are taken after temperature and top-p (temperature="
                        f"{algo.temperature}, top_p={algo.top_p}) while the trainer's are not, so the "
                        f"ratio would not be an importance ratio; use algo.temperature=1 and algo.top_p=1, or "
                        f"algo.off_policy=none")
    return problems


def _check_in_flight(cfg: RLBatchConfig, placement: Placement | None) -> list[str]:
    """``algo.in_flight_updates``: weights land while actor_infer generates, which needs generation
    ahead of training on ranks of its own and an engine that pauses between decode steps
    (``EngineSpec.loads_in_flight``: vllm, sglang), one rank per worker."""
    from rlbatch.models.lora import sync_form

    algo, problems = cfg.algo, []
    if algo.in_flight_kv not in ("keep", "recompute"):
        problems.append(f"algo.in_flight_kv: {algo.in_flight_kv!r} is not one of 'keep', 'recompute'")
    if algo.partial_rollouts and not (algo.in_flight_updates and algo.max_staleness >= 2):
        problems.append(f"algo.partial_rollouts: samples go on across steps under the weights that land mid-generation "
                        f"and one step's more staleness: set algo.in_flight_updates=true (got "
                        f"{algo.in_flight_updates}) and algo.max_staleness >= 2 (got {algo.max_staleness})")
    if not algo.in_flight_updates:
        return problems
    why = "algo.in_flight_updates: weights land mid-generation only"
    if algo.max_staleness <= 0:
        problems.append(f"{why} while generation runs ahead of training: set algo.max_staleness >= 1 (got "
                        f"{algo.max_staleness})")
    if cfg.env.name:
        problems.append(f"{why} in single-turn generation; env.name={cfg.env.name!r} plays trajectories turn by "
                        f"turn: set algo.in_flight_updates=false")
    if placement is None or "actor_infer" not in placement.roles:
        return problems
    infer = placement.roles["actor_infer"]
    spec = spec_of(infer.engine)
    if not spec.loads_in_flight:
        takers = ", ".join(sorted(n for n, s in REGISTRY.items() if s.loads_in_flight))
        problems.append(f"{why} into an engine that pauses between decode steps; roles.actor_infer's engine "
                        f"{infer.engine!r} generates each batch in one call with no point where weights can land: "
                        f"use one that pauses ({takers}), or set algo.in_flight_updates=false")
    elif infer.num_gpus_per_worker > 1 and not spec.in_flight_tp:
        takers = ", ".join(sorted(n for n, s in REGISTRY.items() if s.in_flight_tp))
        problems.append(f"{why} into one-rank {infer.engine} workers: its {infer.num_gpus_per_worker} tensor-parallel "
                        f"ranks have no engine step at which all of them can take a sync; use {infer.engine}:dN "
                        f"(t=1), an engine that can ({takers}), or set algo.in_flight_updates=false")
    if sync_form(cfg.model.lora, spec.loads_adapters) == "adapter":
        problems.append(f"{why} with full weights; model.lora syncs adapters alone into {infer.engine!r} (requests "
                        f"in flight hold the previous adapter): set model.lora.sync=merged")
    ranks = set(infer.gpu_ranks)
    shared = sorted(r for r, rp in placement.roles.items()
                    if r not in ("actor_infer", "reference") and rp.is_gpu and ranks & set(rp.gpu_ranks))
    if shared:
        problems.append(f"{why} on a disaggregated placement; actor_infer's GPUs {sorted(ranks)} are shared with "
                        f"{', '.join(shared)}, whose phases would wait for its generation: give actor_infer GPUs of its "
                        f"own or set algo.in_flight_updates=false")
    return problems


def _check_critic(cfg: RLBatchConfig) -> list[str]:
    """PPO's parts: a critic role, a value-based advantage estimator (and only with a critic), its
    settings in range, a loop it runs in (no dynamic sampling). Its engine's value head:
    ``head_problems``."""
    problems = []
    algo = cfg.algo
    name, adv = algo.name, algo.advantage
    uses_critic = name in USES_CRITIC
    critic_path = cfg.critic_model.path
    if critic_path and not (uses_critic and cfg.enabled("critic")):
        problems.append(f"critic_model.path: {critic_path} is set, but no critic runs (algo.name={name}); use "
                        f"algo=ppo, or leave critic_model.path unset")
    if uses_critic and not cfg.enabled("critic"):
        problems.append(f"roles.critic: algo.name={name} needs the critic role; enable it (roles.critic.enabled=true; "
                        f"it runs on actor_train's GPUs unless given a device_mapping)")
    if adv in VALUE_ADVANTAGES and not uses_critic:
        problems.append(f"algo.advantage: {adv} reads the critic's values, which only {sorted(USES_CRITIC)} compute; "
                        f"use algo=ppo, or a critic-free estimator with algo.name={name}")
    if uses_critic and adv not in VALUE_ADVANTAGES:
        problems.append(f"algo.advantage: algo.name={name} trains a critic for a value-based estimator "
                        f"({sorted(VALUE_ADVANTAGES)}), got {adv!r}")
    if uses_critic and algo.dynamic_sampling:
        problems.append(f"algo.dynamic_sampling: DAPO's dynamic sampling runs in the critic-free loop, not in "
                        f"algo.name={name}'s; set algo.dynamic_sampling=false")
    warm, steps = algo.critic_warmup_steps, cfg.steps
    if uses_critic and warm >= steps > 0:
        problems.append(f"algo.critic_warmup_steps: {warm} warm-up steps train only the critic, and the run has "
                        f"steps={steps}: the actor would never train")
    return problems


def _check_reward_model(cfg: RLBatchConfig) -> list[str]:
    """A reward model's weights are numbers >= 0, not both 0 (its engine's head: ``head_problems``)."""
    rm = cfg.reward_model
    reward = cfg.roles.get("reward")
    on_gpu = cfg.enabled("reward") and reward is not None and (reward.device_mapping is not None or reward.backend != "")
    if not on_gpu:
        return [f"reward_model.path: {rm.path} is set, but roles.reward scores with data.reward_fn on CPU "
                f"workers; give roles.reward a device_mapping and a backend (e.g. 'fsdp:d2') to run the model"] \
            if rm.path else []
    weights = {"model_weight": rm.model_weight, "rule_weight": rm.rule_weight}
    if not any(weights.values()):
        return [f"reward_model: model_weight and rule_weight are both 0 ({weights}): nothing would score "
                f"the responses"]
    return []


def _check_algo_vs_roles(cfg: RLBatchConfig, placement: Placement | None) -> list[str]:
    problems = []
    algo = cfg.algo
    problems.extend(_check_groups(algo))
    problems.extend(_check_critic(cfg))
    problems.extend(_check_async(algo))
    problems.extend(_check_in_flight(cfg, placement))
    problems.extend(_check_reward_model(cfg))
    if algo.kl_coef > 0 and not cfg.enabled("reference") and not reference_is_actor_base(cfg.model.lora):
        problems.append(
            f"roles.reference: algo.kl_coef={algo.kl_coef} needs the reference role (or model.lora, whose "
            f"reference is the policy's base model); enable it or set algo.kl_coef=0"
        )
    if cfg.data.name in ("file", "code_file"):
        if not cfg.data.path:
            problems.append(f"data.path: data.name={cfg.data.name} needs a jsonl or parquet path")
        if not cfg.model.path:
            problems.append("model.path: data.name=file needs a real model and tokenizer; set model.path=<local HF directory>")
    if placement is not None and "actor_train" in placement.roles:
        train = placement.roles["actor_train"]
        mesh = dict(train.mesh)  # samples split over the engine's data axes; a replica's tp/pp/cp ranks share theirs
        dp = math.prod(mesh.get(a, 1) for a in spec_of(train.engine).data_axes) if mesh else train.world_size
        samples = algo.prompts_per_step * algo.samples_per_prompt
        parts = dp * algo.mini_batches * algo.grad_accum
        if samples % parts:
            problems.append(
                f"algo: a batch of prompts_per_step*samples_per_prompt = {samples} samples cannot be "
                f"split evenly into actor_train dp={dp} x mini_batches={algo.mini_batches} x "
                f"grad_accum={algo.grad_accum} = {parts} parts"
            )
    return problems


def _missing_values(cfg: Any) -> list[str]:
    if not type(cfg).__module__.startswith("omegaconf"):
        return []
    from omegaconf import OmegaConf

    return sorted(OmegaConf.missing_keys(cfg))


def _check_model_shape(cfg: RLBatchConfig, shape_problems: bool) -> list[str]:
    """A random-init model's head split, as the builder and the planner read it (one description:
    ``rlbatch.models.spec``). A model from ``model.path`` is checked with the paths; with a field of
    the model refused by the parse (``shape_problems``), that problem alone is reported."""
    if cfg.model.path or shape_problems:
        return []
    from rlbatch.models.spec import spec_from_model_config

    try:
        spec_from_model_config(cfg.model)
    except ConfigError as e:
        return list(e.problems)
    return []


def _fit_problems(cfg: RLBatchConfig, placement: Placement) -> list[str]:
    """With a hardware profile in the config (``hardware=h100_sxm``), the planner's memory
    prediction for this placement: every GPU (or, on a CPU profile, node) it would not fit, with
    the phase and the bytes needed and usable. Without one, or with only a few memory fields
    (vllm_rules reads those), nothing is predicted."""
    hw = cfg.hardware.profile if cfg.hardware is not None else None
    if hw is None:
        return []
    from rlbatch.plan.fit import predict_config

    return [f"hardware={hw.name}: {line}" for line in predict_config(cfg, placement, hw).problems]


def check(cfg: Any, runnable: bool = True) -> Placement:
    """Validate everything in ``cfg``; return the Placement or raise one ConfigError listing all problems.

    ``runnable=False`` leaves out what depends on this build and this machine (engines that are
    not built, programs the planner models but this build does not run, paths and modules the
    config names, the run directory's filesystem): the planner uses it to model any engine.
    """
    missing = _missing_values(cfg)
    if missing:
        raise ConfigError([f"{k}: required but not set ('???' in conf/); give it as an override, e.g. {k}=..." for k in missing])
    plain = to_plain(cfg)
    result = parse(plain)  # first imports the plugins: they may add engines and algorithm parts
    typed, problems = result.config, list(result.problems)
    problems.extend(_check_rank_env(typed.cluster))
    strict = runnable and typed.program == "train"  # a selftest runs no algorithm: the planner's rule
    if (problem := program_name_problem(typed.algo.name, strict)) is not None:
        problems.append(problem)
    placement: Placement | None = None
    try:
        placement = place(typed, result.problems)
    except ConfigError as e:
        problems.extend(e.problems)
    problems.extend(_check_algo_vs_roles(typed, placement))
    problems.extend(_check_model_shape(typed, any(p.startswith("model.") for p in result.problems)))
    engines = role_engines(typed)
    problems.extend(head_problems(engines))
    problems.extend(engine_args_problems(typed, engines))
    train_run = runnable and typed.program == "train"
    problems.extend(engine_rule_problems(typed, engines, placement, train_run))
    problems.extend(_code_task_problems(typed, train_run))
    problems.extend(_env_problems(typed, runnable, train_run, placement))
    problems.extend(eval_problems(typed, runnable))
    problems.extend(prompt_length_problems(typed, runnable))
    problems.extend(lora_problems(typed, engines))
    problems.extend(vlm_problems(typed, engines))
    problems.extend(image_task_problems(typed, runnable))
    problems.extend(cluster_problems(typed))  # what reaches the sbatch script
    problems.extend(tracker_problems(typed, runnable))
    if runnable:
        problems.extend(runnable_problems(plain, typed, engines))
    if train_run and not problems and placement is not None:  # the prediction needs a valid config
        problems.extend(_fit_problems(typed, placement))
    if problems:
        raise ConfigError(problems)
    assert placement is not None
    return placement
