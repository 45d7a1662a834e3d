"""Module, Param, Source and Path: declared parameters are checked with clear errors."""

from __future__ import annotations

import pytest

from evflow import DataStore, EventMeta, Module, Param, Path, RunMeta, Source
from evflow.errors import ConfigurationError, ParameterError


class Cut(Module):
    pt_min = Param(float, 5.0, "minimum pT, GeV")
    n_max = Param(int, 10, "at most this many")
    mode = Param(str, "loose", "working point", choices=("loose", "tight"))


class TightCut(Cut):
    parallel = True
    label = Param(str, doc="a required label")


def test_defaults_and_values_are_attributes() -> None:
    cut = Cut(pt_min=7.5)
    assert (cut.pt_min, cut.n_max, cut.mode) == (7.5, 10, "loose")
    assert cut.params == {"pt_min": 7.5, "n_max": 10, "mode": "loose"}
    assert cut.name == "Cut"
    assert Cut(name="cut2").name == "cut2"


def test_int_is_accepted_for_float_but_bool_is_not_a_number() -> None:
    assert Cut(pt_min=3).pt_min == 3.0 and isinstance(Cut(pt_min=3).pt_min, float)
    with pytest.raises(ParameterError, match="'n_max' expects int, got bool True"):
        Cut(n_max=True)
    with pytest.raises(ParameterError, match="'pt_min' expects float, got bool"):
        Cut(pt_min=False)


def test_unknown_parameter_names_module_and_known_ones() -> None:
    with pytest.raises(ParameterError) as info:
        Cut(ptmin=3.0)
    assert str(info.value) == ("module 'Cut' has no parameter 'ptmin' (known: mode, n_max, pt_min)")


def test_wrong_type_names_module_parameter_and_value() -> None:
    with pytest.raises(ParameterError) as info:
        Cut(name="mycut", n_max="5")
    assert str(info.value) == "module 'mycut': parameter 'n_max' expects int, got str '5'"


def test_choices_are_enforced() -> None:
    with pytest.raises(ParameterError, match=r"'mode' must be one of \['loose', 'tight'\]"):
        Cut(mode="medium")


def test_parameters_are_inherited_and_required_ones_enforced() -> None:
    assert set(TightCut.declared_params()) == {"pt_min", "n_max", "mode", "label"}
    with pytest.raises(ParameterError, match="'label' \\(str\\) is required"):
        TightCut()
    assert TightCut(label="x").parallel and not Cut.parallel


def test_setting_a_parameter_later_is_checked_too() -> None:
    cut = Cut()
    cut.n_max = 4
    assert cut.n_max == 4
    with pytest.raises(ParameterError):
        cut.n_max = "four"  # type: ignore[assignment]


def test_hooks_have_harmless_defaults() -> None:
    m = Module()
    store = DataStore(EventMeta(uid=1))
    m.initialize()
    m.begin_run(RunMeta())
    assert m.event(store) is None
    m.end_run(RunMeta())
    m.terminate()
    assert repr(Cut(n_max=2)) == "Cut(pt_min=5.0, n_max=2, mode='loose')"


def test_source_without_events_says_so() -> None:
    with pytest.raises(NotImplementedError, match="source 'Source' does not implement events"):
        next(iter(Source().events()))
    assert Source().total() is None


def test_path_add_returns_module_and_prints() -> None:
    path = Path()
    cut = path.add(Cut())
    path.add(TightCut(label="t"))
    assert cut.name == "Cut" and len(path) == 2
    assert [m.name for m in path] == ["Cut", "TightCut"]
    text = str(path)
    assert "Path with 2 module(s)" in text and "[parallel]" in text
    assert repr(path) == "Path([Cut, TightCut])"
    assert path.source is None


def test_path_refuses_non_modules_duplicates_and_late_sources() -> None:
    path = Path([Cut()])
    with pytest.raises(ConfigurationError, match="takes a Module instance, got type"):
        path.add(Cut)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="already has a module named 'Cut'"):
        path.add(Cut())
    with pytest.raises(ConfigurationError, match="must be the first module"):
        path.add(Source())
    first = Source()
    assert Path([first, Cut()]).source is first


def test_datastore_missing_key_lists_what_is_there() -> None:
    store = DataStore(EventMeta(uid=7), {"a": 1, "b": 2})
    with pytest.raises(KeyError, match=r"uid=7 has no object 'c' \(it has: a, b\)"):
        store["c"]
    with pytest.raises(TypeError):
        store[1] = 2  # type: ignore[index]
