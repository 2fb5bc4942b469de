"""The tiny Hugging Face chat folders of the fine-tuning, evaluation and export tests: those of
experiments/tiny_chat_model.py (the guide's first step), so that the tests and the guide fine-tune
the same kind of folder."""

from tiny_chat_model import (
    CHATML,
    LLAMA3,
    MODEL_FIELDS,
    chat_model_folder,
    chat_tokenizer,
    tokenizer_file,
)

__all__ = ["CHATML", "LLAMA3", "MODEL_FIELDS", "chat_model_folder", "chat_tokenizer",
           "tokenizer_file"]
