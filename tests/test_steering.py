"""Steering files: run as __main__, command-line overrides, one clear error per mistake."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import evflow
from evflow.errors import (
    ConfigurationError,
    InputError,
    ModuleError,
    OutputError,
    ParameterError,
    SteeringError,
)
from evflow.processing.steering import current_context, run_steering, steering_overrides

HEADER = """\
import evflow
from evflow.io.generators import ToyGenerator
"""


def write(tmp_path: Path, body: str, name: str = "steer.py") -> Path:
    file = tmp_path / name
    file.write_text(HEADER + textwrap.dedent(body))
    return file


def test_steering_file_runs_as_main_and_returns_summaries(tmp_path: Path) -> None:
    file = write(
        tmp_path,
        """
        import sys
        assert __name__ == "__main__", __name__
        ARGS = sys.argv[1:]
        path = evflow.Path([ToyGenerator(n_events=12, payload_bytes=8)])
        if __name__ == "__main__":
            evflow.process(path, quiet=True)
        """,
    )
    argv_before, main_before = list(sys.argv), sys.modules["__main__"]
    summaries = run_steering(file, argv=["--flag", "x"])
    assert [s.events_read for s in summaries] == [12]
    assert sys.argv == argv_before and sys.modules["__main__"] is main_before
    assert current_context() is None


def test_command_line_overrides_win_over_the_steering_file(tmp_path: Path) -> None:
    file = write(
        tmp_path,
        """
        path = evflow.Path([ToyGenerator(n_events=50, payload_bytes=8)])
        evflow.process(path, max_events=40, quiet=True)
        """,
    )
    (summary,) = run_steering(file, {"max_events": 5})
    assert summary.events_read == 5


def test_output_override_reaches_process(tmp_path: Path) -> None:
    from evflow.io.records import RecordInput

    file = write(
        tmp_path,
        """
        evflow.process(evflow.Path([ToyGenerator(n_events=7, payload_bytes=8)]), quiet=True)
        """,
    )
    out = tmp_path / "o.evf"
    run_steering(file, {"output": str(out)})
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == list(range(7))


def test_steering_file_imports_its_neighbours(tmp_path: Path) -> None:
    (tmp_path / "mymods.py").write_text(
        "import evflow\nclass Tag(evflow.Module):\n"
        "    parallel = True\n"
        "    def event(self, store):\n        store['tag2'] = 1\n"
    )
    file = write(
        tmp_path,
        """
        from mymods import Tag
        evflow.process(evflow.Path([ToyGenerator(n_events=3), Tag()]), quiet=True)
        """,
    )
    assert run_steering(file)[0].events_written == 3
    assert str(tmp_path) not in sys.path  # sys.path restored


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    file = write(tmp_path, "\npath = evflow.Path(\nprint('x'\n")
    with pytest.raises(SteeringError) as info:
        run_steering(file)
    msg = str(info.value)
    assert str(file) in msg
    assert "syntax error" in msg
    assert ":4:" in msg or ":5:" in msg  # the line of the unclosed call


def test_exception_in_steering_file_names_file_line_and_error(tmp_path: Path) -> None:
    file = write(tmp_path, "\nx = 1\ny = undefined_name + x\n")
    with pytest.raises(SteeringError) as info:
        run_steering(file)
    msg = str(info.value)
    assert msg.startswith(f"{file}:5: NameError:")
    assert "undefined_name" in msg
    tb = info.value.traceback_text  # type: ignore[attr-defined]
    assert "steer.py" in tb and "steering.py" not in tb


def test_unknown_module_parameter_names_module_parameter_and_line(tmp_path: Path) -> None:
    file = write(tmp_path, "\nsrc = ToyGenerator(n_event=10)\n")
    with pytest.raises(ParameterError) as info:
        run_steering(file)
    msg = str(info.value)
    assert msg.startswith(f"{file}:4: ")
    assert "'ToyGenerator' has no parameter 'n_event'" in msg
    assert "n_events" in msg  # the known names, to spot the typo


def test_wrong_parameter_type_names_expected_type(tmp_path: Path) -> None:
    file = write(tmp_path, "src = ToyGenerator(n_events='ten')\n")
    with pytest.raises(ParameterError, match=r"'n_events' expects int, got str 'ten'"):
        run_steering(file)


def test_bad_process_option_in_steering_names_the_line(tmp_path: Path) -> None:
    file = write(tmp_path, "evflow.process(evflow.Path([ToyGenerator()]), max_event=3)\n")
    with pytest.raises(ConfigurationError, match=r"steer.py:3: .*unknown option 'max_event'"):
        run_steering(file)


def test_missing_input_file_is_an_input_error(tmp_path: Path) -> None:
    file = write(
        tmp_path,
        """
        from evflow.io.records import RecordInput
        evflow.process(evflow.Path([RecordInput(file="no-such-file.evf")]))
        """,
    )
    with pytest.raises(InputError, match=r"no-such-file\.evf"):
        run_steering(file)


def test_unwritable_output_is_an_output_error(tmp_path: Path) -> None:
    file = write(tmp_path, "evflow.process(evflow.Path([ToyGenerator(n_events=2)]))\n")
    with pytest.raises(OutputError, match="does not exist"):
        run_steering(file, {"output": str(tmp_path / "missing-dir" / "out.evf")})


def test_module_error_from_the_run_passes_through_unchanged(tmp_path: Path) -> None:
    file = write(
        tmp_path,
        """
        class Bad(evflow.Module):
            def event(self, store):
                if store.meta.uid == 2:
                    return 1 / 0
        evflow.process(evflow.Path([ToyGenerator(n_events=5), Bad()]), quiet=True)
        """,
    )
    with pytest.raises(ModuleError) as info:
        run_steering(file)
    assert info.value.uid == 2 and info.value.module == "Bad"
    assert str(info.value).startswith("module 'Bad' raised in event() on event uid=2")
    assert "return 1 / 0" in info.value.traceback_text


def test_missing_steering_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(SteeringError, match="does not exist"):
        run_steering(tmp_path / "nope.py")
    with pytest.raises(SteeringError, match="is a directory"):
        run_steering(tmp_path)


def test_steering_file_that_never_processes_is_an_error(tmp_path: Path) -> None:
    file = write(tmp_path, "path = evflow.Path([ToyGenerator()])\n")
    with pytest.raises(SteeringError, match=r"never called evflow.process\(path\)"):
        run_steering(file)


def test_steering_file_exit_code(tmp_path: Path) -> None:
    file = write(tmp_path, "import sys\nsys.exit(3)\n")
    with pytest.raises(SteeringError, match=r"exit\(3\)"):
        run_steering(file)


def test_steering_overrides_context_for_inline_use() -> None:
    from evflow.io.generators import ToyGenerator

    with steering_overrides(max_events=2, quiet=True) as ctx:
        evflow.process(evflow.Path([ToyGenerator(n_events=9)]))
    assert [s.events_read for s in ctx.summaries] == [2]


def test_an_interrupt_that_an_import_turned_into_import_error_stays_an_interrupt(
    tmp_path: Path,
) -> None:
    # what a C extension does with Ctrl-C during its module init: ImportError from it
    body = """
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        raise ImportError("initialization failed") from exc
    """
    with pytest.raises(KeyboardInterrupt):
        run_steering(write(tmp_path, body))
    with pytest.raises(SteeringError, match="ImportError: no such module"):
        run_steering(write(tmp_path, "raise ImportError('no such module')\n", "other.py"))
