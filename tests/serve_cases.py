"""References for the server tests: `tfx.generate` on each request alone."""

import numpy as np

import tfx


def reference(folder, prompt, max_new_tokens, *, adapter=None, eos=None) -> np.ndarray:
    """Greedy tokens of `tfx.generate` on one request alone by the Hugging Face folder's model
    (with the peft adapter folder attached), cut after the first EOS."""
    from tfx.peft import lora

    model = tfx.hf.load(folder)
    if adapter is not None:
        lora.attach(model, tfx.hf.load_peft_adapter(adapter, model))
    return greedy(model, prompt, max_new_tokens, eos=eos)


def greedy(model, prompt, max_new_tokens, *, eos=None) -> np.ndarray:
    """Greedy tokens of `tfx.generate(model)` on one request alone, cut after the first EOS."""
    out = np.asarray(tfx.generate(model, [list(prompt)], max_new_tokens=max_new_tokens,
                                  temperature=0.0, eos_token_id=eos))[0, len(prompt):]
    ends = np.flatnonzero(np.isin(out, eos or []))
    return out[:ends[0] + 1] if len(ends) else out
