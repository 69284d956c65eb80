"""``flayer export``: a saved model (a device's personal model or the global one) -> ONNX and/or
ExecuTorch .pte, each verified against torch on sample inputs, with sizes and latency per sample."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from cli.common import CliError, write_json
from cli.report import table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a saved model to ONNX and ExecuTorch (.pte), with parity checks")
    p.add_argument("--state", required=True, metavar="PATH",
                   help="model file (safetensors) from 'flayer simulate --save-models', an edge client or the "
                        "coordinator")
    p.add_argument("--python-path", action="append", default=[], metavar="DIR",
                   help="folder holding the module of the federation's own model (its entry point); repeatable")
    p.add_argument("--format", default="all", choices=("onnx", "pte", "all"), help="what to write (default: all)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--training-program", action="store_true",
                   help="also write the ExecuTorch training program (<name>.train.pte) for devices without torch "
                        "(FedAvgCNN and fastText; ResNet-18 is refused)")
    p.add_argument("--batch", type=int, default=8, help="larger parity batch (a batch of 1 is always checked)")
    p.add_argument("--max-batch", type=int, default=64, help="upper bound of the .pte's dynamic batch")
    p.add_argument("--seq-len", type=int, default=200, help="fastText sample length")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs difference to torch (default 1e-4)")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per runtime (median)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch, onnxruntime and ExecuTorch")
    p.set_defaults(func=run)


def _check_dependencies(formats: tuple[str, ...], training: bool) -> None:
    from export.deps import MissingDependency, require_executorch, require_onnx

    try:
        if "onnx" in formats:
            require_onnx()
        if "pte" in formats or training:
            require_executorch()
    except MissingDependency as exc:
        raise CliError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    if args.verbose:
        return _run(args)
    # the exporters log and warn a lot about things that do not matter here; -v shows it all
    quiet = {name: logging.getLogger(name) for name in ("torch", "torchao", "executorch", "onnxscript")}
    levels = {name: log.level for name, log in quiet.items()}
    try:
        for log in quiet.values():
            log.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(args)
    finally:
        for name, log in quiet.items():
            log.setLevel(levels[name])


def _run(args: argparse.Namespace) -> int:
    import torch

    from export.et_training import UnsupportedModel
    from export.pipeline import ExportOptions, export_model
    from export.verify import NonFiniteModel
    from flayer.state import StateFileError, load_model

    formats = ("onnx", "pte") if args.format == "all" else (args.format,)
    if args.python_path:
        from flayer.config import ConfigError, add_python_path

        try:
            add_python_path(list(args.python_path), Path.cwd(), "--python-path:")
        except ConfigError as exc:
            raise CliError(str(exc)) from exc
    try:
        opts = ExportOptions(formats=formats, batch=args.batch, seq_len=args.seq_len, max_batch=args.max_batch,
                             tolerance=args.tolerance, repeats=args.repeats, threads=args.threads,
                             training_program=args.training_program)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    _check_dependencies(formats, args.training_program)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    state = Path(args.state)
    try:
        model, spec, meta = load_model(state)
    except StateFileError as exc:
        raise CliError(str(exc)) from exc
    if args.training_program:
        from export.et_training import check_training_support

        try:
            check_training_support(spec)
        except UnsupportedModel as exc:
            raise CliError(f"--training-program: {exc}") from exc
    print(f"{state}: {spec.name} ({meta.get('role', 'model')}), {sum(p.numel() for p in model.parameters()):,} "
          f"parameters", file=sys.stderr)
    try:
        report = export_model(model, spec, args.out, state.stem, opts,
                              on_progress=lambda msg: print(f"  {msg} ...", file=sys.stderr))
    except NonFiniteModel as exc:
        raise CliError(f"{state}: {exc}") from exc
    rows = [("torch eager", "-", "-", "-", f"{report.torch_latency_ms:.3f}")]
    for r in report.results:
        lat = "-" if r.latency_ms is None else f"{r.latency_ms:.3f}"
        rows.append((r.format, str(r.path), f"{r.bytes / 1e6:.2f}", f"{r.max_abs_diff:.2e}" + ("" if r.ok else " FAIL"),
                     lat))
    print(table(["runtime", "file", "MB", "max |diff|", "ms/sample (batch 1)"], rows))
    summary = {"state": str(state), "spec": vars(spec), "torch_latency_ms_per_sample": report.torch_latency_ms,
               "threads": args.threads or torch.get_num_threads(), "results": [r.as_dict() for r in report.results]}
    write_json(Path(args.out) / f"{state.stem}.export.json", summary)
    if not report.ok:
        bad = ", ".join(f"{r.format} ({r.max_abs_diff:.3g})" for r in report.results if not r.ok)
        print(f"flayer export: parity above {opts.tolerance:g} for {bad}; those files were renamed *.rejected",
              file=sys.stderr)
        return 1
    print(f"every export matches torch within {opts.tolerance:g}; outputs in {args.out}/", file=sys.stderr)
    return 0
