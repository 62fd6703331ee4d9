"""Compose the Hydra config from ``rlbatch/conf/`` and overrides, reporting errors as ConfigError."""

from __future__ import annotations

from typing import Any

from rlbatch.config import CONF_DIR as CONF_DIR
from rlbatch.errors import ConfigError

CONFIG_NAME = "config"

# Flags that need Hydra's own command line (sweeps, help, printing the config).
_HYDRA_FLAGS = {
    "-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info",
    "-sc", "--shell-completion", "--resolve", "-p", "--package", "--version",
    "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
}


def needs_hydra_cli(argv: list[str]) -> bool:
    """True when argv uses Hydra's command-line features (sweeps, --help, --cfg, hydra.* keys)."""
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if arg.split("=", 1)[0] in _HYDRA_FLAGS or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            return True
    return False


def _first_lines(text: str, n: int = 4) -> str:
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    return "\n    ".join(lines[:n])


def group_problems(overrides: list[str]) -> list[str]:
    """Group choices (``hardware=h100_sxm``) that name a file outside their group's directory
    (``hardware=../model/tiny``): Hydra would compose another group's preset into the section."""
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        group = CONF_DIR / key.lstrip("+~")
        if not eq or "/" in key or not value or not group.is_dir():
            continue
        if not (group / value).resolve().is_relative_to(group.resolve()):
            presets = sorted(p.stem for p in group.glob("*.yaml"))
            out.append(f"{key.lstrip('+~')}: {value!r} is not one of the presets in rlbatch/conf/{group.name}: "
                       f"{presets}"[:300])
    return out


def syntax_problems(overrides: list[str]) -> list[str]:
    """Each override Hydra's grammar refuses, named by its text and its place on the command line
    (Hydra's own message quotes the offending characters only)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for i, arg in enumerate(overrides, 1):
        try:
            parser.parse_override(arg)
        except HydraException as e:
            out.append(f"overrides: {arg!r} (argument {i} of {len(overrides)}): {_first_lines(str(e), 2)}"[:400])
    return out


def compose(overrides: list[str]) -> Any:
    """The composed, resolved DictConfig for ``overrides`` (Hydra override syntax)."""
    if problems := syntax_problems(overrides) or group_problems(overrides):
        raise ConfigError(problems)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlbatch.config.register import register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else None
        detail = _first_lines(str(e)) + (f"\n    {_first_lines(str(cause), 2)}" if cause else "")
        raise ConfigError(f"overrides: {detail}") from None
    return cfg
