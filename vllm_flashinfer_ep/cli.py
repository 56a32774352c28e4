"""`vllm-flashinfer-ep` command line: doctor, bench, bench-ht, bench-fp8, bench-memory, eval."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from vllm_flashinfer_ep import __version__, doctor
    from vllm_flashinfer_ep.bench import fp8_run as bench_fp8
    from vllm_flashinfer_ep.bench import ht_run as bench_ht
    from vllm_flashinfer_ep.bench import memory as bench_memory
    from vllm_flashinfer_ep.bench import run as bench
    from vllm_flashinfer_ep.evals import cli as evals

    parser = argparse.ArgumentParser(
        prog="vllm-flashinfer-ep",
        description="FlashInfer NCCL-EP all2all backends for vLLM: diagnostics, benchmark, evals.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    doctor.add_parser(sub)
    benchmarks = (
        ("bench", bench, "decode-step LL all2all benchmark (needs a GPU)"),
        (
            "bench-ht",
            bench_ht,
            "prefill-step HT all2all benchmark vs raw FlashInfer, and LL vs HT (needs a GPU)",
        ),
        (
            "bench-fp8",
            bench_fp8,
            "block-FP8 LL decode step (or HT step): BF16 vs FP8 on the wire, and bytes per dispatch (needs a GPU)",
        ),
        (
            "bench-memory",
            bench_memory,
            "device-wide GPU memory of the LL fleet and its handle pool (needs a GPU)",
        ),
    )
    for name, module, text in benchmarks:
        sub_parser = sub.add_parser(
            name,
            help=text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(func=module.main)
    evals.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    args.argv = argv  # doctor builds the engine config from the serve arguments as given
    if unknown:
        if not getattr(args, "accepts_serve_args", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # doctor takes `vllm serve` arguments: it reads those it checks, ignores the rest.
        from vllm_flashinfer_ep.doctor import split_eplb_overrides

        args.eplb_overrides, args.ignored_serve_args = split_eplb_overrides(unknown)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
