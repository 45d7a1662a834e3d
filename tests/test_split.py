"""Splitting a path into the input, worker and output parts."""

from __future__ import annotations

import pytest

from evflow import Module, Path
from evflow.errors import ConfigurationError
from evflow.io import BusyWork, RecordOutput, ToyGenerator
from evflow.processing.parallel import split_path
from evflow.processing.parallel.split import describe


class Serial(Module):
    pass


class Par(Module):
    parallel = True


def test_split_puts_modules_before_first_parallel_into_input_path(tmp_path):
    src, pre = ToyGenerator(), Serial("pre")
    w1, w2 = Par("w1"), BusyWork()
    post, out = Serial("post"), RecordOutput(file=str(tmp_path / "o.evr"))
    split = split_path(Path([src, pre, w1, w2, post, out]))
    assert split is not None
    assert split.input == (src, pre)
    assert split.worker == (w1, w2)
    assert split.output == (post, out)
    assert describe(split) == (
        "input: ToyGenerator, pre | worker: w1, BusyWork | output: post, RecordOutput"
    )


def test_split_allows_empty_output_path():
    split = split_path(Path([ToyGenerator(), Par("w")]))
    assert split is not None and split.output == ()


def test_path_without_parallel_module_is_not_split():
    assert split_path(Path([ToyGenerator(), Serial("a"), Serial("b")])) is None


def test_parallel_module_after_the_output_part_is_refused_naming_it():
    path = Path([ToyGenerator(), Par("w1"), Serial("histo"), Par("late")])
    with pytest.raises(ConfigurationError, match=r"'late'.*after the non-parallel module 'histo'"):
        split_path(path)


def test_parallel_path_without_source_is_refused():
    with pytest.raises(ConfigurationError, match="needs a source"):
        split_path(Path([Serial("a"), Par("w")]))


def test_parallel_source_is_refused():
    class ParSource(ToyGenerator):
        parallel = True

    with pytest.raises(ConfigurationError, match="runs in the input process only"):
        split_path(Path([ParSource(), Par("w")]))
