"""`tfx serve` of what `tfx train` makes: a LoRA run on a Hugging Face folder served as an
adapter beside its base, and a run served as the model itself, each answering with the tokens
of the run's own model."""

import pytest
from serve_cases import greedy

from tfx.train.finetuning import LoraTuning
from tfx.train.loop import train
from tfx.train.pretrained import from_pretrained
from tfx.train.run import load_run

openai = pytest.importorskip("openai")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny):
    """Four LoRA steps on the tiny folder's model with a high learning rate, so that the
    factors move well away from b = 0."""
    from train_cases import write_corpus

    root = tmp_path_factory.mktemp("runs")
    experiment = from_pretrained(
        tiny.folder, "gpt_char", data=str(write_corpus(root)),
        train=dict(steps=4, batch_size=4, seq_len=32, log_every=2, eval_every=4,
                   eval_batches=1, checkpoint_every=4),
        optim={"learning_rate": 1e-2, "warmup_steps": 1},
        peft=LoraTuning(rank=4, targets=("query", "value", "down")))
    train(experiment, root / "lora", progress=False)
    return root / "lora"


def _answer(served, model_id):
    from tfx.serve import serving

    with serving(served, num_pages=32, page_size=8, max_batch=2) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        return client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8,
                                         temperature=0.0).choices[0].text


def _expected(served, model):
    prompt = [int(i) for i in served.tokenizer.encode(PROMPT)]
    return served.tokenizer.decode(greedy(model, prompt, 8, eos=list(served.eos)))


def test_a_lora_run_is_served_as_an_adapter_of_its_base(tiny, lora_run):
    from tfx.serve import load_served

    served = load_served(tiny.folder, {"tuned": str(lora_run)}, name="tiny")
    tuned = load_run(lora_run).model
    assert _answer(served, "tuned") == _expected(served, tuned)
    assert _expected(served, tuned) != _answer(served, "tiny")  # the run's factors matter


def test_a_run_is_served_as_the_model(lora_run):
    from tfx.serve import load_served

    served = load_served(lora_run)
    assert served.name == "lora"
    assert _answer(served, "lora") == _expected(served, load_run(lora_run).model)
