"""The command lines a user starts (demo, launch, bench, build): options checked and named,
help for every option, one clear line instead of a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from jax_dsa_exchange import bench, build, demo, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- demo


@pytest.mark.parametrize("argv, named", [
    (["--steps", "0"], "argument --steps: 0 is out of range"),
    (["--rows", "0"], "argument --rows: 0 is out of range"),
    (["--block-size", "0"], "argument --block-size: 0 is out of range"),
    (["--cols", "0"], "argument --cols: 0 is out of range"),
    (["--cols", str((1 << 17) + 1)], "argument --cols: 131073 is out of range: need 1 <= cols <= 131072"),
    (["--world", "0"], "argument --world: 0 is out of range: need 1 <= world <= 16"),
    (["--world", "17"], "argument --world: 17 is out of range"),
    (["--layers", "0"], "argument --layers: 0 is out of range"),
    (["--topk", "100"], "argument --topk: 100 must be a multiple of 32 in [64, 4096]"),
    (["--topk", "256", "--local-topk", "512"], "argument --local-topk: 512 must be a multiple of 32 in [32, --topk=256]"),
    (["--local-topk", "0"], "argument --local-topk: 0 must be a multiple of 32"),
    (["--timeout", "0"], "argument --timeout: 0.0 must be > 0"),
])
def test_demo_rejects_bad_options_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m jax_dsa_exchange.demo: error: {named}" in err, err


def test_demo_accepts_the_edges():
    a = demo._parse(["--world", "16", "--cols", str(1 << 17), "--topk", "4096", "--local-topk", "4096",
                     "--steps", "1", "--rows", "1", "--block-size", "1", "--layers", "1"])
    assert (a.world, a.cols, a.topk, a.local_topk) == (16, 1 << 17, 4096, 4096)


def test_demo_runs_at_the_smallest_sizes():
    """One rank, one column, one row, one-token pages, more steps than tokens: checked exactly."""
    p = _run("-m", "jax_dsa_exchange.demo", "--world", "1", "--cols", "1", "--rows", "1", "--steps", "3",
             "--layers", "1", "--topk", "64", "--local-topk", "32", "--block-size", "1", "--path", "xla",
             timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK: 3 steps x 1 layers x 1 rows, W=1, path=xla: bit-identical" in p.stdout, p.stdout


def test_demo_help_says_what_rescue_rows_are(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "rescue rows:" in out
    assert "a second round (the rescue)" in out and "--local-topk" in out and "(model)" in out


# ----------------------------------------------------------------------------- launch


def test_launch_of_a_missing_command_is_one_line():
    p = _run("-m", "jax_dsa_exchange.launch", "-n", "2", "--", "no_such_command_dsa")
    assert p.returncode == 127, p.stdout + p.stderr
    assert p.stderr.strip() == "[launch] cannot start 'no_such_command_dsa': No such file or directory", p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_launch_of_a_file_that_is_not_executable(tmp_path):
    f = tmp_path / "not_executable"
    f.write_text("")
    f.chmod(0o644)
    assert launch.launch([str(f)], 2) == 126


# ----------------------------------------------------------------------------- bench, build


def _options(p: argparse.ArgumentParser):
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _build_parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser build.main makes (caught at its parse_args)."""
    seen = []

    def catch(self, *args, **kwargs):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        build.main([])
    return seen[0]


def test_every_bench_and_build_option_has_help(monkeypatch):
    parsers = {"bench": bench.parser(), "bench --serving": bench.parser(serving=True),
               "build": _build_parser(monkeypatch)}
    for name, p in parsers.items():
        opts = _options(p)
        assert len(opts) >= 5, name
        missing = [a.option_strings[0] for a in opts if not (a.help or "").strip()]
        assert not missing, (name, missing)
    assert parsers["build"].prog == "python -m jax_dsa_exchange.build"


def test_bench_help_names_the_command():
    p = _run("-m", "jax_dsa_exchange.bench", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: python -m jax_dsa_exchange.bench "), p.stdout[:200]
    assert bench.parser().prog == "python -m jax_dsa_exchange.bench"


def test_bench_serving_defaults():
    a = bench._args(["--serving"])
    assert (a.world, a.local_topk, a.rows, a.cols, a.layers) == (1, [2048], [16], [32768], 16)
    assert bench._args(["--serving", "--rows", "4"]).rows == [4]
    assert bench._args([]).rows == [1, 16, 64, 256]
