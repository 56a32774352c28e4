"""Running lm-eval's gsm8k task against an OpenAI-compatible completions server.

Uses lm-eval's Python API and its `local-completions` model (POST /v1/completions),
greedy (temperature 0) with a fixed seed, as vLLM's gsm8k harness does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

STRICT = "strict-match"
FLEXIBLE = "flexible-extract"
FILTERS: tuple[str, ...] = (STRICT, FLEXIBLE)


@dataclass(frozen=True)
class Gsm8kScores:
    """Exact-match accuracy per lm-eval filter and how many questions were scored."""

    strict_match: float
    flexible_extract: float
    num_questions: int
    task: str

    def by_filter(self) -> dict[str, float]:
        return {STRICT: self.strict_match, FLEXIBLE: self.flexible_extract}


def completions_model_args(
    base_url: str,
    model_name: str,
    *,
    max_tokens: int,
    seed: int,
    concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Arguments of lm-eval's `local-completions` model.

    Prompts go as text (no local tokenizer: the server tokenizes), so no model files
    are needed on the client side.
    """
    return {
        "model": model_name,
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "tokenizer_backend": "none",
        "tokenized_requests": False,
        "num_concurrent": concurrency,
        "max_retries": 3,
        "max_gen_toks": max_tokens,
        "seed": seed,
        "timeout": int(timeout_s),
    }


def extract_scores(results: dict[str, Any], task: str) -> Gsm8kScores:
    """Pull the two exact-match numbers out of lm-eval's result dict."""
    try:
        metrics = results["results"][task]
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"lm-eval returned no results for task {task!r}") from exc
    values: dict[str, float] = {}
    for name in FILTERS:
        key = f"exact_match,{name}"
        if key not in metrics:
            raise RuntimeError(f"lm-eval results for {task!r} lack {key!r}: {sorted(metrics)}")
        values[name] = float(metrics[key])
    n_samples = results.get("n-samples", {}).get(task, {})
    num = int(n_samples.get("effective", n_samples.get("original", 0)))
    return Gsm8kScores(
        strict_match=values[STRICT],
        flexible_extract=values[FLEXIBLE],
        num_questions=num,
        task=task,
    )


def run_gsm8k(
    model: str,
    model_args: dict[str, Any],
    *,
    num_fewshot: int,
    limit: int | None,
    seed: int,
    task: str = "gsm8k",
    include_path: Path | None = None,
    temperature: float = 0.0,
) -> Gsm8kScores:
    """Evaluate gsm8k (or its offline copy) with lm-eval; return the scores.

    `model` is an lm-eval model name (`local-completions` for a server; tests may
    pass another registered lm-eval model).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    # The offline task is self-contained; skipping lm-eval's few thousand built-in task
    # files saves seconds of indexing per run.
    if include_path is not None:
        task_manager = TaskManager(include_path=str(include_path), include_defaults=False)
    else:
        task_manager = TaskManager()
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=task_manager,
        gen_kwargs={"temperature": temperature},
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        bootstrap_iters=0,
    )
    if results is None:  # non-zero ranks in lm-eval's distributed mode; not ours
        raise RuntimeError("lm-eval returned no results")
    return extract_scores(results, task)
