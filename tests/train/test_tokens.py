"""tfx.train.tokens: the catalog's byte-level experiments name exactly the ids of its special
tokens, and tfx.train.data still exports the tokenizers and streams. (The tokenizers and streams
themselves are tested in test_data.py.)"""

from __future__ import annotations

import pytest

from tfx.train import data, tokens
from tfx.train.experiments import get_experiment
from tfx.train.objectives import get_objective


@pytest.mark.parametrize(("name", "specials"), [("bert_mlm", tokens.MLM_SPECIALS),
                                                ("seq2seq_reverse", tokens.SEQ2SEQ_SPECIALS)])
def test_the_catalog_fits_the_byte_specials(name, specials):
    experiment = get_experiment(name)
    tokenizer = get_objective(experiment.objective).tokenizer(experiment)  # checks the ids
    assert tokenizer == tokens.ByteTokenizer(specials)
    assert experiment.model.vocab_size == tokenizer.vocab_size == 256 + len(specials)


def test_data_reexports_the_token_names():
    for name in ("ByteTokenizer", "HFTokenizer", "Text", "TokenStream", "Tokenizer"):
        assert getattr(data, name) is getattr(tokens, name)
