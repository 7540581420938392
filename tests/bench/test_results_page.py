"""bench/results_page.py: docs/results.md and the README's results table are what the committed records render to
(a record or the page edited by hand without the other fails here), and every table names its card and record."""

from __future__ import annotations

from bench import results_page as rp


def test_results_page_matches_the_records():
    assert rp.PAGE.read_text() == rp.render(), "docs/results.md is stale: run python -m bench.results_page"


def test_readme_results_match_the_records():
    text = rp.README.read_text()
    assert rp.BEGIN in text and rp.END in text
    assert text == rp.render_readme(text), "README.md's results are stale: run python -m bench.results_page"


def test_every_table_names_its_card_commit_and_record():
    page = rp.render()
    for s in rp.SOURCES:
        assert (rp.RESULTS / s.record).is_file(), s.record
        assert f"commit: {s.commit} · record: [`{s.record}`](../bench/results/{s.record})" in page
    rows = [r for r in rp.headline_rows()[2:]]
    assert rows and all("NVIDIA" in r.split("|")[2] and "bench/results/" in r for r in rows)


def test_check_flags_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "results.md"
    stale.write_text(rp.render().replace("| dense |", "| dense (edited) |", 1))
    assert rp.main(["--out", str(stale), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
