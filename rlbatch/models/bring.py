"""``python -m rlbatch.models.bring SOURCE``: a GGUF file, a local Hugging Face model directory or a
bundled model's name (``smollm2``) into rlbatch's model cache, once (``rlbatch.models.importer``).

Prints the model directory on stdout, alone, for ``model.path=<dir>``
(``MODEL=$(python -m rlbatch.models.bring smollm2)``); what was done goes to stderr. Exit codes:
0 done (imported now or found in the cache), 2 the source cannot be imported (the reason on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from rlbatch.errors import ConfigError, ExitCode
from rlbatch.models.bundled import BUNDLED
from rlbatch.models.gguf_convert import DTYPES
from rlbatch.models.importer import default_cache_dir, import_model

PROG = "python -m rlbatch.models.bring"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Turn a GGUF file or a local Hugging Face model directory into the model directory "
                               "rlbatch's engines load (safetensors, config.json, tokenizer with its chat template), "
                               "once: a second call with the same source returns the same directory without work.")
    p.add_argument("source", help=f"a .gguf file, a local Hugging Face model directory, or a bundled model: "
                                  f"{', '.join(sorted(BUNDLED))}")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"where imported models live (default: {default_cache_dir()}, from $XDG_CACHE_HOME); on "
                        f"Slurm, a filesystem every compute node mounts")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="GGUF only: the dtype the dequantised weights are written in (default fp32, exact)")
    return p


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Whatever the converting libraries print (some log to stdout) goes to stderr, so that stdout
    holds the model directory alone."""
    for stream in (sys.stdout, sys.__stdout__):
        if stream is not None:
            stream.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for stream in (sys.stdout, sys.__stdout__):
            if stream is not None:
                stream.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with _stdout_to_stderr():
            done = import_model(args.source, args.cache_dir, args.dtype)
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return int(ExitCode.BAD_CONFIG)
    r = done.record
    what = str(r.get("model_type", "?"))
    if "parameters" in r:
        n = int(r["parameters"])
        what += f", {n / 1e6:.1f}M parameters" if n >= 100_000 else f", {n} parameters"
        what += f" in {r.get('dtype')}"
    if done.cached:
        print(f"rlbatch: {r.get('source')} was imported before ({what}): nothing to do", file=sys.stderr)
    else:
        print(f"rlbatch: imported {r.get('source')} ({what}) in {r.get('seconds')}s", file=sys.stderr)
    print(f"rlbatch: use it with model.path={done.path}", file=sys.stderr)
    print(done.path)
    return int(ExitCode.FINISHED)


if __name__ == "__main__":
    sys.exit(main())
