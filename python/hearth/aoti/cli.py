"""`python3 -m hearth.aoti export MODEL ...`: the command line over export(),
MODEL being the callable that builds the nn.Module."""

import argparse
import importlib
import importlib.util
import os
import re
import sys

from .exporter import export, unavailable_reason
from .messages import ExportError
from .repository import MAX_BATCH_SIZE


# ---- the model --------------------------------------------------------------


def _load_target(spec):
    """`path/to/file.py:name` or `package.module:name` -> (object, description)."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ExportError(f"{spec!r}: expected FILE.py:CALLABLE or MODULE:CALLABLE")
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise ExportError(f"{module_part}: no such file")
        # Its own directory first, as when it runs as a script: it may import
        # modules beside it.
        sys.path.insert(0, os.path.dirname(path))
        name = "_hearth_aoti_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ExportError(f"{module_part} failed to import: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise ExportError(f"{module_part} failed to import: {type(e).__name__}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ExportError(f"{module_part} has no attribute {attr!r}") from None


def build_module(spec):
    """Calls the callable that `spec` names and returns its nn.Module (an
    nn.Module object named directly is taken as it is)."""
    import torch

    target = _load_target(spec)
    if isinstance(target, torch.nn.Module):
        return target
    if not callable(target):
        raise ExportError(f"{spec} is a {type(target).__name__}, not a callable")
    try:
        module = target()
    except Exception as e:
        raise ExportError(f"{spec}() raised {type(e).__name__}: {e}") from e
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"{spec}() returned {type(module).__name__}, not a torch.nn.Module")
    return module


# ---- command line -----------------------------------------------------------


def _shape(text):
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: comma-separated positive integers, batch first") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be at least 1")
    return tuple(dims)


def _range(text):
    m = re.fullmatch(r"(\d+)\.\.(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN..MAX (e.g. 1..64)")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1 <= lo <= hi <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= MIN <= MAX <= {MAX_BATCH_SIZE}")
    return lo, hi


def _names(text):
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: empty name")
    return names


def _parser():
    parser = argparse.ArgumentParser(
        prog="python3 -m hearth.aoti",
        description="Compile a PyTorch model with AOTInductor into a model version of "
                    "hearth's aoti backend.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    e = commands.add_parser(
        "export", help="export an nn.Module as model.pt2 + model.safetensors + config.yaml",
        description="Exports the nn.Module that MODEL returns: OUT/model.pt2 (the compiled "
                    "package, without weights), OUT/model.safetensors (its constants, under the "
                    "package's names) and OUT/../config.yaml.",
        epilog="example: python3 -m hearth.aoti export my_model.py:build "
               "--example-input-shape 16,16384 --dynamic-batch 1..64 --out repo/mymodel/1/")
    e.add_argument("model", metavar="MODEL",
                   help="FILE.py:CALLABLE or MODULE:CALLABLE, called with no arguments, "
                        "returning a torch.nn.Module (on any device)")
    e.add_argument("--example-input-shape", type=_shape, action="append", required=True,
                   metavar="B,D1,...", dest="shapes",
                   help="an example input's shape, batch first; once per input, in call order")
    e.add_argument("--dtype", action="append", metavar="DTYPE", dest="dtypes",
                   help="the inputs' dtype: float32 (default), float16, bfloat16, float64, "
                        "int64, int32 or bool; once for all inputs or once per input")
    e.add_argument("--weights-dtype", metavar="DTYPE",
                   help="cast the module's floating parameters and buffers to float32, "
                        "float16 or bfloat16 (default: as built)")
    e.add_argument("--dynamic-batch", type=_range, metavar="MIN..MAX",
                   help="make the batch dimension of every input dynamic in MIN..MAX "
                        "(config: max_batch_size MAX); without it the batch is fixed to the "
                        "example's (config: max_batch_size 0, whole shapes as dims)")
    e.add_argument("--device", help="cuda or cpu (default: cuda if torch sees one)")
    e.add_argument("--input-names", type=_names, metavar="A,B,...",
                   help="default: input (one input) or input__0, input__1, ...")
    e.add_argument("--output-names", type=_names, metavar="A,B,...",
                   help="default: output (one output) or output__0, output__1, ...")
    e.add_argument("--name", help="the model's name in config.yaml; must be, and defaults to, "
                                  "the name of OUT's parent directory")
    e.add_argument("--workers", type=int, default=1, metavar="N",
                   help="instance_group count (default 1)")
    e.add_argument("--standby-workers", type=int, default=1, metavar="N",
                   help="parameters.standby_workers: processes kept with libtorch loaded, that "
                        "replace a worker that dies (default 1; 0: none)")
    e.add_argument("--out", required=True, metavar="OUT",
                   help="the version directory, e.g. repo/mymodel/1/")
    e.add_argument("--force", action="store_true",
                   help="replace existing model.pt2, model.safetensors and config.yaml")
    e.add_argument("--traceback", action="store_true", help="on failure, show the traceback")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        reason = unavailable_reason()
        if reason:
            raise ExportError(reason)
        module = build_module(args.model)
        export(module, args.out, args.shapes, dtypes=args.dtypes or ["float32"],
               weights_dtype=args.weights_dtype, dynamic_batch=args.dynamic_batch,
               device=args.device, input_names=args.input_names,
               output_names=args.output_names, name=args.name, workers=args.workers,
               standby_workers=args.standby_workers,
               force=args.force, source=args.model)
    except ExportError as e:
        if args.traceback:
            raise
        print(f"hearth.aoti: error: {e}", file=sys.stderr)
        return 1
    return 0
