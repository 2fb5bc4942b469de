"""Evaluation with lm-evaluation-harness (an optional peer: `pip install lm-eval`).

    results = tfx.evaluation.evaluate("runs/gpt_char", ["my_task"], include_path="tasks/")
    lm = tfx.evaluation.TfxLM.from_path("hf/llama")           # an lm_eval.api.model.LM
    lm_eval.simple_evaluate(model="tfx", model_args="path=hf/llama", tasks=[...])

`TfxLM` (in `tfx.evaluation.harness`, registered with lm-eval as "tfx") answers lm-eval's
loglikelihood, loglikelihood_rolling and generate_until requests with the numbers of lm-eval's
own `hf` backend on the same checkpoint. This package imports lm_eval only when `TfxLM` or
`evaluate` is first used, so it imports without lm_eval installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfx.evaluation.harness import TfxLM

__all__ = ["TfxLM", "evaluate"]


def __getattr__(name: str):
    if name == "TfxLM":  # imports lm_eval (and registers the "tfx" model) on first use
        from tfx.evaluation.harness import TfxLM

        return TfxLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def evaluate(path_or_lm, tasks: Sequence[str], *, include_path: str | Path | None = None,
             limit: int | float | None = None, batch_size: int = 8, num_fewshot: int | None = None,
             bootstrap_iters: int = 0) -> dict:
    """Run lm-eval tasks on a tfx model: a thin wrapper over `lm_eval.simple_evaluate`.

    Args:
      path_or_lm: a run workdir or Hugging Face folder (`TfxLM.from_path`), or an lm-eval LM
        (a `TfxLM`, or another backend to compare with).
      tasks: task names, found in include_path (only there when given: nothing of lm-eval's own
        task index, so nothing is downloaded unless a task's YAML asks for it).
      include_path: a folder of task YAML files; None: lm-eval's built-in tasks.
      limit: at most this many documents per task (a fraction < 1: that share).
      batch_size: rows per model call when path_or_lm is a path.
      num_fewshot: examples in each prompt; None: each task's own setting.
      bootstrap_iters: resamples for the metrics' standard errors (0: none, the quick default).
    Returns:
      lm-eval's results dict (`["results"][task][metric + ",none"]`, configs, versions, ...).
    Raises:
      ValueError: `tasks` empty or not strings, `include_path` not a folder.
    """
    if isinstance(tasks, str) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"include_path {str(include_path)!r} is not a folder")
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from tfx.evaluation.harness import TfxLM

    lm = path_or_lm if isinstance(path_or_lm, LM) else TfxLM.from_path(path_or_lm,
                                                                      batch_size=batch_size)
    manager = TaskManager(include_path=None if include_path is None else str(include_path),
                          include_defaults=include_path is None)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager,
                                   limit=limit, num_fewshot=num_fewshot,
                                   bootstrap_iters=bootstrap_iters, log_samples=False)
