"""tools/bench/train_engines.py refuses bad options before it starts any process, naming the
option and the value."""

from __future__ import annotations

import pytest

from tools.bench import train_engines


@pytest.mark.parametrize(("argv", "says"), [
    (["--engines", "fsdp,zero4"], "--engines: unknown ['zero4']"),
    (["--engines", ","], "--engines: empty"),
    (["--batch", "3"], "--batch 3 must be even"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq", "16", "--prompt-len", "16"], "--prompt-len 16 must be between 0 and --seq 16"),
])
def test_bad_options_are_refused_with_the_option_named(argv: list[str], says: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        train_engines.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_every_config_names_a_registered_training_engine_and_fits_two_ranks() -> None:
    from rlbatch.engines.registry import engine_args, spec_of

    for c in train_engines.CONFIGS:
        assert spec_of(c.engine).built, c
        engine_args(c.engine, c.args)  # accepted by the registry's typed engine_args
        assert c.dp * c.tp * c.pp == train_engines.RANKS, c


def test_describe_lists_each_training_engines_heads() -> None:
    from rlbatch.engines.registry import describe

    lines = {line.split()[0]: line for line in describe().splitlines()}
    assert "heads: lm, value, reward;" in lines["fsdp"] and "heads: lm, value, reward;" in lines["megatron"]
    assert "heads" not in lines["vllm"]  # inference engines have the language-model head only
