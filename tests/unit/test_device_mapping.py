"""device_mapping: the small grammar, injection attempts, and pathological input.

ROLL evaluates device_mapping with ``eval``; rlbatch parses it. These tests pin the accepted
spellings, show that code in a config never runs (through the parser and through the CLI), and
that hostile input fails fast with ConfigError instead of recursing, exhausting memory or hanging.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlbatch.placement.backend
import rlbatch.placement.device_mapping
import rlbatch.placement.place
import rlbatch.placement.placement
from rlbatch import ConfigError
from rlbatch.placement import parse_device_mapping, place

PLACEMENT_DIR = Path(__file__).resolve().parents[2] / "rlbatch" / "placement"
PLACEMENT_MODULES = [
    rlbatch.placement.backend, rlbatch.placement.device_mapping, rlbatch.placement.placement, rlbatch.placement.place,
]


# --------------------------------------------------------------------------- the grammar


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("[0, 1, 2]", [0, 1, 2]),
        ("[0,]", [0]),
        (" [ 3 , 1 ] ", [3, 1]),
        ("range(4)", [0, 1, 2, 3]),
        ("range(2, 6)", [2, 3, 4, 5]),
        ("range(0, 8, 2)", [0, 2, 4, 6]),
        ("range(3, 0, -1)", [3, 2, 1]),
        ("list(range(0,16))", list(range(16))),
        ("list(range(16,24))", list(range(16, 24))),
        ("list(range(1, 8, 3))", [1, 4, 7]),
        ("[0,1]+range(4,6)", [0, 1, 4, 5]),
        ("range(4,8) + [0, 1] + list(range(2,4))", [4, 5, 6, 7, 0, 1, 2, 3]),
        ("\n[0]\n", [0]),
    ],
)
def test_grammar_accepts(spec: str, expected: list[int]) -> None:
    got = parse_device_mapping(spec)
    assert got == expected
    assert type(got) is list and all(type(r) is int for r in got)


@pytest.mark.parametrize(("spec", "expected"), [([0, 1], [0, 1]), ((2, 3), [2, 3]), ([7], [7])])
def test_lists_of_ints_are_accepted(spec: object, expected: list[int]) -> None:
    assert parse_device_mapping(spec) == expected


def test_roll_reference_examples() -> None:
    assert parse_device_mapping("list(range(0,16))") == list(range(16))
    assert parse_device_mapping("list(range(16,24))") == list(range(16, 24))
    assert parse_device_mapping("list(range(0,12))") == list(range(12))
    assert parse_device_mapping("list(range(0,4))") == [0, 1, 2, 3]
    assert parse_device_mapping("list(range(4,8))") == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("[0, 0]", "listed more than once: [0]"),
        ("range(0,4)+range(2,6)", "listed more than once: [2, 3]"),
        ("[-1]", ">= 0"),
        ([3, -2], ">= 0"),
        ("[]", "empty"),
        ([], "empty"),
        ([0, True], "got bool True"),
        ([0, 1.0], "got float 1.0"),
        (True, "expected a list of GPU ranks"),
        (1, "expected a list of GPU ranks"),
    ],
)
def test_errors_name_the_field(spec: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_device_mapping(spec, "roles.actor_infer.device_mapping")
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("roles.actor_infer.device_mapping")
    assert fragment in str(e.value)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_device_mapping("[0, 0]")


# --------------------------------------------------------------------------- code never runs

# (payload, True when ``eval`` of it would create MARKER: proves the payload is live)
PAYLOADS = [
    ("__import__('os').system('touch MARKER')", True),
    ("[open('MARKER','w')]", True),
    ('list(range(0,2))+[__import__("os").system("touch MARKER")]', True),
    ("list(range(0,2)) + [open('MARKER', 'w').close()]", True),
    ("exec(\"open('MARKER','w')\")", True),
    ("eval(\"open('MARKER','w')\")", True),
    ("(lambda: open('MARKER','w'))()", True),
    ("f\"{open('MARKER','w')}\"", True),
    ("[x for x in [open('MARKER','w')]]", True),
    ("range(0,2) if open('MARKER','w') else []", True),
    ("getattr(__builtins__, 'open')('MARKER', 'w') if False else [open('MARKER', 'w')]", True),
    ("compile(\"open('MARKER','w')\", 'x', 'exec')", False),
    ("[0].__class__.__base__.__subclasses__()", False),
    ("range(0, 2).__class__", False),
    ("lambda: 0", False),
    ("[0]; import os; os.system('touch MARKER')", False),
    ("$(touch MARKER)", False),
    ("`touch MARKER`", False),
]
PAYLOAD_IDS = [f"payload{i}" for i in range(len(PAYLOADS))]


@pytest.fixture
def no_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the placement code calls eval, exec or compile.

    The names are shadowed in each placement module's globals (looked up before builtins), so
    pytest's own use of compile() is untouched.
    """

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"eval/exec/compile called with {args!r}"[:200])

    for module in PLACEMENT_MODULES:
        for name in ("eval", "exec", "compile", "__import__"):
            monkeypatch.setattr(module, name, forbidden, raising=False)


@pytest.mark.parametrize("payload", [p for p, live in PAYLOADS if live])
def test_payloads_are_live_under_eval(payload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The payloads below would run if device_mapping were evaluated as ROLL does."""
    monkeypatch.chdir(tmp_path)
    try:
        eval(payload)  # noqa: S307 - deliberately: shows what the parser must never do
    except Exception:
        pass
    assert (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("payload", [p for p, _ in PAYLOADS], ids=PAYLOAD_IDS)
def test_injection_is_refused_by_the_parser(payload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_eval: None) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_device_mapping(payload, "roles.actor_train.device_mapping")
    assert "roles.actor_train.device_mapping" in str(e.value)
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("payload", [p for p, _ in PAYLOADS], ids=PAYLOAD_IDS)
def test_injection_is_refused_by_plan(payload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_eval: None) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = {
        "roles": {
            "actor_train": {"device_mapping": "[0, 1]", "backend": payload},
            "actor_infer": {"device_mapping": payload, "backend": "hf:d2"},
            "reference": {"device_mapping": [0, 1], "backend": payload},
        }
    }
    with pytest.raises(ConfigError) as e:
        place(cfg)
    text = str(e.value)
    assert "roles.actor_train.backend" in text
    assert "roles.actor_infer.device_mapping" in text
    assert "roles.reference.backend" in text
    assert not (tmp_path / "MARKER").exists()


def _hydra_quoted(payload: str) -> str:
    """The payload as a single-quoted Hydra override value (Hydra unescapes \\' inside)."""
    assert "\\" not in payload and "${" not in payload
    return "'" + payload.replace("'", "\\'") + "'"


# One CLI run carries several payloads: payload i goes into ROLE[i].device_mapping and
# ROLE[i+1].backend, and every problem names its field, so each slot is checked on its own.
CLI_ROLES = ("actor_train", "actor_infer", "reference", "critic")
CLI_CHUNKS = [
    pytest.param([p for p, _ in PAYLOADS[i : i + len(CLI_ROLES)]], id=f"payloads{i}-{min(i + len(CLI_ROLES), len(PAYLOADS)) - 1}")
    for i in range(0, len(PAYLOADS), len(CLI_ROLES))
]


@pytest.mark.parametrize("payloads", CLI_CHUNKS)
def test_injection_through_the_cli(payloads: list[str], tmp_path: Path, cli_env: dict[str, str]) -> None:
    overrides = ["dry_run=true", "roles.critic.enabled=true"]
    slots = []
    for i, payload in enumerate(payloads):
        dm_role, backend_role = CLI_ROLES[i], CLI_ROLES[(i + 1) % len(CLI_ROLES)]
        overrides.append(f"roles.{dm_role}.device_mapping={_hydra_quoted(payload)}")
        overrides.append(f"roles.{backend_role}.backend={_hydra_quoted(payload)}")
        slots += [f"roles.{dm_role}.device_mapping", f"roles.{backend_role}.backend"]
    proc = subprocess.run(
        [sys.executable, "-m", "rlbatch.launch", *overrides],
        cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # Every value reached rlbatch's parsers (Hydra's override grammar did not refuse it first).
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("  - roles.")]
    for slot in slots:
        assert any(ln.startswith(f"  - {slot}") for ln in problems), (slot, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "Slurm request" not in proc.stdout
    assert not (tmp_path / "MARKER").exists()
    assert list(tmp_path.iterdir()) == []


def test_placement_code_never_evaluates() -> None:
    """No eval/exec/compile/literal_eval/__import__ anywhere in rlbatch/placement."""
    banned = {"eval", "exec", "compile", "literal_eval", "__import__"}
    found = []
    for path in sorted(PLACEMENT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else None
                # re.compile(...) is a regex, not code: only bare names and ast.literal_eval count.
                if isinstance(f, ast.Attribute) and f.attr == "literal_eval":
                    name = f.attr
                if name in banned:
                    found.append(f"{path.name}:{node.lineno} {name}")
    assert found == []


# --------------------------------------------------------------------------- pathological input

PATHOLOGICAL = [
    pytest.param("x" * (1 << 20), id="1MB-string"),
    pytest.param("[0]" + " " * (1 << 20), id="1MB-trailing-spaces"),
    pytest.param("[" * 100000, id="open-brackets-100k"),
    pytest.param("[" * 4000, id="open-brackets-under-limit"),
    pytest.param("(" * 4000, id="open-parens-under-limit"),
    pytest.param("list(" * 10000, id="list-nesting-10k"),
    pytest.param("list(" * 800, id="list-nesting-under-limit"),
    pytest.param("range(0, 10**12)", id="range-10**12"),
    pytest.param("range(10**9)", id="range-10**9"),
    pytest.param("range(0, 999999999)", id="range-1e9-literal"),
    pytest.param("range(-999999999, 999999999)", id="range-2e9"),
    pytest.param("range(0,999999999,1)+range(0,999999999)", id="two-huge-ranges"),
    pytest.param("+".join(["list(range(0,65536))"] * 180), id="many-max-ranges"),
    pytest.param("+".join(["[0]"] * 10000), id="10k-terms"),
    pytest.param("+".join(["[0]"] * 1000), id="1k-terms-under-limit"),
    pytest.param("[0" + ",0" * 2000 + "]", id="2k-duplicates"),
    pytest.param("[" + "9" * 100000 + "]", id="100k-digit-literal"),
    pytest.param("[" + "9" * 4000 + "]", id="4k-digit-literal"),
    pytest.param("range(" + "9" * 4000 + ")", id="4k-digit-range"),
    pytest.param("[" + "-" * 4000 + "1]", id="minus-signs"),
    pytest.param(list(range(10**6)), id="list-of-1M-ints"),
    pytest.param(range(10**12), id="range-object-10**12"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("spec", PATHOLOGICAL)
def test_pathological_input_fails_fast(spec: object) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError):
        parse_device_mapping(spec, "roles.actor_train.device_mapping")
    assert time.perf_counter() - start < 1.0


@pytest.mark.timeout(20)
def test_pathological_input_fails_fast_through_place() -> None:
    start = time.perf_counter()
    cfg = {
        "roles": {
            "actor_train": {"device_mapping": "[" * 100000, "backend": "fsdp:d2"},
            "actor_infer": {"device_mapping": "range(0, 999999999)", "backend": "hf:d2"},
        }
    }
    with pytest.raises(ConfigError) as e:
        place(cfg)
    assert len(e.value.problems) == 2
    assert time.perf_counter() - start < 1.0


@pytest.mark.timeout(20)
def test_huge_sparse_gpu_ranks_fail_fast_through_place() -> None:
    """A rank near 10**9 leaves a billion unused ranks: reported, not materialised."""
    start = time.perf_counter()
    cfg = {
        "roles": {
            "actor_train": {"device_mapping": "[0, 999999999]", "backend": "fsdp:d2"},
            "actor_infer": {"device_mapping": "range(999999990, 999999998)", "backend": "hf:d8"},
        }
    }
    with pytest.raises(ConfigError, match=r"in no role's device_mapping") as e:
        place(cfg)
    assert "GPU rank 999999999 leaves GPU ranks 1..999999989, 999999998 (999999990 GPUs)" in str(e.value)
    assert time.perf_counter() - start < 1.0
