"""The serving benchmark (tests/engine/serve_bench.py): commands vLLM 0.33.0's own parsers
accept (nothing of vLLM's compilation overridden under `default`), the table's figures
and ratios from recorded runs, the handle counters failing a row, and the merge."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import fields
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import serve_bench  # noqa: E402

from tests.helpers import free_port  # noqa: E402
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY  # noqa: E402
from vllm_flashinfer_ep.runtime.handle_pool import PoolCounters  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
# Issue 46's recorded runs (H100, decode-only, 256/64, budget 256 for both)
NO_EP_46 = RESULTS / "serve_world1_qwen3_30b_a3b_no_ep_h100.json"
LL_46 = RESULTS / "serve_world1_qwen3_30b_a3b_ll_h100.json"
PROBES = json.loads((Path(__file__).parent / "data" / "serve_probes_ll.json").read_text())


def _vllm_parser(which: str):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    if which == "bench":
        from vllm.benchmarks.serve import add_cli_args
    else:
        from vllm.entrypoints.common.cli_args import make_arg_parser as add_cli_args
    add_cli_args(parser)
    return parser


def test_vllm_bench_serve_accepts_the_command():
    load = serve_bench.bench_args(2048, 256, 32, 128, seed=7)
    cmd = serve_bench.bench_command("/m", 8765, load, Path("/tmp/r/x.json"))
    assert cmd[2:5] == ["vllm.entrypoints.cli.main", "bench", "serve"]
    parsed = _vllm_parser("bench").parse_args(cmd[5:])
    assert (parsed.max_concurrency, parsed.num_prompts, parsed.dataset_name) == (32, 128, "random")
    assert parsed.seed == 7
    assert (parsed.random_input_len, parsed.random_output_len, parsed.ignore_eos) == (
        2048,
        256,
        True,
    )
    assert parsed.save_result and parsed.result_filename == "x.json"


# What each configuration may change against `vllm serve MODEL` with nothing else.
COMMON = {"served_model_name", "max_model_len", "gpu_memory_utilization", "load_format"}
EP = {"enable_expert_parallel", "all2all_backend"}


@pytest.mark.parametrize("compilation", serve_bench.COMPILATIONS)
@pytest.mark.parametrize("config", serve_bench.CONFIGS)
def test_vllm_serve_gets_only_what_the_configuration_names(config, compilation):
    """Every argument vLLM's serve parser reads differently from `vllm serve MODEL` alone:
    under `default` nothing about compilation, graphs, eager mode or the step budget."""
    parser = _vllm_parser("serve")
    bare = vars(parser.parse_args(["/m"]))
    args = serve_bench.serve_args(config, compilation, "qwen3-30b-a3b")
    cmd = serve_bench.serve_process.serve_command("/m", 8765, *args)
    assert cmd[3:5] == ["serve", "/m"]
    parsed = vars(parser.parse_args(cmd[4:]))
    changed = {k for k in parsed if parsed[k] != bare.get(k)} - {"host", "port"}
    expected = COMMON | (EP if config != "no_ep" else set())
    if compilation == "decode-only":
        expected |= {"compilation_config"}
        comp = parsed["compilation_config"]
        assert comp.cudagraph_mode.name == "FULL_DECODE_ONLY" and int(comp.mode) == 0
    assert changed == expected
    backend = {"no_ep": None, "ll": LOW_LATENCY, "ll_rounds": LOW_LATENCY, "ht": HIGH_THROUGHPUT}[
        config
    ]
    assert parsed["all2all_backend"] == (backend or bare["all2all_backend"])
    assert parsed["max_model_len"] == serve_bench.MAX_MODEL_LEN >= 2048 + 256


def test_a_budget_is_passed_only_when_asked():
    args = serve_bench.serve_args("ll", "default", "qwen3-30b-a3b", 256)
    parsed = _vllm_parser("serve").parse_args(["/m", *args])
    assert parsed.max_num_batched_tokens == 256
    with pytest.raises(ValueError):
        serve_bench.serve_args("deepep", "default", "qwen3-30b-a3b")


def test_a_capture_size_is_passed_only_when_asked_and_never_beside_decode_only():
    """vLLM's own parser reads the capture size; decode-only names its own capture sizes
    in --compilation-config, so a second bound there is refused."""
    args = serve_bench.serve_args("ll", "default", "qwen3-30b-a3b", 1024, 1024)
    parsed = _vllm_parser("serve").parse_args(["/m", *args])
    assert (parsed.max_num_batched_tokens, parsed.max_cudagraph_capture_size) == (1024, 1024)
    bare = _vllm_parser("serve").parse_args(["/m", *serve_bench.serve_args("ll", "default", "x")])
    assert bare.max_cudagraph_capture_size is None
    with pytest.raises(ValueError, match="capture size"):
        serve_bench.serve_args("ll", "decode-only", "qwen3-30b-a3b", None, 1024)


def test_warm_waves_come_first_and_alone_under_warm_only():
    both = ["256x64", "2048x256"]
    waves = serve_bench.plan(both, warm_only=False, warm_wave=True)
    assert [w[:4] for w in waves[:2]] == [("256x64", 128, 128, True), ("2048x256", 32, 32, True)]
    assert [(w.dataset, w.concurrency) for w in waves if not w.warm] == [
        ("256x64", 1),
        ("256x64", 8),
        ("256x64", 32),
        ("256x64", 128),
        ("2048x256", 8),
        ("2048x256", 32),
    ]
    assert serve_bench.plan(both, warm_only=True, warm_wave=False) == waves[:2]
    assert all(not w.warm for w in serve_bench.plan(["256x64"], False, False))


def test_every_wave_of_a_run_sends_new_prompts():
    """vLLM's random dataset draws the same prompts from the same seed, and the server's
    prefix cache (on by default) would skip their prefill: one seed per wave."""
    import numpy as np
    from vllm.benchmarks.datasets.utils import get_sampling_params

    waves = serve_bench.plan(["256x64", "2048x256"], warm_only=False, warm_wave=True)
    seeds = [w.seed for w in waves]
    assert len(set(seeds)) == len(seeds)

    class Tokenizer:
        vocab_size = 151936

        @staticmethod
        def num_special_tokens_to_add():
            return 0

    # request i's prompt is (offset_i + i + arange(len)) % vocab: the offsets tell prompts apart
    offsets = [
        get_sampling_params(np.random.default_rng(w.seed), w.prompts, 0.0, 256, 64, Tokenizer)[2]
        for w in waves
    ]
    starts = [int(o + i) % Tokenizer.vocab_size for off in offsets for i, o in enumerate(off)]
    assert len(set(starts)) > 0.99 * len(starts)


def test_a_wave_whose_prompts_hit_the_prefix_cache_fails():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    hits = Counter("vllm:prefix_cache_hits", "", labels, registry=registry)
    queries = Counter("vllm:prefix_cache_queries", "", labels, registry=registry)
    queries.labels("moe", "0").inc(1000)
    before = serve_bench.prefix_cache_counts(generate_latest(registry).decode())
    assert before == (0.0, 1000.0)

    queries.labels("moe", "0").inc(50_000)
    hits.labels("moe", "0").inc(500)  # 1 %: random prompts sharing a block
    fresh = serve_bench.prefix_cache_counts(generate_latest(registry).decode())
    row = serve_bench.check_prefill({"completed": 8, "num_prompts": 8}, before, fresh)
    assert row["prefix_cache_hit_share"] == 0.01 and "problem" not in row

    queries.labels("moe", "0").inc(50_000)
    hits.labels("moe", "0").inc(40_000)  # the prompts came again
    again = serve_bench.prefix_cache_counts(generate_latest(registry).decode())
    row = serve_bench.check_prefill({"completed": 8, "num_prompts": 8}, fresh, again)
    doc = {"runs": [{"config": "ll", "compilation": "default", "datasets": {}}]}
    doc["runs"][0]["datasets"]["256x64"] = {"rows": {"8": row}}
    assert serve_bench.problems(doc) == [
        "ll/default 256x64 concurrency 8: prefix cache hits: 80.0% of the prompt tokens "
        "(prompts sent again)"
    ]
    off = serve_bench.check_prefill({}, (0.0, 0.0), (0.0, 0.0))  # prefix caching off
    assert off == {"prefix_cache_hit_share": None}
    # a server without /metrics: the row keeps its figures and says the check did not run
    unread = serve_bench.check_prefill({}, serve_bench.prefix_cache(free_port()), again)
    assert unread["prefix_cache_hit_share"] is None and "problem" not in unread
    assert unread["prefix_cache_unread"].startswith("/metrics unread:")


# --------------------------------------------------------------------------- table


def test_the_table_of_recorded_runs_gives_the_published_figures():
    """Issue 46's two recorded files merged and tabled: the cells docs/benchmarks.md
    published from them (LL / no EP 0.72 / 0.84 / 0.87 / 0.56), and the TPOT and TTFT
    ratios computed here from its figures (6.61 / 4.93, 184.4 / 97.8)."""
    doc = serve_bench.merge([json.loads(p.read_text()) for p in (NO_EP_46, LL_46)])
    text = serve_bench.table(doc)
    assert "256x64 (input x output tokens), compilation decode-only" in text
    assert "--max-num-batched-tokens: no_ep 256, ll 256" in text
    assert "| 1 | 64 | 165 | 4.93 | 97.8 | 120 (0.72) | 6.61 (1.34) | 184.4 (1.89) |" in text
    for level, ratio in (("8", "0.84"), ("32", "0.87"), ("128", "0.56")):
        row = next(line for line in text.splitlines() if line.startswith(f"| {level} |"))
        assert row.split(" | ")[5].endswith(f"({ratio})")
    assert (
        "| 128 | 512 | 837 | 58.76 | 9865.1 | 467 (0.56) | 111.98 (1.91) | 16110.7 (1.63) |" in text
    )


def _docs_table(results: str) -> tuple[dict, str, list[str], list[str]]:
    """A results file, its table, the table's figure rows and those of them that
    docs/benchmarks.md does not show."""
    doc = json.loads((RESULTS / results).read_text())
    text = serve_bench.table(doc)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return doc, text, rows, [row for row in rows if row not in page]


def _pooled_at_load(doc: dict) -> list[int]:
    return [r["resolved"]["handles_at_load"]["pooled_created"] for r in doc["runs"]]


def test_the_served_table_in_the_docs_is_the_recorded_runs():
    """Issue 50's runs at vLLM's default compilation: every row docs/benchmarks.md shows
    is the one the results file tables, and the budgets and KV caches it names are theirs."""
    doc, text, rows, missing = _docs_table("serve_world1_qwen3_30b_a3b.json")
    assert "--max-num-batched-tokens: no_ep 8192, ll 256, ll@2048 2048;" in text
    assert "KV cache tokens: no_ep 76096, ll 85920, ll@2048 23168" in text
    assert (
        "--max-num-batched-tokens: no_ep 8192, ll 256, ll@2048 2048, ll_rounds/512 8192, ht 8192;"
        in text
    )
    assert (
        "KV cache tokens: no_ep 76096, ll 85920, ll@2048 23168, ll_rounds/512 60080, ht 77184"
        in text
    )
    assert len(rows) == 6 and missing == []
    assert _pooled_at_load(doc) == [0, 35, 55, 48, 51]
    assert serve_bench.problems(doc) == [
        "ht/default 2048x256 concurrency 32: not done by --deadline-s"
    ]


def test_the_budget_table_in_the_docs_is_the_recorded_runs():
    """LL at 512 and 1024 tokens per step beside no EP (one machine): every row
    docs/benchmarks.md shows is the one the results file tables, every request completed
    and no handle was created after load."""
    doc, text, rows, missing = _docs_table("serve_world1_qwen3_30b_a3b_budgets_h100.json")
    assert "--max-num-batched-tokens: no_ep 8192, ll@512 512, ll@1024 1024;" in text
    assert "KV cache tokens: no_ep 76096, ll@512 68960, ll@1024 47984" in text
    assert len(rows) == 4 and missing == []
    assert _pooled_at_load(doc) == [0, 53, 51]
    assert serve_bench.problems(doc) == []


def test_the_long_prompt_table_in_the_docs_is_the_recorded_runs():
    """Long prompts through LL at its default budget (asked for nothing, the worker read
    512) and at 256 beside no EP (one machine): every row docs/benchmarks.md shows is the
    one the results file tables, every request completed, no handle after load."""
    doc, text, rows, missing = _docs_table("serve_world1_qwen3_30b_a3b_prefill_budgets_h100.json")
    assert "--max-num-batched-tokens: no_ep 8192, ll 512, ll@256 256;" in text
    assert "KV cache tokens: no_ep 76096, ll 78048, ll@256 85920" in text
    assert [r["budget"]["asked"] for r in doc["runs"]] == [None, None, 256]
    assert len(rows) == 2 and missing == []
    assert _pooled_at_load(doc) == [0, 51, 35]
    assert serve_bench.problems(doc) == []


def _run(config, compilation="default", device="NVIDIA H100 80GB HBM3", budget=8192, **rows):
    return {
        "config": config,
        "compilation": compilation,
        "shape": "qwen3-30b-a3b",
        "resolved": {"device": device},
        "budget": {"max_num_batched_tokens": budget},
        "datasets": {d: {"input_len": 0, "output_len": 0, "rows": r} for d, r in rows.items() if r},
    }


def _row(tput=100.0, tpot=5.0, ttft=20.0, prompts=64, failed=0, **extra):
    return {
        "completed": prompts - failed,
        "failed": failed,
        "num_prompts": prompts,
        "output_throughput": tput,
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": ttft,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": 6.0,
        **extra,
    }


def test_every_config_s_ratios_are_to_no_ep_and_every_budget_is_named():
    doc = {
        "runs": [
            _run("ht", **{"2048x256": {"8": _row(tput=90.0, tpot=5.5, ttft=23.0)}}),
            _run("no_ep", **{"2048x256": {"8": _row(tput=100.0, tpot=5.0, ttft=20.0)}}),
            _run("ll", budget=256, **{"2048x256": {"8": _row(tput=80.0, tpot=6.0, ttft=30.0)}}),
        ]
    }
    text = serve_bench.table(doc)
    assert "--max-num-batched-tokens: no_ep 8192, ll 256, ht 8192" in text
    assert (
        "| 8 | 64 | 100 | 5.00 | 20.0 | 80 (0.80) | 6.00 (1.20) | 30.0 (1.50) "
        "| 90 (0.90) | 5.50 (1.10) | 23.0 (1.15) |"
    ) in text


def test_a_dataset_s_table_has_only_the_configurations_that_served_it():
    """HT served only 2048x256: the 256x64 table names no HT budget and has no HT columns."""
    doc = {
        "runs": [
            _run("no_ep", **{"256x64": {"8": _row()}, "2048x256": {"8": _row()}}),
            _run("ll", budget=256, **{"256x64": {"8": _row()}, "2048x256": {"8": _row()}}),
            _run("ht", **{"2048x256": {"8": _row(tput=50.0)}}),
        ]
    }
    short, long = serve_bench.table(doc).split("2048x256 (input x output tokens)")
    assert "ht" not in short and "--max-num-batched-tokens: no_ep 8192, ll 256;" in short
    assert "no_ep 8192, ll 256, ht 8192;" in long and "| ht out tok/s |" in long
    assert "| 50 (0.50) |" in long


def test_one_configuration_at_two_budgets_sits_side_by_side():
    """LL at vLLM's default budget and at one asked for, both against no EP's default."""
    rows = {"256x64": {"32": _row(tput=100.0)}}
    at = {"256x64": {"32": _row(tput=95.0)}}
    ll_2048 = _run("ll", budget=2048, **at)
    ll_2048["budget"]["asked"] = 2048
    a = {
        "runs": [
            _run("no_ep", **rows),
            _run("ll", budget=256, **{"256x64": {"32": _row(tput=80.0)}}),
        ]
    }
    joined = serve_bench.merge([a, {"runs": [ll_2048]}])
    assert [serve_bench.label(r) for r in joined["runs"]] == ["no_ep", "ll", "ll@2048"]
    text = serve_bench.table(joined)
    assert "--max-num-batched-tokens: no_ep 8192, ll 256, ll@2048 2048" in text
    assert "| ll@2048 out tok/s |" in text
    row = next(line for line in text.splitlines() if line.startswith("| 32 |"))
    assert row.split(" | ")[5] == "80 (0.80)" and row.split(" | ")[8] == "95 (0.95)"


# ------------------------------------------------------- KV cache and queue, from the log

# vLLM 0.33.0's own lines, as a served LL engine at budget 2048 logged them on an H100
VLLM_LOG = """\
(EngineCore pid=3344) INFO 12-07 02:11:56 [ep_runtime.py:88] flashinfer_ep: low_latency \
runtime (hidden 2048, 2048 tokens per rank) loaded: 4.01 GB of GPU memory device-wide (fleet, \
55 pooled handles for token counts 1, 2, ..., 2048); pool: 55 handles, 2344.6 MB device memory
(EngineCore pid=3344) INFO 12-07 02:12:40 [gpu_worker.py:772] Available KV cache memory: 2.12 GiB
(EngineCore pid=3344) INFO 12-07 02:12:40 [kv_cache_utils.py:1147] GPU KV cache size: 23,168 \
tokens, Maximum concurrency for 4,096 tokens per request: 5.66x
(EngineCore pid=3344) INFO 12-07 02:13:06 [gpu_worker.py:1066] Free memory on device \
(78.48/79.18 GiB) on startup. Desired GPU memory utilization is (0.85, 67.3 GiB). Actual usage \
is 62.79 GiB for consumed memory (weights + non-torch), 2.39 GiB for peak activation, and 0.48 \
GiB for CUDAGraph memory. Replace gpu_memory_utilization config with \
`--kv-cache-memory=1605332583` (1.5 GiB) to fit into requested memory.
(APIServer pid=3279) INFO 12-07 02:13:47 [loggers.py:335] Engine 000: Avg prompt throughput: \
614.3 tokens/s, Avg generation throughput: 152.4 tokens/s, Running: 1 reqs, Waiting: 0 reqs, \
GPU KV cache usage: 1.4%, Prefix cache hit rate: 0.0%
(APIServer pid=3279) INFO 12-07 02:16:17 [loggers.py:335] Engine 000: Avg prompt throughput: \
6142.5 tokens/s, Avg generation throughput: 1238.5 tokens/s, Running: 79 reqs, Waiting: 49 \
reqs, GPU KV cache usage: 99.4%, Prefix cache hit rate: 0.1%
"""
# the parts vLLM 0.33.0's stats line adds between the queue and the KV use when they occur
# (v1/metrics/loggers.py): skipped requests and preemptions, as a full KV cache causes
PREEMPTING = (
    "Engine 000: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
    "Running: 80 reqs, Waiting: 50 reqs, Deferred: 2 reqs, Preemptions: 3, GPU KV cache usage: "
    "100.0%, Prefix cache hit rate: 0.1%\n"
)


def test_the_kv_cache_and_the_queue_are_read_from_vllm_s_log_lines():
    assert serve_bench.kv_cache(VLLM_LOG) == {
        "gib": [2.12],
        "tokens": [23168],
        "consumed_gib": [62.79],
        "peak_activation_gib": [2.39],
        "cuda_graph_gib": [0.48],
        "ep_runtime_gb": [4.01],
    }
    assert serve_bench.queue(VLLM_LOG) == {
        "samples": 2,
        "max_running": 79,
        "max_waiting": 49,
        "max_kv_usage_pct": 99.4,
        "preemptions": 0,
    }
    full = serve_bench.queue(VLLM_LOG + PREEMPTING + PREEMPTING)
    assert full["max_running"] == 80 and full["max_waiting"] == 50
    assert full["max_kv_usage_pct"] == 100.0 and full["preemptions"] == 6
    assert serve_bench.queue(VLLM_LOG.split("(APIServer")[0]) is None
    assert not any(serve_bench.kv_cache("INFO ready\n").values())


def test_the_table_names_each_run_s_kv_cache():
    ll = _run("ll", budget=2048, **{"256x64": {"128": _row(tput=57.0)}})
    ll["kv_cache"] = serve_bench.kv_cache(VLLM_LOG)
    doc = {"runs": [_run("no_ep", **{"256x64": {"128": _row(tput=100.0)}}), ll]}
    text = serve_bench.table(doc)
    assert "; KV cache tokens: no_ep unrecorded, ll 23168" in text


# ------------------------------------------------------------------------ counters


def test_the_fixture_counters_are_the_pool_s():
    names = {f.name for f in fields(PoolCounters)}
    for key in ("at_load", "after_pooled_row", "after_fresh_row"):
        assert set(PROBES[key]["runtimes"][0]["counters"]) == names
    assert set(serve_bench.CREATED) <= names


def test_a_row_records_the_forwards_split_into_rounds_during_it():
    """48 MoE layers each split twice while the row ran: 96, counted from the probes around
    it (none for a probe without runtimes: an engine without EP)."""
    before, after = copy.deepcopy(PROBES["at_load"]), copy.deepcopy(PROBES["after_pooled_row"])
    before["runtimes"][0]["counters"]["split_forwards"] = 7
    after["runtimes"][0]["counters"]["split_forwards"] = 7 + 96
    assert serve_bench.check_row(_row(), before, after)["split_forwards"] == 96
    no_ep = {"runtimes": []}
    assert serve_bench.check_row(_row(), no_ep, no_ep)["split_forwards"] == 0


def test_a_row_served_on_the_pool_passes_and_one_with_a_new_handle_fails():
    clean = serve_bench.check_row(_row(), PROBES["at_load"], PROBES["after_pooled_row"])
    assert clean["handles_created"] == {} and "problem" not in clean
    bad = serve_bench.check_row(_row(), PROBES["after_pooled_row"], PROBES["after_fresh_row"])
    assert bad["handles_created"] == {"fresh_created": 1}
    assert "handles created after load" in bad["problem"]
    doc = {"runs": [_run("ll", **{"256x64": {"8": bad}})]}
    assert serve_bench.problems(doc) == [
        "ll/default 256x64 concurrency 8: handles created after load: {'fresh_created': 1}"
    ]
    assert "FAILED: handles created after load" in serve_bench.table(doc)


def test_no_ep_has_no_handles_and_the_resolved_settings_are_the_worker_s():
    no_ep = PROBES["at_load"] | {"runtimes": [], "manager": None}
    assert serve_bench.handles(no_ep) == {k: 0 for k in serve_bench.CREATED}
    got = serve_bench.resolved(PROBES["at_load"])
    assert (got["compilation_mode"], got["cudagraph_mode"]) == (
        "VLLM_COMPILE",
        "FULL_AND_PIECEWISE",
    )
    assert got["max_num_batched_tokens"] == 256 and got["handles_at_load"]["pooled_created"] == 9


def test_failed_requests_and_log_lines_make_a_run_not_count():
    doc = {"runs": [_run("no_ep", **{"256x64": {"1": _row(failed=1)}})]}
    assert "1 of 64 failed" in serve_bench.problems(doc)[0]
    log = "INFO flashinfer_ep: a round of 300 tokens runs on a per-forward handle: ...\n"
    ok = {"runs": [_run("ll", **{"256x64": {"1": _row()}})]}
    assert serve_bench.problems(ok, log) == [f"server log: {log.strip()}"]


# --------------------------------------------------------------------------- merge


def test_merge_joins_runs_later_files_win_and_warm_ups_stay_out():
    first = {"runs": [_run("ll", **{"256x64": {"1": _row(tput=1.0)}})]}
    second = {"runs": [_run("ll", **{"256x64": {"1": _row(tput=2.0)}, "2048x256": {"8": _row()}})]}
    warm = {"runs": [_run("no_ep", **{"256x64": {"1": _row()}}) | {"warm_up": True}]}
    joined = serve_bench.merge([first, json.loads(LL_46.read_text()), second, warm])
    keys = [(r["config"], r["compilation"]) for r in joined["runs"]]
    assert keys == [("ll", "default"), ("ll", "decode-only")]
    ll = joined["runs"][0]["datasets"]
    assert ll["256x64"]["rows"]["1"]["output_throughput"] == 2.0 and "8" in ll["2048x256"]["rows"]
    assert joined["notes"] and "late session" in joined["notes"][0]


def test_merge_keeps_a_run_s_other_dataset():
    a = {"runs": [_run("ht", **{"256x64": {"1": _row()}})]}
    b = {"runs": [_run("ht", **{"2048x256": {"8": _row()}})]}
    got = serve_bench.merge([a, b])["runs"][0]["datasets"]
    assert set(got) == {"256x64", "2048x256"}


def test_a_merged_file_merges_again_with_its_notes_and_each_server_s_facts():
    """The published file is merged with later runs: its notes stay; the later run's
    settings are the run's, and the earlier run's other datasets keep their own server's
    (command, KV cache, budget), in the file and in their table's header."""
    old = _run("ll", budget=256, **{"256x64": {"1": _row()}}) | {"command": "earlier call"}
    old["kv_cache"] = {"tokens": [85920]}
    first = serve_bench.merge([{"runs": [old], "note": "first session"}])
    new = _run("ll", budget=256, **{"2048x256": {"8": _row()}}) | {"kv_cache": {"tokens": [1]}}
    joined = serve_bench.merge([first, {"runs": [new], "note": "second session"}])
    assert joined["notes"] == ["first session", "second session"]
    run = joined["runs"][0]
    assert "command" not in run and run["kv_cache"] == {"tokens": [1]}
    assert set(run["datasets"]) == {"256x64", "2048x256"}
    assert run["datasets"]["256x64"]["server"]["command"] == "earlier call"
    assert "server" not in run["datasets"]["2048x256"]
    again = serve_bench.merge([joined])  # a third merge keeps them where they are
    assert again["runs"][0]["datasets"]["256x64"]["server"]["command"] == "earlier call"
    short, long = serve_bench.table(again).split("2048x256 (input x output tokens)")
    assert "KV cache tokens: ll 85920" in short and "KV cache tokens: ll 1" in long


def test_merge_refuses_two_cards():
    a = {"runs": [_run("ll", **{"256x64": {"1": _row()}})]}
    b = {"runs": [_run("no_ep", device="NVIDIA H200", **{"256x64": {"1": _row()}})]}
    with pytest.raises(ValueError, match="cards"):
        serve_bench.merge([a, b])


def test_merge_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "all.json"
    rc = serve_bench.main(["--merge", str(NO_EP_46), str(LL_46), "--out", str(out)])
    assert rc == 0
    assert "120 (0.72)" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["runs"]) == 2


# --------------------------------------------------------------- a run on stand-ins


def _stand_ins(
    monkeypatch, probes: list[dict], server_exits_at: int | None = None, repeats: bool = False
):
    """A server that is always up (unless it exits after `server_exits_at` benches), a
    `vllm bench serve` that writes a result JSON, the worker's answers in turn, and the
    server's prefix cache, which finds half of each wave's prompt tokens when `repeats`."""
    import contextlib

    class Proc:
        benches = 0

        def poll(self):
            if server_exits_at is not None and Proc.benches >= server_exits_at:
                return 1
            return None

    @contextlib.contextmanager
    def served(command, env, log_path, port, startup_s):
        served.env, served.log, served.command = env, Path(log_path), command
        served.log.write_text("INFO ready\n" + VLLM_LOG.split("(APIServer")[0])
        yield Proc()

    def bench(cmd, env, check, timeout):
        Proc.benches += 1
        bench.envs.append(env)
        folder = cmd[cmd.index("--result-dir") + 1]
        name = cmd[cmd.index("--result-filename") + 1]
        prompts = int(cmd[cmd.index("--num-prompts") + 1])
        with served.log.open("a") as log:  # the server's stats line while this wave runs
            log.write(f"Running: {prompts} reqs, Waiting: 1 reqs, GPU KV cache usage: 5.0%\n")
        bench.seeds.append(cmd[cmd.index("--seed") + 1])
        (Path(folder) / name).write_text(json.dumps(_row(prompts=prompts) | {"itl": [1]}))
        return type("Done", (), {"returncode": 0})()

    bench.envs, bench.seeds = [], []
    answers = iter(probes)
    monkeypatch.setattr(
        serve_bench,
        "prefix_cache",
        lambda port: (500.0 * Proc.benches * repeats, 1000.0 * Proc.benches),
    )
    monkeypatch.setattr(serve_bench.serve_process, "served", served)
    monkeypatch.setattr(serve_bench.subprocess, "run", bench)
    monkeypatch.setattr(serve_bench, "probe", lambda port: next(answers))
    return served, bench


def _main(tmp_path, monkeypatch, *argv):
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    monkeypatch.setattr(serve_bench.tempfile, "tempdir", str(scratch))
    monkeypatch.setitem(serve_bench.DATASETS, "256x64", (256, 64, {1: 4, 8: 8}))
    out = tmp_path / "run.json"
    args = ["--shape", "tiny", "--out", str(out), *argv]
    return serve_bench.main(args), out, scratch


def test_a_run_records_the_worker_s_budget_and_each_row(tmp_path, monkeypatch, capsys):
    import os

    p = PROBES
    served, bench = _stand_ins(monkeypatch, [p["at_load"]] * 4)
    monkeypatch.setenv("PYTHONPATH", "/where/vllm/lives")
    rc, out, scratch = _main(tmp_path, monkeypatch, "--config", "ll")
    assert rc == 0, capsys.readouterr().out
    assert list(scratch.iterdir()) == []  # the 0.5 GB tiny model is not left behind
    run = json.loads(out.read_text())["runs"][0]
    assert run["budget"]["max_num_batched_tokens"] == 256 and run["budget"]["asked"] is None
    assert run["resolved"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    data = run["datasets"]["256x64"]
    assert list(data["rows"]) == ["1", "8"] and data["warm_wave"]["num_prompts"] == 8
    assert served.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert all(env["PYTHONPATH"] == os.environ["PYTHONPATH"] for env in bench.envs)
    assert len(set(bench.seeds)) == len(bench.seeds) == 3
    assert data["rows"]["8"]["prefix_cache_hit_share"] == 0.0
    assert run["kv_cache"]["tokens"] == [23168] and run["kv_cache"]["consumed_gib"] == [62.79]
    # each row's queue is what the server logged during its own wave (the warm wave of 8
    # requests came before the row of 4)
    assert data["rows"]["1"]["server_queue"]["max_running"] == 4
    assert data["rows"]["8"]["server_queue"]["max_running"] == 8


@pytest.mark.parametrize("config", ["ll", "ll_rounds"])
def test_only_ll_rounds_serves_with_the_round_tokens_and_records_them(
    config, tmp_path, monkeypatch, capsys
):
    served, _ = _stand_ins(monkeypatch, [PROBES["at_load"]] * 4)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", config)
    assert rc == 0, capsys.readouterr().out
    got = served.env.get("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS")
    assert got == ("512" if config == "ll_rounds" else None)
    recorded = json.loads(out.read_text())["runs"][0]["server_env"]
    assert recorded.get("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS") == got


def test_rounds_of_another_size_serve_with_it_and_sit_beside_512(tmp_path, monkeypatch, capsys):
    """--round-tokens 1024 reaches the server and names the run (`ll_rounds/1024`), so a
    merge keeps it beside the run at 512 instead of replacing it; other configs refuse it."""
    served, _ = _stand_ins(monkeypatch, [PROBES["at_load"]] * 8)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "ll_rounds", "--round-tokens", "1024")
    assert rc == 0, capsys.readouterr().out
    assert served.env["VLLM_FLASHINFER_EP_LL_ROUND_TOKENS"] == "1024"
    wide = json.loads(out.read_text())
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "ll_rounds")
    joined = serve_bench.merge([json.loads(out.read_text()), wide])
    assert [serve_bench.label(r) for r in joined["runs"]] == ["ll_rounds/512", "ll_rounds/1024"]
    assert "| ll_rounds/1024 out tok/s |" in serve_bench.table(joined)
    with pytest.raises(SystemExit):
        _main(tmp_path, monkeypatch, "--config", "ll", "--round-tokens", "1024")


def test_a_capture_size_reaches_the_server_and_sits_beside_the_same_budget(
    tmp_path, monkeypatch, capsys
):
    """--max-cudagraph-capture-size 1024 reaches `vllm serve`, is recorded and names the
    run (`ll@1024+cg1024`), so a merge keeps it beside `ll@1024` instead of replacing it;
    decode-only or a size below 1 is refused before any server starts."""
    served, _ = _stand_ins(monkeypatch, [PROBES["at_load"]] * 8)
    argv = ("--config", "ll", "--max-num-batched-tokens", "1024")
    rc, out, _ = _main(tmp_path, monkeypatch, *argv, "--max-cudagraph-capture-size", "1024")
    assert rc == 0, capsys.readouterr().out
    cmd = served.command
    assert cmd[cmd.index("--max-cudagraph-capture-size") + 1] == "1024"
    captured = json.loads(out.read_text())
    assert captured["runs"][0]["budget"]["capture_asked"] == 1024
    rc, out, _ = _main(tmp_path, monkeypatch, *argv)
    assert "--max-cudagraph-capture-size" not in served.command
    joined = serve_bench.merge([captured, json.loads(out.read_text())])
    assert sorted(serve_bench.label(r) for r in joined["runs"]) == ["ll@1024", "ll@1024+cg1024"]
    head = next(line for line in serve_bench.table(joined).splitlines() if "out tok/s" in line)
    assert head.index("| ll@1024 out tok/s |") < head.index("| ll@1024+cg1024 out tok/s |")
    for bad in (("--compilation", "decode-only"), ()):
        size = "1024" if bad else "0"
        with pytest.raises(SystemExit):
            _main(
                tmp_path, monkeypatch, "--config", "ll", *bad, "--max-cudagraph-capture-size", size
            )


def test_prompts_the_prefix_cache_finds_fail_the_run(tmp_path, monkeypatch, capsys):
    _stand_ins(monkeypatch, [PROBES["at_load"]] * 4, repeats=True)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "no_ep")
    assert rc == 1
    rows = json.loads(out.read_text())["runs"][0]["datasets"]["256x64"]["rows"]
    assert rows["1"]["prefix_cache_hit_share"] == 0.5
    assert "concurrency 1: prefix cache hits: 50.0%" in capsys.readouterr().out


def test_a_handle_made_while_serving_fails_its_row_and_the_run(tmp_path, monkeypatch, capsys):
    p = PROBES
    probes = [p["at_load"], p["at_load"], p["after_pooled_row"], p["after_fresh_row"]]
    _stand_ins(monkeypatch, probes)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "ll")
    assert rc == 1
    rows = json.loads(out.read_text())["runs"][0]["datasets"]["256x64"]["rows"]
    assert "problem" not in rows["1"] and rows["8"]["handles_created"] == {"fresh_created": 1}
    assert "PROBLEM ll/default 256x64 concurrency 8: handles created" in capsys.readouterr().out


def test_a_server_that_dies_mid_run_is_a_problem(tmp_path, monkeypatch, capsys):
    _stand_ins(monkeypatch, [PROBES["at_load"]] * 4, server_exits_at=1)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "no_ep")
    assert rc == 1
    assert "PROBLEM 256x64 concurrency 8: the server exited" in capsys.readouterr().out
    data = json.loads(out.read_text())["runs"][0]["datasets"]["256x64"]
    assert data["warm_wave"]["problem"] == "the server exited" and data["rows"] == {}


def test_a_wave_past_the_deadline_is_a_failed_row_in_the_file_and_the_table(
    tmp_path, monkeypatch, capsys
):
    """The row a run could not finish stays in its file, so the merged table says FAILED
    for it instead of leaving the concurrency out."""
    _, bench = _stand_ins(monkeypatch, [PROBES["at_load"]] * 4)
    done = bench

    def slow_second(cmd, env, check, timeout):
        if int(cmd[cmd.index("--max-concurrency") + 1]) == 8 and done.seeds:
            raise serve_bench.subprocess.TimeoutExpired(cmd, timeout)
        return done(cmd, env, check, timeout)

    monkeypatch.setattr(serve_bench.subprocess, "run", slow_second)
    rc, out, _ = _main(tmp_path, monkeypatch, "--config", "ll")
    assert rc == 1
    doc = json.loads(out.read_text())
    rows = doc["runs"][0]["datasets"]["256x64"]["rows"]
    assert set(rows) == {"1", "8"} and rows["8"]["problem"] == "not done by --deadline-s"
    assert "output_throughput" in rows["1"]
    assert any("concurrency 8: not done" in p for p in serve_bench.problems(doc))
    line = next(x for x in serve_bench.table(doc).splitlines() if x.startswith("| 8 |"))
    assert "FAILED: not done by --deadline-s" in line


def test_a_config_and_an_out_or_a_merge():
    with pytest.raises(SystemExit):
        serve_bench.main(["--config", "ll"])
    with pytest.raises(SystemExit):
        serve_bench.main(["--config", "ll", "--out", "x", "--datasets", "100x1"])


def test_the_harness_probe_is_what_vllm_s_rpc_endpoint_runs_by_name(monkeypatch):
    """The counters' path on the server: vLLM's dev /collective_rpc route exists, and
    vLLM's `run_method` finds the harness's method by the name serve_bench posts on a
    worker wrapper, answering JSON-safe (the package's enums as their values)."""
    import engine_run
    import world1_harness
    from vllm.entrypoints.serve.dev.rpc.api_router import router
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_flashinfer_ep.backends import Algorithm

    assert "/collective_rpc" in {route.path for route in router.routes}
    name = serve_bench.PROBE_METHOD
    monkeypatch.setattr(WorkerWrapperBase, name, None, raising=False)  # removed after the test
    world1_harness._add_worker_probe()
    seen = []

    def probe(worker):
        seen.append(worker)
        return {"runtimes": [{"algorithm": Algorithm.LOW_LATENCY, "counters": {}}]}

    monkeypatch.setattr(engine_run, "worker_probe", probe)
    wrapper = object.__new__(WorkerWrapperBase)
    wrapper.worker = "the worker"
    answer = run_method(wrapper, name, (), {})
    assert seen == ["the worker"]
    assert json.dumps(answer) == '{"runtimes": [{"algorithm": "low_latency", "counters": {}}]}'


def test_the_readme_s_serving_ratios_are_the_recorded_runs():
    """The README's two serving rows are LL's default against no EP in the results files
    (256/64 at 512 tokens per step, 2048/256 at the default the worker read)."""

    def ratios(name: str, dataset: str, label: str) -> str:
        doc = json.loads((RESULTS / name).read_text())
        runs = {serve_bench.label(r): r["datasets"][dataset]["rows"] for r in doc["runs"]}
        ll, ref = runs[label], runs["no_ep"]
        tps = [ll[c]["output_throughput"] / ref[c]["output_throughput"] for c in ref]
        return " / ".join(f"{r:.2f}" for r in tps)

    readme = (ROOT / "README.md").read_text()
    short = ratios("serve_world1_qwen3_30b_a3b_budgets_h100.json", "256x64", "ll@512")
    long = ratios("serve_world1_qwen3_30b_a3b_prefill_budgets_h100.json", "2048x256", "ll")
    assert f"concurrency 1 / 8 / 32 / 128 | {short} |" in readme
    assert f"concurrency 8 / 32 | {long} (" in readme
