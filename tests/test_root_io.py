"""ROOT input and output through uproot: real HZZ data, round trips, bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import skhep_testdata
import uproot

from evflow.errors import ClosedError, InputError, OutputError
from evflow.event import FLAG_QUARANTINED, DataStore, EventMeta
from evflow.io.root import META_BRANCHES, RootInput, RootOutput
from evflow.wire.codec import encode_event

HZZ = skhep_testdata.data_path("uproot-HZZ.root")


@pytest.fixture(scope="module")
def hzz_np() -> dict[str, np.ndarray]:
    with uproot.open(HZZ) as f:
        return f["events"].arrays(library="np")  # type: ignore[no-any-return]


def test_hzz_reads_one_event_per_entry_with_jagged_arrays(hzz_np: dict[str, np.ndarray]) -> None:
    source = RootInput(file=HZZ, tree="events", step_size=700, experiment=3, run=9)
    assert source.total() == 2421
    events = list(source.events())
    assert len(events) == 2421
    for k in (0, 1, 699, 700, 1500, 2420):  # across chunk borders
        store = events[k]
        assert store.meta == EventMeta(uid=k, experiment=3, run=9, event=k)
        assert isinstance(store["Muon_Px"], np.ndarray)
        assert store["Muon_Px"].dtype == np.float32
        assert np.array_equal(store["Muon_Px"], hzz_np["Muon_Px"][k])
        assert store["NMuon"] == hzz_np["NMuon"][k] == len(store["Muon_Px"])
        assert store["MET_px"] == hzz_np["MET_px"][k]
        assert set(store) == set(hzz_np)


def test_events_from_a_start_entry_are_the_tail() -> None:
    source = RootInput(file=HZZ, branches=["NMuon", "Muon_E"], step_size=500)
    full = list(source.events())
    tail = list(source.events(start=1234))
    assert [s.meta.uid for s in tail] == list(range(1234, 2421))
    for a, b in zip(full[1234:], tail, strict=True):
        assert sorted(b) == ["Muon_E", "NMuon"]
        assert np.array_equal(a["Muon_E"], b["Muon_E"]) and a["NMuon"] == b["NMuon"]
    assert list(source.events(start=5000)) == []


def _toy_stores(n: int) -> list[DataStore]:
    rng = np.random.default_rng(4)
    stores = []
    for k in range(n):
        stores.append(
            DataStore(
                EventMeta(uid=500 + k, experiment=1, run=2, event=k),
                {
                    "n": np.int32(k),
                    "x": float(rng.normal()),
                    "ok": bool(k % 2),
                    "pt": rng.normal(size=k % 4).astype(np.float32),  # includes empty
                    "ids": np.arange(k % 3, dtype=np.int64),
                    "label": f"not a branch {k}",
                },
            )
        )
    return stores


def test_root_output_round_trip_flat_and_jagged(tmp_path: Path) -> None:
    stores = _toy_stores(11)
    path = tmp_path / "out.root"
    out = RootOutput(file=str(path), tree="t", chunk_events=3)
    out.initialize()
    for s in stores:
        out.event(s)
    out.terminate()
    with uproot.open(path) as f:
        tree = f["t"]
        assert isinstance(tree, uproot.TTree)  # not an RNTuple
        assert tree.num_entries == 11
        branch_names = tree.keys()
        assert "label" not in branch_names
        got = tree.arrays(library="np")
    assert got["n"].dtype == np.int32 and got["pt"][0].dtype == np.float32
    assert got["ok"].dtype == np.bool_
    for k, s in enumerate(stores):
        assert got["n"][k] == s["n"] and got["x"][k] == s["x"] and got["ok"][k] == s["ok"]
        assert np.array_equal(got["pt"][k], s["pt"]) and np.array_equal(got["ids"][k], s["ids"])
        assert got["npt"][k] == len(s["pt"])
        assert got["evflow_uid"][k] == s.meta.uid and got["evflow_run"][k] == 2
    # and evflow reads its own output back
    back = list(RootInput(file=str(path), tree="t").events())
    assert [float(b["x"]) for b in back] == [s["x"] for s in stores]
    assert all(np.array_equal(b["pt"], s["pt"]) for b, s in zip(back, stores, strict=True))


def test_hzz_through_root_output_matches_uproot(
    tmp_path: Path, hzz_np: dict[str, np.ndarray]
) -> None:
    selected = [s for s in RootInput(file=HZZ).events() if s["NMuon"] >= 2]
    path = tmp_path / "sel.root"
    out = RootOutput(file=str(path), chunk_events=1000)
    for s in selected:
        out.event(s)
    out.close()
    with uproot.open(path) as f:
        got = f["events"].arrays(library="np")
    entries = got["evflow_uid"]
    assert list(entries) == [s.meta.uid for s in selected]
    assert np.array_equal(got["NMuon"], hzz_np["NMuon"][entries])
    for i, entry in enumerate(entries[:50]):
        for branch in ("Muon_Px", "Muon_E", "Jet_Px", "Electron_Py"):
            assert np.array_equal(got[branch][i], hzz_np[branch][entry]), branch


def test_flush_makes_buffered_events_readable_before_close(tmp_path: Path) -> None:
    path = tmp_path / "live.root"
    out = RootOutput(file=str(path), branches=["x", "pt"], chunk_events=1000)
    stores = _toy_stores(5)
    for s in stores:
        out.event(s)
    assert out.written_uids() == set()
    out.flush()
    assert out.written_uids() == {s.meta.uid for s in stores}
    with uproot.open(path) as f:
        assert f["events"].num_entries == 5
        assert sorted(f["events"].keys()) == sorted(["x", "pt", "npt", *META_BRANCHES])
    out.close()
    out.close()
    with pytest.raises(ClosedError):
        out.event(stores[0])


def test_write_raw_decodes_frames_and_keeps_the_quarantine_flag(tmp_path: Path) -> None:
    store = _toy_stores(3)[2]
    out = RootOutput(file=str(tmp_path / "q.root"))
    meta = EventMeta(uid=store.meta.uid, flags=FLAG_QUARANTINED)
    out.write_raw(meta, encode_event(store))
    out.close()
    with uproot.open(tmp_path / "q.root") as f:
        got = f["events"].arrays(library="np")
    assert got["evflow_flags"][0] == FLAG_QUARANTINED and np.array_equal(got["pt"][0], store["pt"])


# --- bad input -------------------------------------------------------------------------
def test_missing_root_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"ROOT input file '.*nope\.root' does not exist"):
        RootInput(file=str(tmp_path / "nope.root"))


@pytest.mark.parametrize("content", [b"hello, I am a text file\n" * 200, b"x"])
def test_a_file_that_is_not_root_is_an_input_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fake.root"
    path.write_bytes(content)
    with pytest.raises(InputError, match=r"'.*fake\.root' is not a readable ROOT file"):
        RootInput(file=str(path))


def test_a_truncated_root_file_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.root"
    path.write_bytes(Path(HZZ).read_bytes()[:5000])
    with pytest.raises(InputError, match=r"cut\.root"):
        source = RootInput(file=str(path))
        list(source.events())


def test_missing_tree_names_the_tree_and_what_exists(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"has no tree 'Events' \(trees in it: events\)"):
        RootInput(file=HZZ, tree="Events")
    path = tmp_path / "hist.root"
    with uproot.recreate(path) as f:
        f["h"] = np.histogram(np.arange(10.0), bins=5)
    with pytest.raises(InputError, match=r"'h' is a .*, not a TTree"):
        RootInput(file=str(path), tree="h")


def test_missing_branch_names_the_branch(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"tree 'events' in '.*HZZ.root' has no branch 'Muon_Pt'"):
        RootInput(file=HZZ, branches=["Muon_Px", "Muon_Pt"])


def test_unwritable_root_output_is_an_output_error(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="no directory"):
        RootOutput(file=str(tmp_path / "no" / "out.root"))
    (tmp_path / "adir").mkdir()
    out = RootOutput(file=str(tmp_path / "adir"))
    with pytest.raises(OutputError, match=r"cannot open ROOT output .*adir"):
        out.initialize()


def test_bad_objects_for_a_ttree_are_output_errors(tmp_path: Path) -> None:
    stores = _toy_stores(3)
    out = RootOutput(file=str(tmp_path / "a.root"), branches=["label"])
    with pytest.raises(OutputError, match=r"object 'label' \(str\) cannot be a TTree branch"):
        out.event(stores[0])
    out.close()
    out2 = RootOutput(file=str(tmp_path / "b.root"))
    out2.event(stores[0])
    del stores[1]["pt"]
    with pytest.raises(OutputError, match=r"event uid=501 has no object 'pt'"):
        out2.event(stores[1])
    out2.close()


def test_a_bare_test_file_name_is_found_in_scikit_hep_testdata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's steering example names `uproot-HZZ.root` without a path: it reads the
    copy that scikit-hep-testdata ships, from any directory; a name that is neither here
    nor shipped is still refused as missing."""
    monkeypatch.chdir(tmp_path)
    source = RootInput(file="uproot-HZZ.root", branches=["NMuon"])
    assert sum(1 for _ in source.events()) == 2421
    with pytest.raises(InputError, match=r"'nope\.root' does not exist"):
        RootInput(file="nope.root")
