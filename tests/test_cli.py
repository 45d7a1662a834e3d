"""``evflow run``: exit codes and one clear line per mistake (some in a real subprocess)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evflow.cli import main
from evflow.io.records import RecordInput
from evflow.processing.steering import run_steering

GOOD = """\
import evflow
from evflow.io.generators import ToyGenerator

class Odd(evflow.Module):
    parallel = True
    def event(self, store):
        return store.meta.uid % 2 == 1

path = evflow.Path([ToyGenerator(n_events=20, payload_bytes=16), Odd()])
evflow.process(path)
"""

RAISES = """\
import evflow
from evflow.io.generators import ToyGenerator

def calibrate(value):
    return {"a": 1}[value]

class Calib(evflow.Module):
    def event(self, store):
        if store.meta.uid == 3:
            calibrate("missing-key")

evflow.process(evflow.Path([ToyGenerator(n_events=10), Calib()]))
"""


def steering(tmp_path: Path, text: str, name: str = "steer.py") -> str:
    file = tmp_path / name
    file.write_text(textwrap.dedent(text))
    return str(file)


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The run failed (exit 1) with exactly one line on stderr; that line."""
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_run_writes_output_and_honours_max_events(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sel.evf"
    code = main(["run", steering(tmp_path, GOOD), "-n", "10", "-o", str(out)])
    assert code == 0
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == [1, 3, 5, 7, 9]
    stdout = capsys.readouterr().out
    assert "10 read, 5 written, 5 dropped" in stdout
    assert "Module statistics" in stdout


def test_quiet_prints_nothing(tmp_path: Path, capsys) -> None:
    assert main(["run", steering(tmp_path, GOOD), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_syntax_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    file = steering(tmp_path, "import evflow\n\nx = (1,\n")
    result = run_cli("run", file)
    line = one_error_line(result)
    assert line.startswith(f"evflow: error: {file}:3: syntax error")
    assert "Traceback" not in result.stderr


def test_module_raising_shows_user_traceback_once_then_one_line(tmp_path: Path) -> None:
    file = steering(tmp_path, RAISES)
    result = run_cli("run", file, "--quiet")
    assert result.returncode == 3  # an event failed: as a parallel run that quarantines it
    err = result.stderr
    assert err.count("Traceback (most recent call last)") == 1
    assert 'calibrate("missing-key")' in err and 'return {"a": 1}[value]' in err
    assert "evflow/processing" not in err  # no framework frames in the user's traceback
    last = err.strip().splitlines()[-1]
    assert last == (
        "evflow: error: module 'Calib' raised in event() on event uid=3: KeyError: 'missing-key'"
    )


def test_unknown_parameter_is_one_line(tmp_path: Path) -> None:
    file = steering(
        tmp_path,
        "import evflow\nfrom evflow.io.generators import ToyGenerator\n"
        "evflow.process(evflow.Path([ToyGenerator(payload=3)]))\n",
    )
    result = run_cli("run", file)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"evflow: error: {file}:3: module 'ToyGenerator' has no parameter 'payload' "
        "(known: experiment, n_events, payload_bytes, run, seed, work_ms)"
    ]


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        ("x = 1\nraise RuntimeError('no luck')\n", ":2: RuntimeError: no luck"),
        (
            "import evflow\nfrom evflow.io.generators import ToyGenerator\n"
            "ToyGenerator(n_events=1.5)\n",
            "'n_events' expects int, got float 1.5",
        ),
        (
            "import evflow\nfrom evflow.io.records import RecordInput\n"
            "evflow.process(evflow.Path([RecordInput(file='missing.evf')]))\n",
            "missing.evf",
        ),
    ],
    ids=["exception", "wrong-type", "missing-input"],  # ROOT cases below
)
def test_bad_steering_is_one_error_line(tmp_path: Path, capsys, body: str, expect: str) -> None:
    code = main(["run", steering(tmp_path, body)])
    assert code == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err_lines[-1].startswith("evflow: error: ")
    assert expect in err_lines[-1]


def test_unwritable_output_is_one_line(tmp_path: Path, capsys) -> None:
    code = main(["run", steering(tmp_path, GOOD), "-o", "/no/such/dir/out.root"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "evflow: error: cannot write output '/no/such/dir/out.root': "
        "directory '/no/such/dir' does not exist"
    ]


def test_missing_steering_file(tmp_path: Path, capsys) -> None:
    assert main(["run", str(tmp_path / "nope.py")]) == 1
    assert "nope.py' does not exist" in capsys.readouterr().err


def test_bad_command_line_exits_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", steering(tmp_path, GOOD), "-n", "-3"])
    assert info.value.code == 2
    assert "expected a number >= 0" in capsys.readouterr().err


def test_parallel_option_reaches_process(tmp_path: Path, monkeypatch, capsys) -> None:
    seen = {}

    def fake_dispatch(path, options):
        seen["workers"] = options.workers
        from evflow.processing.sequential import run_sequential

        return run_sequential(path, options)

    monkeypatch.setattr("evflow.processing.api._dispatch", fake_dispatch)
    assert main(["run", steering(tmp_path, GOOD), "-p", "3", "-q"]) == 0
    assert seen == {"workers": 3}


def test_steering_arguments_after_double_dash(tmp_path: Path, capsys) -> None:
    file = steering(
        tmp_path,
        "import sys, evflow\nfrom evflow.io.generators import ToyGenerator\n"
        "n = int(sys.argv[1])\n"
        "evflow.process(evflow.Path([ToyGenerator(n_events=n)]))\n",
    )
    assert main(["run", file, "--", "6"]) == 0
    assert "6 read" in capsys.readouterr().out


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["toy_steering.py", "hzz_steering.py"])
def test_examples_run(tmp_path: Path, monkeypatch, capsys, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sel.evf"
    assert main(["run", str(EXAMPLES / name), "-n", "200", "-o", str(out), "-q"]) == 0
    uids = [s.meta.uid for s in RecordInput(file=str(out)).events()]
    assert 0 < len(uids) < 200 and uids == sorted(set(uids))


ROOT = Path(__file__).resolve().parents[1]


def test_readme_code_examples_run(tmp_path: Path, monkeypatch) -> None:
    import re

    import evflow
    from evflow.demo import hzz_path
    from evflow.io.generators import ToyGenerator

    monkeypatch.chdir(tmp_path)
    steering_block, module_block = re.findall(
        r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    (tmp_path / "steer.py").write_text(
        steering_block.replace('"uproot-HZZ.root"', repr(hzz_path()))
    )
    (summary,) = run_steering(tmp_path / "steer.py", {"quiet": True})
    assert summary.events_read == 1000 and summary.persistent["m_mumu"].sum() > 400

    namespace: dict = {}
    exec(compile(module_block, "README.md", "exec"), namespace)

    class Muons(evflow.Module):
        def event(self, store: evflow.DataStore) -> None:
            store["mu_px"] = [1.0] * (store.meta.uid % 3)

    path = evflow.Path([ToyGenerator(n_events=30), Muons(), namespace["MuonCount"]()])
    result = evflow.process(path, quiet=True)
    assert result.events_written == 20
    assert list(result.persistent["n_mu"].values()[:3]) == [10, 10, 10]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = readme.split("## Run the tests", 1)[1].split("```")[1].strip()
    assert command == "pip install -e '.[test]' && python -m pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'TEST_CMD="{command}"' in ci
    assert 'bash -c "$TEST_CMD"' in ci
    demo = readme.split("## Run the demo", 1)[1].split("```")[1].strip()
    assert demo == "pip install -e . && evflow demo"


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (None, "ROOT input file '{file}' does not exist"),
        (b"this is not a ROOT file at all" * 10, "'{file}' is not a readable ROOT file"),
    ],
    ids=["missing-root", "corrupt-root"],
)
def test_bad_root_input_is_one_line(tmp_path: Path, content: bytes | None, expect: str) -> None:
    data = tmp_path / "data.root"
    if content is not None:
        data.write_bytes(content)
    file = steering(
        tmp_path,
        "import evflow\nfrom evflow.io.root import RootInput\n"
        f"evflow.process(evflow.Path([RootInput(file={str(data)!r})]))\n",
    )
    result = run_cli("run", file)
    line = one_error_line(result)
    assert line.startswith(f"evflow: error: {file}:3: ")
    assert expect.format(file=data) in line


def test_ctrl_c_turned_into_import_error_by_an_extension_exits_130(tmp_path: Path, capsys) -> None:
    steer = tmp_path / "interrupted.py"
    steer.write_text(
        "try:\n    raise KeyboardInterrupt\nexcept KeyboardInterrupt as exc:\n"
        "    raise ImportError('initialization failed') from exc\n"
    )
    assert main(["run", str(steer)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err and "error" not in err


def test_ctrl_c_that_an_extension_turns_into_a_plain_import_error_exits_130(tmp_path: Path) -> None:
    # numpy's C init, interrupted while it imports datetime through a capsule, raises an
    # ImportError that no longer carries the KeyboardInterrupt
    steer = tmp_path / "lost.py"
    steer.write_text(
        "import os, signal\ninterrupted = False\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT)\n"
        "except KeyboardInterrupt:\n    interrupted = True\n"
        "if interrupted:\n"
        "    raise ImportError('PyCapsule_Import could not import module datetime')\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "evflow", "run", str(steer)],
        capture_output=True,
        text=True,
        timeout=60,
        # a test run started in the background by a shell ignores SIGINT; the command must not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.returncode == 130, result.stderr
    assert "interrupted" in result.stderr and "error" not in result.stderr


SHUFFLED = """\
import evflow
from evflow.io.generators import BusyWork, ToyGenerator

class Uneven(evflow.Module):
    parallel = True
    def event(self, store):
        from evflow.io.generators import burn_cpu
        burn_cpu(0.4 if store.meta.uid % 5 == 0 else 0.01)

evflow.process(evflow.Path([ToyGenerator(n_events=400, payload_bytes=16), Uneven()]))
"""


def test_run_ordered_writes_the_events_in_input_order(tmp_path: Path) -> None:
    out = tmp_path / "o.evr"
    args = ["run", steering(tmp_path, SHUFFLED), "-p", "2", "-q", "-o", str(out), "--ordered"]
    assert main(args) == 0
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == list(range(400))


@pytest.mark.parametrize(
    ("body", "code", "said"),
    [("return 3", 3, ""), ("raise KeyboardInterrupt", 130, "evflow: interrupted")],
)
def test_once_the_command_is_done_a_ctrl_c_cannot_end_it_by_signal(
    body: str, code: int, said: str
) -> None:
    """The program's entry (``evflow``, ``python -m evflow``) ignores SIGINT once the
    command returned: a Ctrl-C during the interpreter's teardown (SIGINT back at its
    default then) ended a clean ``evflow up`` with -2 instead of its code. Here a
    Ctrl-C sent at exit, after main() returned, changes nothing; one that lands between
    main's return and the exit is one line and 130."""
    script = textwrap.dedent(
        f"""
        import atexit, os, signal
        import evflow.cli as cli

        def main():
            {body}

        def at_exit():
            print("sigint:", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
            os.kill(os.getpid(), signal.SIGINT)

        atexit.register(at_exit)
        cli.main = main
        cli.run()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code, proc.stderr
    assert "sigint: True" in proc.stdout
    assert proc.stderr.strip() == said


def test_an_unwritable_output_with_workers_is_the_one_real_line(tmp_path: Path) -> None:
    # the workers killed as the run aborts at start-up had said HELLO (and connected):
    # those refusals came as warnings before the real error, in about 1 of 3 runs,
    # so three runs
    file = steering(tmp_path, GOOD)
    for _ in range(3):
        result = run_cli("run", file, "-p", "2", "-o", "/proc/evflow-test.evr")
        line = one_error_line(result)
        assert line.startswith("evflow: error: cannot open record output '/proc/evflow-test.evr'")
