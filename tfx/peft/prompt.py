"""Prompt tuning (Lester et al. 2021; peft's PROMPT_TUNING): G learned vectors in front of the
input embeddings, every model weight frozen.

    model = SoftPrompt(num_tokens=20, init="vocab").attach(model, rngs=nnx.Rngs(0))

`attach` extends the model's (encoder's) token embeddings with `Prompted` in place (its
class swapped; weights keep their paths), whose leading vectors are the prompt: how models run
leading vectors (positions, masks, the KV cache, encoder–decoders) is `tfx.models.leading`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.models.decoder import Decoder
from tfx.models.encoder import Encoder
from tfx.models.encoder_decoder import EncoderDecoder
from tfx.models.stack import Embeddings
from tfx.peft.core import PeftParam, extend, retract
from tfx.peft.settings import PROMPT_INITS, SoftPromptSettings

__all__ = ["INITS", "Prompt", "Prompted", "SoftPrompt", "detach"]

# "random": normal(init_std); "vocab": the embeddings of G token ids drawn uniformly from the
# vocabulary; "text": the embeddings of `text_ids` repeated / cut to G tokens.
INITS = PROMPT_INITS


class Prompt(nnx.Module):
    """A model's soft prompt: `vectors`, a PeftParam [G, d_model]."""

    def __init__(self, vectors: jax.Array):
        self.vectors = PeftParam(vectors)

    @property
    def num_tokens(self) -> int:
        return self.vectors.shape[0]

    def __call__(self, batch: int) -> jax.Array:
        """The vectors for every sequence: [batch, G, d_model]."""
        return jnp.broadcast_to(self.vectors[...], (batch, *self.vectors.shape))


class Prompted(Embeddings):
    """An extension (`tfx.peft.core.extend`): token embeddings whose leading vectors are a soft
    prompt, attribute `prompt`."""

    @property
    def num_leading(self) -> int:
        return self.prompt.num_tokens

    def leading(self, batch: int) -> jax.Array:
        return self.prompt(batch)


def embeddings_of(model: Decoder | Encoder | EncoderDecoder) -> Embeddings:
    """The embeddings a model's soft prompt goes into (an encoder–decoder's encoder side)."""
    return model.encoder_embeddings if isinstance(model, EncoderDecoder) else model.embeddings


def detach(model: Decoder | Encoder | EncoderDecoder) -> Decoder | Encoder | EncoderDecoder:
    """Remove the soft prompt from `model` (in place), if it has one; returns it."""
    embeddings = embeddings_of(model)
    if isinstance(embeddings, Prompted):
        del embeddings.prompt
        retract(embeddings, Prompted)
    return model


class SoftPrompt(SoftPromptSettings):
    """Prompt tuning: its settings (`tfx.peft.settings.SoftPromptSettings`) and how it
    attaches."""

    def attach(self, model: Decoder | Encoder | EncoderDecoder, *,
               rngs: nnx.Rngs) -> Decoder | Encoder | EncoderDecoder:
        """Give `model` (in place) a soft prompt of `num_tokens` PeftParam vectors; returns it.

        The model then runs [prompt; tokens] and drops the prompt positions from its output
        (an encoder–decoder keeps them in the encoder output for the decoder to attend to).
        """
        if not isinstance(model, Decoder | Encoder | EncoderDecoder):
            raise TypeError(f"model must be a tfx Decoder, Encoder or EncoderDecoder, got "
                            f"{type(model).__name__}")
        embeddings = embeddings_of(model)
        if isinstance(embeddings, Prompted):
            raise ValueError("model already has a soft prompt")
        config, g = model.config, self.num_tokens
        if config.position == "learned" and g >= config.max_len:
            raise ValueError(f"num_tokens ({g}) leaves no room for tokens in the learned "
                             f"position table (max_len = {config.max_len})")
        table = embeddings.tokens.table[...]  # [vocab_size, d_model]
        vocab_size = table.shape[0]
        if self.init == "random":
            vectors = self.init_std * jax.random.normal(rngs.params(), (g, table.shape[1]),
                                                        table.dtype)
        else:
            if self.init == "vocab":
                ids = jax.random.randint(rngs.params(), (g,), 0, vocab_size)
            else:
                if max(self.text_ids) >= vocab_size:
                    raise ValueError(f"text_ids must be < vocab_size ({vocab_size}), got "
                                     f"{max(self.text_ids)}")
                ids = jnp.asarray(np.resize(np.asarray(self.text_ids), g))  # repeat, then cut
            vectors = jnp.take(table, ids, axis=0)
        extend(embeddings, Prompted).prompt = Prompt(vectors)
        return model
