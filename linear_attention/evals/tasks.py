"""lm-eval tasks read from the local disk only: names checked against lm-eval's index (and the
folders of ``--include_path``), and every task's data files found before anything runs.

A task reads local data when its ``dataset_path`` is a file format of the ``datasets`` library
(``json``, ``csv``, ``parquet``, ``text``, ``arrow``) with ``dataset_kwargs.data_files`` naming
files that exist (a relative path is read from the current folder, as ``datasets`` reads it),
or when ``dataset_path`` is itself a local folder or file. Any other ``dataset_path`` is a
Hugging Face Hub dataset, which ``la-eval`` refuses: it downloads nothing (``HF_DATASETS_OFFLINE``
and ``HF_HUB_OFFLINE`` are set).
"""

from __future__ import annotations

import difflib
import functools
import glob
import os

_FILE_FORMATS = ("json", "csv", "parquet", "text", "arrow")
_LOCAL_TASK = (
    "write the task with `dataset_path: json` and `dataset_kwargs: {data_files: {test: "
    "FILE.jsonl}}` (a local copy of its data) in a folder given to --include_path "
    "(docs/guides/evaluation.md)"
)


def go_offline() -> None:
    """Nothing is downloaded: set before ``datasets`` and ``huggingface_hub`` are imported.
    And lm-eval's bootstrap of standard errors runs in this process: its pool forks, and a
    fork of a process running JAX's threads can deadlock."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["DISABLE_MULTIPROC"] = "1"


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None):
    """lm-eval's `TaskManager`: its own tasks and those of ``include_path`` (which win)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _files(data_files) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _files(v)]
    if isinstance(data_files, list | tuple):
        return [f for v in data_files for f in _files(v)]
    return []


def data_problem(name: str, cfg: dict) -> str | None:
    """Why task ``name`` (its YAML config ``cfg``) cannot run from the local disk; None if it
    can."""
    path = cfg.get("dataset_path")
    if path in _FILE_FORMATS:
        files = _files((cfg.get("dataset_kwargs") or {}).get("data_files"))
        if not files:
            return f"task {name!r} reads {path!r} files but its dataset_kwargs name no data_files"
        missing = [f for f in files if not glob.glob(f)]
        if missing:
            return (
                f"task {name!r}: its data file {missing[0]!r} is not on the local disk (relative "
                f"paths are read from the current folder, {os.getcwd()!r})"
            )
        return None
    if isinstance(path, str) and os.path.exists(path):
        return None
    return (
        f"task {name!r} reads {path!r} from the Hugging Face Hub, and la-eval downloads nothing; "
        + _LOCAL_TASK
    )


def check_tasks(names: list[str], manager) -> None:
    """ValueError for the first unknown name (with the close ones) or task whose data are not
    on the local disk (`data_problem`); groups and tags are checked through their tasks."""
    from lm_eval.tasks._index import Kind

    index = manager.task_index
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if isinstance(name, dict):  # a group's inline task
            problem = data_problem(name.get("task", "?"), name)
            if problem:
                raise ValueError(problem)
            continue
        if name in seen:
            continue
        seen.add(name)
        entry = index.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise ValueError(
                f"unknown task {name!r}{hint} (lm-eval's tasks and those of --include_path)"
            )
        if entry.kind == Kind.TAG:
            todo.extend(sorted(entry.tags))
        elif entry.kind == Kind.GROUP:
            members = (entry.cfg or {}).get("task", [])
            todo.extend(members if isinstance(members, list) else [members])
        else:
            problem = data_problem(name, entry.cfg or {})
            if problem:
                raise ValueError(problem)
