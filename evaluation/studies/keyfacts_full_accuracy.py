"""Accuracy of the UNCOMPRESSED embedded model on the key-value set (evaluation/datasets/keyfacts.py), question
inside the context: the development check that the set is answerable (issue 15 asks for >= 0.7) before any
compressed run is read against it.

Runs kvpress's pipeline steps without a press (prefill of the query-aware context, then greedy decoding of the
answer prefix from position T) and prints one line per example (id, T, passages, answer passage, score,
prediction, reference, seconds) and the accuracy.

Usage (the development seed is 1000; the benchmarks use seed 0; ``python -m evaluation.studies.keyfacts_full_accuracy``
is the same)::

    python scripts/keyfacts_full_accuracy.py 4096 6 1000 96 none
    #                                        length n seed passage_tokens distractor_facts
"""

from __future__ import annotations

import sys
import time

import torch


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5:
        from evaluation.cli import refuse

        refuse(
            f"python -m evaluation.studies.keyfacts_full_accuracy takes 5 arguments (length n seed passage_tokens "
            f"distractor_facts), got {len(argv)}: {' '.join(argv)}"
        )
    length, n, seed, passage_tokens, mode = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)
    from kvpress import KVPressTextGenerationPipeline
    from transformers import DynamicCache

    from evaluation.datasets.keyfacts import KeyFactsDataset
    from evaluation.models import load_model

    model, tok = load_model("smollm2-135m")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    ds = KeyFactsDataset(context_lengths=[length], passage_tokens=passage_tokens, distractor_facts=mode)
    examples = ds.examples(tok, n, seed, query_aware=True)
    total = 0.0
    for ex in examples:
        t0 = time.perf_counter()
        inputs = pipe.preprocess(ex.context, [ex.question], ex.answer_prefix, int(1e10))
        ids, q = inputs["context_ids"], inputs["questions_ids"][0]
        cache = DynamicCache()
        with torch.inference_mode():
            model.model(input_ids=ids, past_key_values=cache)
            answer = pipe.generate_answer(q, cache, ids.shape[1], 12)
        score = ds.score(answer, ex)
        total += score
        print(
            ex.id,
            ids.shape[1],
            ex.metadata["n_passages"],
            ex.metadata["answer_passage"],
            score,
            repr(answer[:40]),
            ex.answers[0],
            f"{time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    print("ACC", length, total / len(examples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
