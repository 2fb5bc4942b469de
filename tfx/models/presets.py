"""Named model configurations, and `create` to build a model from a name or a config.

Every name is a named size of a family card (`tfx.models.families.SIZES`). `PRESETS` holds the
small ones that tests build whole ("char-gpt", "llama-tiny", "bert-base", "t5-small", ...); the
others ("qwen3-0.6b", "olmo2-1b", "gemma2-2b", ...) are full-size models that tests build
shrunk. The presets import without jax (the command line lists them before it imports it);
`create` imports the model modules when it is called."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tfx.models import families
from tfx.models.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig

if TYPE_CHECKING:
    from flax import nnx
    from jax.sharding import Mesh

    from tfx.models.decoder import Decoder
    from tfx.models.encoder import Encoder
    from tfx.models.encoder_decoder import EncoderDecoder

__all__ = ["PRESETS", "build", "create", "named_config", "names"]

PRESETS = {name: families.size_config(name) for name in (
    "bert-base", "minilm-l6",  # encoders (BERT)
    "gpt2-small", "llama-tiny", "char-gpt", "char-moe",  # decoders (GPT-2, LLaMA, Mixtral)
    "t5-small", "transformer-base")}  # encoder-decoders (T5, Vaswani et al.)


def names() -> list[str]:
    """Every name `create` takes: the presets, then the family cards' other named sizes."""
    return [*PRESETS, *(name for name in families.SIZES if name not in PRESETS)]


def named_config(name: str) -> DecoderConfig | EncoderConfig | EncoderDecoderConfig:
    """The config of a preset or of a family card's named size."""
    if name in families.SIZES:
        return families.size_config(name)
    raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}; family sizes: "
                     f"{sorted(set(families.SIZES) - set(PRESETS))}")


def create(config: str | DecoderConfig | EncoderConfig | EncoderDecoderConfig, *,
           rngs: nnx.Rngs | None = None, mesh: Mesh | None = None,
           **overrides) -> Decoder | Encoder | EncoderDecoder:
    """Build a model from a preset name (or a family card's named size, "qwen3-0.6b") or a
    config, with optional field overrides
    (`TransformerConfig.replace`): top-level fields by name, sub-config fields by a dict of
    changes (or a whole sub-config, or None to remove an optional one).

    >>> model = create("char-gpt", num_layers=2, rngs=nnx.Rngs(0))
    >>> moe = create("char-gpt", moe={"num_experts": 4}, norm={"eps": 1e-5})
    >>> sharded = create("llama-tiny", mesh=tfx.parallel.make_mesh(fsdp=2, tensor=4))

    `mesh`: a jax Mesh (`tfx.parallel.make_mesh`) to make the parameters on, each split by its
    logical axes (`tfx.parallel.init_sharded`: no device ever holds a whole parameter that the
    mesh splits); None: the mesh of an enclosing `jax.set_mesh`, else the default device.
    """
    from flax import nnx

    from tfx.parallel import init_sharded

    if isinstance(config, str):
        config = named_config(config)
    _model_class(config)  # a TypeError now, before any tracing
    if overrides:
        config = config.replace(**overrides)
    return init_sharded(functools.partial(build, config), rngs or nnx.Rngs(0), mesh=mesh)


def build(config: DecoderConfig | EncoderConfig | EncoderDecoderConfig,
          rngs: nnx.Rngs) -> Decoder | Encoder | EncoderDecoder:
    """The model of `config`, its parameters made op by op on the default device (what
    `create` runs, sharded under a mesh)."""
    return _model_class(config)(config, rngs=rngs)


def _model_class(config) -> type:
    """The model class of a config: Decoder, Encoder or EncoderDecoder."""
    from tfx.models.decoder import Decoder
    from tfx.models.encoder import Encoder
    from tfx.models.encoder_decoder import EncoderDecoder

    models = {DecoderConfig: Decoder, EncoderConfig: Encoder, EncoderDecoderConfig: EncoderDecoder}
    if type(config) not in models:
        raise TypeError(f"config must be a preset name or one of "
                        f"{[c.__name__ for c in models]}, got {type(config).__name__}")
    return models[type(config)]
