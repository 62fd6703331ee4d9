"""``check(cfg) -> Placement``: the whole configuration validated in one pass.

``place()`` checks the roles and the cluster; this adds the rest of the schema (algorithm, data,
model, run options), the rules that tie them to the placement, and (unless ``runnable=False``)
what this build and this machine can run (``rlbatch.checks.runnable``), and reports every problem
in one ConfigError. The modules in ``plugins`` are imported first: they may register engines and
algorithm parts. No torch; the only I/O is reading the paths and importing the modules the
config names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from rlbatch.algos.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    GROUP_ADVANTAGES,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
    USES_CRITIC,
    VALUE_ADVANTAGES,
)
from rlbatch.checks.cluster_rules import cluster_problems
from rlbatch.checks.eval_rules import eval_problems
from rlbatch.checks.lora_rules import lora_problems
from rlbatch.checks.runnable import (
    engine_args_problems,
    engine_rule_problems,
    head_problems,
    program_name_problem,
    registry_problem,
    role_engines,
    runnable_problems,
)
from rlbatch.config.bounds import field_problems
from rlbatch.config.limits import Limits
from rlbatch.config.plain import dotted, to_plain
from rlbatch.config.schema import (
    AlgoConfig,
    CriticModelConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RewardModelConfig,
    RLBatchConfig,
    SandboxConfig,
)
from rlbatch.envs.checks import env_problems
from rlbatch.errors import ConfigError
from rlbatch.phases import reference_is_actor_base
from rlbatch.placement import Placement, place
from rlbatch.plugins import import_plugins
from rlbatch.trackers.checks import tracker_problems

CHOICES: dict[str, tuple[str, ...]] = {  # the algorithm's names come from rlbatch.algos.registry
    "program": ("train", "selftest"),
    "cluster.name": ("local", "slurm"),
    "cluster.device": ("auto", "cuda", "cpu"),
    "cluster.preempt_signal": ("USR2", "TERM", "INT", "HUP", "URG", "XCPU"),
    "model.arch": ("qwen2", "llama", "qwen2_moe"),
    "model.dtype": ("auto", "bf16", "fp16", "fp32"),
    "data.name": ("synthetic", "file", "synthetic_code", "code_file", "none"),
    "sandbox.isolation": ("auto", "namespaces", "process"),
    "sandbox.scoring": ("fraction", "all"),
}
CHOICES["eval.data.name"] = CHOICES["data.name"]  # held-out data: any kind the training data may be


def _code_task_problems(cfg: Mapping[str, Any], strict: bool) -> list[str]:
    """The sandbox's settings; with ``strict`` (a train run of this build), also that a code task is
    scored by a code_sandbox role and a code_sandbox role has a code task to run (a placement
    preset such as ROLL's may name the role for the planner and a selftest without one)."""
    code_task = _get(cfg, "data.name") in ("synthetic_code", "code_file")
    sandbox = _enabled(cfg, "code_sandbox")
    out = []
    if strict and code_task and not sandbox:
        out.append(f"roles.code_sandbox: data.name={_get(cfg, 'data.name')} is scored by running the responses' code: "
                   f"add the role, e.g. +roles.code_sandbox.world_size=1 (or experiment=code)")
    if strict and sandbox and not code_task:
        out.append(f"roles.code_sandbox: runs code against a problem's tests, but data.name={_get(cfg, 'data.name')} "
                   f"has none; use data.name=synthetic_code or code_file")
    sb = _get(cfg, "sandbox")
    if sandbox and isinstance(sb, Mapping):  # each weight's type and range: _check_fields
        weights = {k: sb.get(k, getattr(SandboxConfig, k)) for k in ("code_weight", "rule_weight")}
        if all(_number(w) is not None for w in weights.values()) and not any(weights.values()):
            out.append(f"sandbox: code_weight and rule_weight are both 0 ({weights}): nothing would score the responses")
        elif (_number(weights["rule_weight"]) or 0.0) > 0 and not _enabled(cfg, "reward"):
            out.append(f"roles.reward: sandbox.rule_weight={weights['rule_weight']} adds data.reward_fn's score, "
                       f"which the reward role computes; enable it or set sandbox.rule_weight=0")
        # Asked for, namespaces are a requirement; a local run's sandbox runs on this node, so the
        # probe here is the workers' (on Slurm the worker refuses at start with the same reason).
        if strict and sb.get("isolation") == "namespaces" and _get(cfg, "cluster.name") == "local":
            from rlbatch.sandbox.isolation import namespaces_available

            ok, why = namespaces_available()
            if not ok:
                out.append(f"sandbox.isolation=namespaces: this node cannot give an execution its own namespaces ({why}); "
                           f"allow unprivileged user namespaces or run as root, or set sandbox.isolation=process "
                           f"(the network and the file system are then not isolated)")
    return out


def _env_problems(cfg: Mapping[str, Any], runnable: bool, train_run: bool, placement: Placement | None) -> list[str]:
    """The ``env`` section (``rlbatch.envs.checks``); a plugin env's module is imported only for a
    runnable check. A train run with an env: what multi-turn rollouts of this build do not combine with."""
    problems = env_problems(cfg, load=runnable)
    name = _get(cfg, "env.name")
    if name is None:
        if _get(cfg, "data.name") == "none":
            problems.append("data.name: 'none' gives every trajectory an empty task for an environment to draw from "
                            "its seed, and env.name is not set")
        if _enabled(cfg, "env"):
            problems.append(f"roles.env: hosts episodes of an environment (world_size={_get(cfg, 'roles.env.world_size')}), "
                            f"but env.name is not set: name one (e.g. env.name=running_sum) or remove the role")
        return problems
    problems += _env_role_problems(cfg, placement)
    if not train_run:
        return problems
    env = f"env.name={name!r}"
    if _enabled(cfg, "code_sandbox"):
        problems.append(f"roles.code_sandbox: {env}: a trajectory is scored by its env (and env.reward_fn_weight); "
                        f"the sandbox runs single responses against tests: remove the role")
    if _enabled(cfg, "reward") and placement is not None and "reward" in placement.roles and placement.roles["reward"].is_gpu:
        problems.append(f"roles.reward: {env}: a reward model does not score trajectories in this build (their "
                        f"reward is the env's); use the CPU reward role (roles.reward.world_size)")
    algo = _get(cfg, "algo") if isinstance(_get(cfg, "algo"), Mapping) else {}
    if algo.get("overlong_filter") or (_int(algo.get("overlong_buffer")) or 0) > 0:
        problems.append(f"algo.overlong_filter / algo.overlong_buffer: {env}: they judge a response by "
                        f"algo.max_new_tokens, and a trajectory's response spans its turns and observations")
    return problems


def _env_role_problems(cfg: Mapping[str, Any], placement: Placement | None) -> list[str]:
    """The env role's size against a step's trajectories: a worker with none would sit idle."""
    if placement is None or "env" not in placement.roles:
        return []
    workers = placement.roles["env"].world_size
    prompts, n = _int(_get(cfg, "algo.prompts_per_step")), _int(_get(cfg, "algo.samples_per_prompt"))
    if prompts is not None and n is not None and workers > prompts * n:
        return [f"roles.env.world_size: {workers} env workers for {prompts * n} trajectories a step "
                f"(algo.prompts_per_step={prompts} x algo.samples_per_prompt={n}): each worker hosts whole "
                f"trajectories, so at most {prompts * n} workers have any"]
    return []


def _get(cfg: Mapping[str, Any], path: str) -> Any:
    return dotted(cfg, path)


def _enabled(cfg: Mapping[str, Any], role: str) -> bool:
    rc = _get(cfg, f"roles.{role}")
    return isinstance(rc, Mapping) and rc.get("enabled", True) is not False


SECTIONS: dict[str, type] = {"config": RLBatchConfig, "algo": AlgoConfig, "model": ModelConfig, "data": DataConfig,
                             "sandbox": SandboxConfig, "sandbox.limits": Limits,
                             "reward_model": RewardModelConfig, "critic_model": CriticModelConfig, "env": EnvConfig,
                             "eval": EvalConfig, "eval.data": DataConfig, "model.lora": LoraConfig}
"""Sections whose keys must be schema fields (roles and cluster are checked by place())."""


def _check_fields(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, schema in SECTIONS.items():
        node = cfg if key == "config" else _get(cfg, key)
        known = {f.name for f in dataclasses.fields(schema)}
        if isinstance(node, Mapping) and (unknown := sorted(str(k) for k in node if k not in known)):
            problems.append(f"{key}: unknown field(s) {unknown}; known fields: {sorted(known)}"[:400])
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v is not None and v not in allowed:
            problems.append(f"{key}: {v!r} is not one of {list(allowed)}")
    problems.extend(field_problems(cfg, RLBatchConfig))  # every number's type, finiteness and declared range
    algo = _get(cfg, "algo")
    if isinstance(algo, Mapping):
        for registry in (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, OFF_POLICY):
            key = registry.field.split(".", 1)[1]
            if key in algo and (problem := registry_problem(registry, algo[key])) is not None:
                problems.append(problem)
    resume = _get(cfg, "resume")
    if not isinstance(resume, str) or not resume:
        problems.append(f"resume: expected 'auto', 'never' or a checkpoint path, got {resume!r}")
    ports = _get(cfg, "cluster.port_range")
    if ports is not None and not (
        isinstance(ports, list) and len(ports) == 2 and all(isinstance(p, int) for p in ports)
        and 1024 <= ports[0] < ports[1] <= 65536
    ):
        problems.append(f"cluster.port_range: expected [low, high) with 1024 <= low < high <= 65536, got {ports!r}")
    problems.extend(_check_rank_env(_get(cfg, "cluster")))
    return problems


INTERFACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
"""A Linux network interface name (at most 15 characters)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _check_rank_env(cluster: Any) -> list[str]:
    """What the launchers export to every rank: ``cluster.env`` and ``cluster.network_interface``.
    Variable names go unquoted into the sbatch script's export lines, so they are identifiers and
    nothing else (values are quoted); NCCL and gloo read the interface as one interface name."""
    if not isinstance(cluster, Mapping):
        return []
    env = cluster.get("env")
    env = env if isinstance(env, Mapping) else {}
    problems = [f"cluster.env: {str(k)!r} is not an environment variable name (letters, digits, '_')"
                for k in env if not ENV_NAME.fullmatch(str(k))]
    name = cluster.get("network_interface")
    if name is None:
        return problems
    if not isinstance(name, str) or not INTERFACE_NAME.fullmatch(name):
        return [*problems, f"cluster.network_interface: expected one network interface name such as 'ib0' or 'eth0' "
                           f"(letters, digits, '_', '.', '-'; at most 15 characters), got {name!r}"]
    return problems + [f"cluster.env.{var}={env[var]!r} disagrees with cluster.network_interface={name!r}; set one of them"
                       for var in SOCKET_IFNAME_VARS if var in env and str(env[var]) != name]


def _int(v: Any) -> int | None:
    """An integer field's value; None when it is not an integer (_check_fields reports that)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _check_groups(algo: Mapping[str, Any]) -> list[str]:
    """The group-relative parts need groups; dynamic sampling and overlong shaping need sane sizes."""
    problems = []
    spp, adv = algo.get("samples_per_prompt"), algo.get("advantage")
    small = spp is None or (_int(spp) is not None and spp < 2)
    if small and isinstance(adv, str) and adv in GROUP_ADVANTAGES:
        problems.append(f"algo.samples_per_prompt: algo.advantage={adv} compares each sample with the others of "
                        f"its prompt's group, so it needs at least 2 samples per prompt, got {spp}")
    if small and algo.get("dynamic_sampling") is True:
        problems.append(f"algo.samples_per_prompt: algo.dynamic_sampling keeps groups whose rewards differ, so it "
                        f"needs at least 2 samples per prompt, got {spp}")
    rounds = _int(algo.get("max_sampling_rounds"))
    if algo.get("dynamic_sampling") is True and rounds is not None and rounds < 1:
        problems.append(f"algo.max_sampling_rounds: dynamic sampling needs a cap of at least one generation round "
                        f"per step, got {rounds}")
    buffer, longest = _int(algo.get("overlong_buffer")), _int(algo.get("max_new_tokens"))
    if buffer is not None and longest is not None and buffer > longest:
        problems.append(f"algo.overlong_buffer: {buffer} tokens is longer than algo.max_new_tokens = {longest}; "
                        f"the shaping buffer must fit inside the longest response")
    return problems


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _check_async(algo: Mapping[str, Any]) -> list[str]:
    """Asynchronous training and the off-policy corrections: settings in range, and a sampling
    distribution the trainer's log-probs describe."""
    problems = []
    stale, correction = _int(algo.get("max_staleness")), algo.get("off_policy")
    if stale and algo.get("dynamic_sampling") is True:
        problems.append(f"algo.max_staleness: asynchronous generation ({stale} steps ahead) is not built for DAPO's "
                        f"dynamic sampling, whose rounds depend on the step's scores; set algo.max_staleness=0 or "
                        f"algo.dynamic_sampling=false")
    temperature, top_p = _number(algo.get("temperature")), _number(algo.get("top_p"))
    if correction not in (None, "none") and ((temperature is not None and temperature != 1.0)
                                              or (top_p is not None and top_p != 1.0)):
        problems.append(f"algo.off_policy: {correction!r} weighs tokens by the trainer's log-probs over the "
                        f"inference engine's, which are taken after temperature and top-p (temperature="
                        f"{algo.get('temperature')}, top_p={algo.get('top_p')}) while the trainer's are not, so the "
                        f"ratio would not be an importance ratio; use algo.temperature=1 and algo.top_p=1, or "
                        f"algo.off_policy=none")
    return problems


def _check_critic(cfg: Mapping[str, Any], algo: Mapping[str, Any]) -> list[str]:
    """PPO's parts: a critic role, a value-based advantage estimator (and only with a critic), its
    settings in range, a loop it runs in (no dynamic sampling). Its engine's value head:
    ``head_problems``."""
    problems = []
    name, adv = algo.get("name"), algo.get("advantage")
    uses_critic = isinstance(name, str) and name in USES_CRITIC
    critic_path = _get(cfg, "critic_model.path")
    if critic_path and not (uses_critic and _enabled(cfg, "critic")):
        problems.append(f"critic_model.path: {critic_path} is set, but no critic runs (algo.name={name}); use "
                        f"algo=ppo, or leave critic_model.path unset")
    if uses_critic and not _enabled(cfg, "critic"):
        problems.append(f"roles.critic: algo.name={name} needs the critic role; enable it (roles.critic.enabled=true; "
                        f"it runs on actor_train's GPUs unless given a device_mapping)")
    if isinstance(adv, str) and adv in VALUE_ADVANTAGES and not uses_critic:
        problems.append(f"algo.advantage: {adv} reads the critic's values, which only {sorted(USES_CRITIC)} compute; "
                        f"use algo=ppo, or a critic-free estimator with algo.name={name}")
    if uses_critic and isinstance(adv, str) and adv not in VALUE_ADVANTAGES:
        problems.append(f"algo.advantage: algo.name={name} trains a critic for a value-based estimator "
                        f"({sorted(VALUE_ADVANTAGES)}), got {adv!r}")
    if uses_critic and algo.get("dynamic_sampling") is True:
        problems.append(f"algo.dynamic_sampling: DAPO's dynamic sampling runs in the critic-free loop, not in "
                        f"algo.name={name}'s; set algo.dynamic_sampling=false")
    warm, steps = _int(algo.get("critic_warmup_steps")), _int(_get(cfg, "steps"))
    if uses_critic and warm is not None and steps is not None and warm >= steps > 0:
        problems.append(f"algo.critic_warmup_steps: {warm} warm-up steps train only the critic, and the run has "
                        f"steps={steps}: the actor would never train")
    return problems


def _check_reward_model(cfg: Mapping[str, Any]) -> list[str]:
    """A reward model's weights are numbers >= 0, not both 0 (its engine's head: ``head_problems``)."""
    reward, rm = _get(cfg, "roles.reward"), _get(cfg, "reward_model")
    rm = rm if isinstance(rm, Mapping) else {}
    on_gpu = _enabled(cfg, "reward") and isinstance(reward, Mapping) and (
        reward.get("device_mapping") is not None or reward.get("backend") not in (None, ""))
    if not on_gpu:
        return [f"reward_model.path: {rm['path']} is set, but roles.reward scores with data.reward_fn on CPU "
                f"workers; give roles.reward a device_mapping and a backend (e.g. 'fsdp:d2') to run the model"] \
            if rm.get("path") else []
    problems = []
    weights = {k: rm.get(k, getattr(RewardModelConfig, k)) for k in ("model_weight", "rule_weight")}
    if all(_number(w) is not None for w in weights.values()) and not any(weights.values()):  # ranges: _check_fields
        problems.append(f"reward_model: model_weight and rule_weight are both 0 ({weights}): nothing would score "
                        f"the responses")
    return problems


def _check_algo_vs_roles(cfg: Mapping[str, Any], placement: Placement | None) -> list[str]:
    problems = []
    algo = _get(cfg, "algo")
    if algo is not None and not isinstance(algo, Mapping):
        problems.append(f"algo: expected a mapping of algorithm settings, got {type(algo).__name__} {algo!r}"[:200])
    algo = algo if isinstance(algo, Mapping) else {}
    spp = algo.get("samples_per_prompt")
    problems.extend(_check_groups(algo))
    problems.extend(_check_critic(cfg, algo))
    problems.extend(_check_async(algo))
    problems.extend(_check_reward_model(cfg))
    kl = algo.get("kl_coef")
    if (isinstance(kl, (int, float)) and not isinstance(kl, bool) and kl > 0 and not _enabled(cfg, "reference")
            and not reference_is_actor_base(_get(cfg, "model.lora"))):
        problems.append(
            f"roles.reference: algo.kl_coef={algo.get('kl_coef')} needs the reference role (or model.lora, whose "
            f"reference is the policy's base model); enable it or set algo.kl_coef=0"
        )
    if _get(cfg, "data.name") in ("file", "code_file"):
        if not _get(cfg, "data.path"):
            problems.append(f"data.path: data.name={_get(cfg, 'data.name')} needs a jsonl or parquet path")
        if not _get(cfg, "model.path"):
            problems.append("model.path: data.name=file needs a real model and tokenizer; set model.path=<local HF directory>")
    if placement is not None and "actor_train" in placement.roles:
        train = placement.roles["actor_train"]
        dp = dict(train.mesh).get("dp", 1) * dict(train.mesh).get("cp", 1) if train.mesh else train.world_size
        samples = (_int(algo.get("prompts_per_step")) or 0) * (_int(spp) or 0)
        parts = dp * (_int(algo.get("mini_batches")) or 1) * (_int(algo.get("grad_accum")) or 1)
        if samples and parts and samples % parts:
            problems.append(
                f"algo: a batch of prompts_per_step*samples_per_prompt = {samples} samples cannot be "
                f"split evenly into actor_train dp={dp} x mini_batches={algo.get('mini_batches')} x "
                f"grad_accum={algo.get('grad_accum')} = {parts} parts"
            )
    return problems


def _missing_values(cfg: Any) -> list[str]:
    if not type(cfg).__module__.startswith("omegaconf"):
        return []
    from omegaconf import OmegaConf

    return sorted(OmegaConf.missing_keys(cfg))


def _check_model_shape(model: Any) -> list[str]:
    """A random-init model's head split, as the builder and the planner read it (one description:
    ``rlbatch.models.spec``). A model from ``model.path`` is checked with the paths; a field out of
    its range is reported by _check_fields alone."""
    if not isinstance(model, Mapping) or model.get("path") or field_problems(model, ModelConfig, "model"):
        return []
    from rlbatch.models.spec import spec_from_model_config

    try:
        spec_from_model_config(model)
    except ConfigError as e:
        return list(e.problems)
    except (TypeError, ValueError):  # a field of the wrong type: _check_fields names it
        return []
    return []


def _fit_problems(plain: Mapping[str, Any], placement: Placement) -> list[str]:
    """With a hardware profile in the config (``hardware=h100_sxm``), the planner's memory
    prediction for this placement: every GPU (or, on a CPU profile, node) it would not fit, with
    the phase and the bytes needed and usable. Without one, or with only a few memory fields
    (vllm_rules reads those), nothing is predicted."""
    hw_cfg = plain.get("hardware")
    if not isinstance(hw_cfg, Mapping):
        return []
    from rlbatch.plan.fit import hardware_from_config, predict_config

    try:
        hw = hardware_from_config(hw_cfg)
    except ConfigError as e:
        return list(e.problems)
    if hw is None:
        return []
    return [f"hardware={hw.name}: {line}" for line in predict_config(plain, placement, hw).problems]


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
    if not isinstance(plain, Mapping):
        raise ConfigError(f"config: expected a mapping, got {type(plain).__name__}")
    problems = import_plugins(plain.get("plugins"))  # first: they may add engines and algorithm parts
    problems += _check_fields(plain)
    algo = plain.get("algo")
    if isinstance(algo, Mapping) and "name" in algo:  # a selftest runs no algorithm: the planner's rule
        strict = runnable and plain.get("program", "train") == "train"
        if (problem := program_name_problem(algo["name"], strict)) is not None:
            problems.append(problem)
    placement: Placement | None = None
    try:
        placement = place(plain)
    except ConfigError as e:
        problems.extend(e.problems)
    problems.extend(_check_algo_vs_roles(plain, placement))
    problems.extend(_check_model_shape(plain.get("model")))
    engines = role_engines(plain)
    problems.extend(head_problems(engines))
    problems.extend(engine_args_problems(plain, engines))
    train_run = runnable and plain.get("program", "train") == "train"
    problems.extend(engine_rule_problems(plain, engines, placement, train_run))
    problems.extend(_code_task_problems(plain, train_run))
    problems.extend(_env_problems(plain, runnable, train_run, placement))
    problems.extend(eval_problems(plain, runnable))
    problems.extend(lora_problems(plain, engines))
    problems.extend(cluster_problems(plain))  # what reaches the sbatch script
    problems.extend(tracker_problems(plain, runnable))
    if runnable:
        problems.extend(runnable_problems(plain, engines))
    if train_run and not problems and placement is not None:  # the prediction needs a valid config
        problems.extend(_fit_problems(plain, placement))
    if problems:
        raise ConfigError(problems)
    assert placement is not None
    return placement
