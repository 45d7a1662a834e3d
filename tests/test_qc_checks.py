"""Quality, the built-in checks, the suite (raising checks, completeness, aggregators), config."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import hist
import numpy as np
import pytest
import uproot

from _qc_repo_helpers import gauss_hist, published
from evflow.errors import ConfigurationError
from evflow.qc.checks import (
    Check,
    Chi2Reference,
    EmptyBinFraction,
    EntriesIncreasing,
    FunctionCheck,
    KolmogorovReference,
    MeanInRange,
    RangeInBounds,
)
from evflow.qc.checksuite import Aggregator, CheckSuite, completeness_fraction
from evflow.qc.quality import Flag, Quality, QualityObject, aggregate, worst
from evflow.qc.stats import chi2_sf, chi2_test, kolmogorov_prob, ks_test

PATH = "qc/hzz/pt"


# --- Quality ---------------------------------------------------------------------------
def test_quality_is_ordered_good_to_null_and_worst_of_takes_the_last() -> None:
    assert Quality.GOOD < Quality.MEDIUM < Quality.BAD < Quality.NULL
    assert worst([Quality.GOOD, Quality.BAD, Quality.MEDIUM]) is Quality.BAD
    assert worst([Quality.GOOD, Quality.NULL]) is Quality.NULL
    assert worst([]) is Quality.NULL
    assert Quality.parse("medium") is Quality.MEDIUM and str(Quality.BAD) == "Bad"
    with pytest.raises(ValueError, match="Good, Medium, Bad, Null"):
        Quality.parse("fine")


def test_aggregate_is_worst_of_with_the_union_of_flags() -> None:
    a = QualityObject(Quality.MEDIUM, "a", ("qc/t/x",), (Flag("f1", "r1"), Flag("f2")))
    b = QualityObject(Quality.BAD, "b", ("qc/t/y",), (Flag("f2"), Flag("f3", "r3")))
    c = QualityObject(Quality.GOOD, "c", ("qc/t/x",))
    out = aggregate("all", [a, b, c])
    assert out.quality is Quality.BAD and out.check == "all"
    assert out.flags == (Flag("f1", "r1"), Flag("f2"), Flag("f3", "r3"))
    assert out.paths == ("qc/t/x", "qc/t/y")
    assert QualityObject.from_dict(out.to_dict()) == out
    assert aggregate("none", []).quality is Quality.NULL


# --- statistics ----------------------------------------------------------------------
def test_pvalues_match_tabulated_values() -> None:
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(100.0, 50) == pytest.approx(3.4549e-5, rel=1e-3)
    assert chi2_sf(0.5, 3) == pytest.approx(0.918891, rel=1e-5)
    assert kolmogorov_prob(1.3581) == pytest.approx(0.05, rel=1e-3)
    assert kolmogorov_prob(1.0) == pytest.approx(0.26999967, rel=1e-6)
    assert kolmogorov_prob(0.5) == pytest.approx(0.9639452, rel=1e-6)
    assert kolmogorov_prob(0.1) == 1.0


def test_chi2_and_ks_tests_refuse_incomparable_inputs() -> None:
    with pytest.raises(ValueError, match="empty"):
        chi2_test(np.zeros(5), np.ones(5))
    with pytest.raises(ValueError, match="5 bins against 4"):
        ks_test(np.ones(5), np.ones(4))
    with pytest.raises(ValueError, match="1D"):
        ks_test(np.ones((2, 2)), np.ones((2, 2)))


# --- built-in checks -------------------------------------------------------------------
def _verdict(check: Check, obj: object, **kwargs: object) -> QualityObject:
    return check(published(PATH, obj, **kwargs))  # type: ignore[arg-type]


def test_mean_in_range_good_inside_bad_outside() -> None:
    check = MeanInRange("mean", min=4.5, max=5.5)
    good = _verdict(check, gauss_hist(10_000, loc=5.0))
    assert good.quality is Quality.GOOD and good.metadata["mean"] == pytest.approx(5.0, abs=0.1)
    bad = _verdict(check, gauss_hist(10_000, loc=6.5))
    assert bad.quality is Quality.BAD
    assert bad.flags[0].name == "mean_out_of_range" and "outside [4.5, 5.5]" in bad.flags[0].reason
    assert _verdict(check, np.array([5.0, 5.2])).quality is Quality.GOOD


def test_range_in_bounds_counts_entries_outside_including_overflow() -> None:
    h = hist.Hist.new.Reg(10, 0, 10).Double()
    h.fill([1.5, 2.5, 3.5, 4.5])
    check = RangeInBounds("range", min=1, max=5)
    assert _verdict(check, h).quality is Quality.GOOD
    h.fill([12.0])  # overflow
    bad = _verdict(check, h)
    assert bad.quality is Quality.BAD and bad.metadata["outside_fraction"] == pytest.approx(0.2)
    tolerant = RangeInBounds("range", min=1, max=5, max_outside_fraction=0.25)
    assert _verdict(tolerant, h).quality is Quality.GOOD
    assert _verdict(check, np.array([1.0, 9.0])).quality is Quality.BAD
    for under, over in [(False, True), (True, False), (False, False)]:
        axis = hist.axis.Regular(10, 0, 10, underflow=under, overflow=over)
        h2d = hist.Hist(axis, hist.axis.Regular(2, 0, 1)).fill([0.5, 4.5, 7.5], [0.5, 0.5, 0.5])
        partial = _verdict(RangeInBounds("range", min=0, max=5), h2d)
        assert partial.metadata["outside_fraction"] == pytest.approx(1 / 3), (under, over)


def test_entries_increasing_between_cycles() -> None:
    check = EntriesIncreasing("growth")
    h = gauss_hist(100)
    assert _verdict(check, h, cycle=0).quality is Quality.GOOD  # first cycle
    bigger = h.copy()
    bigger.fill([5.0] * 10)
    assert _verdict(check, bigger, cycle=1).quality is Quality.GOOD
    stalled = _verdict(check, bigger, cycle=2)
    assert stalled.quality is Quality.MEDIUM and stalled.flags[0].name == "entries_stalled"
    dropped = _verdict(check, h, cycle=3)
    assert dropped.quality is Quality.BAD
    assert "fell from 110 to 100 (cycle 2 -> 3)" in dropped.flags[0].reason
    assert _verdict(check, h, run=2, cycle=0).quality is Quality.GOOD  # a new run starts afresh


@pytest.mark.parametrize("check_cls", [Chi2Reference, KolmogorovReference])
def test_reference_same_distribution_good_shifted_bad(check_cls: type[Check]) -> None:
    reference = gauss_hist(200_000, seed=1)
    check = check_cls("ref", reference=reference)  # type: ignore[call-arg]
    same = _verdict(check, gauss_hist(5_000, seed=2))
    assert same.quality is Quality.GOOD, same
    assert same.metadata["pvalue"] > 0.05
    shifted = _verdict(check, gauss_hist(5_000, loc=5.5, seed=3))
    assert shifted.quality is Quality.BAD
    assert shifted.metadata["pvalue"] < 0.01 and "p-value" in shifted.flags[0].reason


def test_chi2_reference_uses_variances_of_weighted_histograms() -> None:
    rng = np.random.default_rng(4)
    reference = hist.Hist.new.Reg(40, 0, 10).Weight()
    reference.fill(rng.normal(5, 2, 100_000), weight=rng.uniform(0.5, 1.5, 100_000))
    obj = hist.Hist.new.Reg(40, 0, 10).Weight()
    obj.fill(rng.normal(5, 2, 5_000), weight=rng.uniform(0.5, 1.5, 5_000))
    check = Chi2Reference("chi2", reference=reference)
    assert _verdict(check, obj).quality is Quality.GOOD
    obj.fill(rng.normal(8, 0.3, 1_000))
    assert _verdict(check, obj).quality is Quality.BAD


def test_empty_bin_fraction_thresholds() -> None:
    check = EmptyBinFraction("empty", medium_above=0.1, bad_above=0.5)
    full = hist.Hist.new.Reg(10, 0, 10).Double()
    full.fill(np.arange(10) + 0.5)
    assert _verdict(check, full).quality is Quality.GOOD
    some = hist.Hist.new.Reg(10, 0, 10).Double()
    some.fill(np.arange(7) + 0.5)
    assert _verdict(check, some).quality is Quality.MEDIUM
    few = hist.Hist.new.Reg(10, 0, 10).Double()
    few.fill([0.5, 1.5])
    bad = _verdict(check, few)
    assert bad.quality is Quality.BAD and "80.0% of 10 bins empty" in bad.flags[0].reason


def test_function_check_accepts_quality_tuple_or_quality_object() -> None:
    obj = gauss_hist(10)
    assert _verdict(FunctionCheck("f", function=lambda o: Quality.MEDIUM), obj).quality is (
        Quality.MEDIUM
    )
    out = _verdict(FunctionCheck("f", function=lambda o: (Quality.BAD, ["why"])), obj)
    assert out.quality is Quality.BAD and out.flags == (Flag("why"),)


# --- the suite -----------------------------------------------------------------------
class Exploding(Check):
    kind = "exploding"

    def evaluate(self, obj: object, published: object) -> tuple:  # type: ignore[override]
        raise ZeroDivisionError("boom in the check")


def test_a_raising_check_gives_null_with_the_exception_and_the_chain_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    suite = CheckSuite(
        [Exploding("broken"), MeanInRange("mean", min=4, max=6)],
        [Aggregator("all", ("broken", "mean"))],
    )
    result = suite.run(published(PATH, gauss_hist(1000)))
    by_name = {r.check: r for r in result.checks}
    assert by_name["broken"].quality is Quality.NULL
    assert by_name["broken"].flags == (
        Flag("check_raised", "ZeroDivisionError: boom in the check"),
    )
    assert by_name["mean"].quality is Quality.GOOD  # ran after the broken one
    assert result.quality is not None and result.quality.quality is Quality.NULL
    assert result.aggregates[0].quality is Quality.NULL
    with caplog.at_level(logging.WARNING, logger="evflow.qc.checks"):
        for _ in range(3):
            again = suite.run(published(PATH, gauss_hist(1000)))
            assert again.checks[0].flags[0].name == "check_raised"
    # the flag says it every cycle, the log only once
    assert [r.getMessage() for r in caplog.records] == [
        f"check 'broken' on {PATH} raised ZeroDivisionError: boom in the check"
    ]
    # a check that returns garbage is a raising check too
    garbage = CheckSuite([FunctionCheck("g", function=lambda o: "fine")])
    out = garbage.run(published(PATH, gauss_hist(10))).checks[0]
    assert out.quality is Quality.NULL and "expected a Quality" in out.flags[0].reason


def test_completeness_below_the_threshold_forces_null_and_names_the_missing() -> None:
    suite = CheckSuite([MeanInRange("mean", min=4, max=6)], min_completeness=0.75)
    complete = suite.run(published(PATH, gauss_hist(1000), seen=4, expected=4))
    assert complete.quality is not None and complete.quality.quality is Quality.GOOD
    partial = suite.run(published(PATH, gauss_hist(1000), seen=2, expected=4))
    assert partial.quality is not None and partial.quality.quality is Quality.NULL
    assert partial.checks[0].quality is Quality.NULL
    assert partial.checks[0].metadata["quality_before_completeness"] == "Good"
    [flag] = partial.quality.flags
    assert flag.name == "incomplete" and "50%" in flag.reason and "src2, src3" in flag.reason
    # no check applies: still Null when incomplete, None (unchecked) when complete
    unchecked = CheckSuite(min_completeness=0.75)
    assert unchecked.run(published(PATH, gauss_hist(10))).quality is None
    nulled = unchecked.run(published(PATH, gauss_hist(10), seen=1, expected=4)).quality
    assert nulled is not None and nulled.quality is Quality.NULL
    assert completeness_fraction({"seen": 3, "expected": 4}) == 0.75
    assert completeness_fraction({}) is None


def test_aggregator_takes_the_latest_result_of_each_check_and_object() -> None:
    suite = CheckSuite(
        [MeanInRange("mean", ["qc/hzz/*"], min=4, max=6), EmptyBinFraction("empty", ["qc/hzz/pt"])],
        [Aggregator("hzz", ("mean", "empty"))],
    )
    suite.run(published("qc/hzz/pt", gauss_hist(10_000)))
    bad = suite.run(published("qc/hzz/eta", gauss_hist(10_000, loc=8)))
    assert [a.quality for a in bad.aggregates] == [Quality.BAD]
    assert set(bad.aggregates[0].paths) == {"qc/hzz/pt", "qc/hzz/eta"}
    fixed = suite.run(published("qc/hzz/eta", gauss_hist(10_000)))
    assert fixed.aggregates[0].quality is Quality.GOOD and fixed.aggregates[0].flags == ()
    assert suite.run(published("qc/other/x", gauss_hist(10))).aggregates == []


# --- configuration -------------------------------------------------------------------
def test_suite_from_toml_with_a_root_reference(tmp_path: Path) -> None:
    with uproot.recreate(tmp_path / "ref.root") as f:
        f["pt"] = gauss_hist(100_000, seed=5)
    config = tmp_path / "checks.toml"
    config.write_text(
        """
[qc]
min_completeness = 0.5
[qc.checks.pt_ks]
type = "ks_reference"
objects = ["qc/hzz/pt"]
reference = "ref.root:pt"
pvalue_bad = 0.001
[qc.checks.pt_mean]
type = "mean_in_range"
objects = ["qc/hzz/*"]
min = 4.0
max = 6.0
[qc.aggregators.hzz]
checks = ["pt_ks", "pt_mean"]
"""
    )
    suite = CheckSuite.from_toml(config)
    assert suite.min_completeness == 0.5 and [c.name for c in suite.checks] == ["pt_ks", "pt_mean"]
    good = suite.run(published(PATH, gauss_hist(5_000, seed=6)))
    assert [r.quality for r in good.checks] == [Quality.GOOD, Quality.GOOD]
    bad = suite.run(published(PATH, gauss_hist(5_000, loc=7, seed=7)))
    assert bad.aggregates[0].quality is Quality.BAD


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"checks": {"a": {"type": "nope"}}}, "check 'a' has type 'nope'; one of"),
        ({"checks": {"a": {"type": "mean_in_range", "min": 1}}}, "check 'a' (mean_in_range)"),
        (
            {"checks": {"a": {"type": "mean_in_range", "min": 1, "max": 2, "colour": 3}}},
            "unknown parameters ['colour']",
        ),
        ({"checks": {"a": {"type": "ks_reference", "reference": 3}}}, "reference 3 is neither"),
        ({"aggregators": {"x": {"checks": ["ghost"]}}}, "unknown checks ['ghost']"),
        ({"chekcs": {}}, "unknown keys ['chekcs']"),
        ({"checks": {"f": {"type": "function", "function": "math:nothing"}}}, "cannot import"),
    ],
)
def test_bad_check_config_is_one_clear_error(config: dict, message: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        CheckSuite.from_config(config, source="checks.toml")
    assert message in str(err.value) and str(err.value).startswith("checks.toml")


def test_broken_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[checks.a\ntype=")
    with pytest.raises(ConfigurationError, match=r"bad.toml is not valid TOML"):
        CheckSuite.from_toml(bad)
    with pytest.raises(ConfigurationError, match="cannot read check config"):
        CheckSuite.from_toml(tmp_path / "missing.toml")


def test_function_check_from_config_imports_module_attribute() -> None:
    suite = CheckSuite.from_config(
        {"checks": {"f": {"type": "function", "function": "math:isfinite", "objects": [PATH]}}}
    )
    # math.isfinite returns a bool, not a Quality: the suite flags it as Null, not a crash
    out = suite.run(published(PATH, 1.0)).checks[0]
    assert out.quality is Quality.NULL and math.isfinite(1.0)


def test_references_from_a_repository_file_or_the_given_repository(tmp_path: Path) -> None:
    from evflow.qc.repository import Repository

    with Repository(tmp_path / "ref.sqlite") as ref_repo:
        ref_repo.store(published(PATH, gauss_hist(50_000, seed=8), run=7))
        ref_repo.store(published(PATH, gauss_hist(50_000, loc=8, seed=9), run=8))
    config = {"checks": {"c": {"type": "chi2_reference", "objects": [PATH]}}}
    config["checks"]["c"]["reference"] = {"repository": "ref.sqlite", "path": PATH, "run": 7}
    suite = CheckSuite.from_config(config, base_dir=tmp_path)
    assert suite.run(published(PATH, gauss_hist(5_000, seed=10))).checks[0].quality is Quality.GOOD
    with Repository(tmp_path / "ref.sqlite", readonly=True) as repo:
        config["checks"]["c"]["reference"] = PATH  # the newest: run 8, shifted
        shifted = CheckSuite.from_config(config, repository=repo)
        verdict = shifted.run(published(PATH, gauss_hist(5_000, seed=10))).checks[0]
        assert verdict.quality is Quality.BAD
        config["checks"]["c"]["reference"] = {"path": PATH, "run": 99}
        with pytest.raises(ConfigurationError, match=r"no reference .*'run': 99"):
            CheckSuite.from_config(config, repository=repo)
    config["checks"]["c"]["reference"] = PATH
    with pytest.raises(ConfigurationError, match="needs a repository"):
        CheckSuite.from_config(config)
    config["checks"]["c"]["reference"] = "missing.root:pt"
    with pytest.raises(ConfigurationError, match=r"cannot read reference 'pt' from .*missing.root"):
        CheckSuite.from_config(config, base_dir=tmp_path)
