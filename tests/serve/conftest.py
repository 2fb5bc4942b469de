"""A tiny Hugging Face chat model (experiments/tiny_chat_model.py's) and two LoRA adapters for
it written as peft folders by `tfx.hf.save_peft_adapter` (what `tfx export` writes), and the
references the server's answers are checked against: `tfx.generate` on each request alone."""

import dataclasses

import jax
import pytest

import tfx

ADAPTERS = {"terse": (("query", "value"), 4, 1), "chatty": (("key", "down"), 2, 2)}


@dataclasses.dataclass(frozen=True)
class TinyServing:
    folder: object
    adapters: dict  # name -> peft adapter folder


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyServing:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    from hf_folders import chat_model_folder

    root = tmp_path_factory.mktemp("serve")
    folder = chat_model_folder(torch, transformers, root / "tiny")
    adapters = {name: _adapter(folder, root / name, targets, rank, seed)
                for name, (targets, rank, seed) in ADAPTERS.items()}
    return TinyServing(folder, adapters)


def _adapter(folder, out, targets, rank, seed):
    """A LoRA adapter with random (nonzero) factors on `targets`, as a peft folder."""
    from tfx.hf.peft_adapter import save_peft_adapter
    from tfx.peft import lora

    model = tfx.hf.load(folder)
    weights = lora.init(jax.random.key(seed), _params(model), rank=rank, alpha=2.0 * rank,
                        targets=targets)
    factors = {path: lora.Factors(f.a, 0.5 * jax.random.normal(jax.random.key(seed + 9),
                                                                f.b.shape, f.b.dtype))
               for path, f in weights.factors.items()}
    lora.attach(model, lora.LoRAWeights(factors, weights.scale))
    save_peft_adapter(model, out, architecture="LlamaForCausalLM")
    return out


def _params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)
