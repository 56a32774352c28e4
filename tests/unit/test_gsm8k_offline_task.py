"""The generated offline gsm8k task is lm-eval's stock task over local JSONL files.

Loads the generated YAML with lm-eval's own TaskManager, checks the docs and few-shot
prompts come from the local files, and runs lm-eval's scoring with its `dummy` model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from vllm_flashinfer_ep.evals.gsm8k import (
    OFFLINE_ENV,
    OFFLINE_TASK,
    lm_eval_command,
    run_lm_eval,
    stock_task_yaml,
    write_offline_task,
)

TRAIN = [("What is 2 plus 2?", 4), ("What is 10 minus 3?", 7)]
TEST = [("What is 6 times 7?", 42), ("What is 100 divided by 4?", 25), ("What is 9 plus 1?", 10)]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("gsm8k")
    data = root / "data"
    data.mkdir()
    for name, rows in (("train.jsonl", TRAIN), ("test.jsonl", TEST)):
        (data / name).write_text(
            "".join(
                json.dumps({"question": q, "answer": f"Compute.\n#### {n}"}) + "\n" for q, n in rows
            )
        )
    include = root / "tasks"
    assert write_offline_task(data, include, root / "hf-cache") == OFFLINE_TASK
    with pytest.MonkeyPatch.context() as mp:  # lm-eval must find everything locally
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        yield data, include


def test_generated_yaml_is_renamed_stock_task_on_local_files(task_dir: tuple[Path, Path]) -> None:
    data, include = task_dir
    generated = yaml.safe_load((include / f"{OFFLINE_TASK}.yaml").read_text())
    stock = yaml.safe_load(stock_task_yaml().read_text())
    assert generated["task"] == OFFLINE_TASK != stock["task"]
    assert generated["dataset_path"] == "json" and "dataset_name" not in generated
    assert "tag" not in generated  # must not join the stock task groups
    files = generated["dataset_kwargs"]["data_files"]
    assert files == {"train": str(data / "train.jsonl"), "test": str(data / "test.jsonl")}
    assert all(Path(p).is_absolute() for p in files.values())
    # Prompt, filters, metric and generation settings are lm-eval's own.
    for key in (
        "doc_to_text",
        "doc_to_target",
        "filter_list",
        "metric_list",
        "generation_kwargs",
        "training_split",
        "fewshot_split",
        "test_split",
        "output_type",
    ):
        assert generated[key] == stock[key], key


def test_task_loads_docs_and_fewshot_from_local_files(task_dir: tuple[Path, Path]) -> None:
    from lm_eval.tasks import TaskManager

    _, include = task_dir
    manager = TaskManager(include_path=str(include), include_defaults=False)
    task = manager.load([OFFLINE_TASK])["tasks"][OFFLINE_TASK]
    task.set_config(key="num_fewshot", value=len(TRAIN))
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == [q for q, _ in TEST]
    assert [d["question"] for d in task.fewshot_docs()] == [q for q, _ in TRAIN]
    assert task.doc_to_text(docs[0]) == f"Question: {TEST[0][0]}\nAnswer:"
    task.set_fewshot_seed(seed=42)
    task.build_all_requests(limit=2, rank=0, world_size=1)
    assert len(task.instances) == 2
    context = task.instances[0].args[0]
    # Two-shot context: both train questions, then the test question.
    assert all(q in context for q, _ in TRAIN)
    assert context.endswith(f"Question: {TEST[0][0]}\nAnswer:")


def test_scoring_runs_with_lm_eval_cli_and_dummy_model(
    task_dir: tuple[Path, Path], tmp_path: Path
) -> None:
    _, include = task_dir
    command = lm_eval_command(
        "dummy",
        "",
        task=OFFLINE_TASK,
        num_fewshot=2,
        limit=3,
        seed=42,
        output_dir=tmp_path / "out",
        include_path=include,
    )
    assert command[1:3] == ["-m", "lm_eval"] and "--include_path" in command
    scores, scored = run_lm_eval(command, tmp_path / "out", OFFLINE_TASK, env=dict(os.environ))
    # The dummy model answers "lol": lm-eval scored all three docs and found nothing right.
    assert (scores, scored) == ({"strict-match": 0.0, "flexible-extract": 0.0}, 3)
