"""The `dsc` command line. The only module that prints or draws progress bars.

Exit codes: 0 success, 1 a data or runtime error (one line on stderr), 2 a usage error,
130 interrupted.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer
from tqdm import tqdm

from dsc.compiler import compile_folder
from dsc.compiler.decode import DEFAULT_MAX_PIXELS, turbojpeg_library
from dsc.compiler.resize import FITS, Target, parse_size
from dsc.errors import CompileError, DscError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="dsc: compile image folders into memory-mappable uint8 shards, and read them fast.")


@app.callback()
def main() -> None:
    """dsc: compile image folders into memory-mappable uint8 shards, and read them fast."""


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _size_option(value: str) -> str:
    try:
        Target(*parse_size(value))
    except CompileError as e:
        raise typer.BadParameter(str(e)) from e
    return value


def _human_bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


@app.command("compile")
def compile_command(
    src: Path = typer.Argument(..., metavar="SRC", help="Image folder: one sub-folder per class (or images directly)."),
    out: Path = typer.Argument(..., metavar="OUT",
                               help="Dataset folder to create (built aside, then renamed into place)."),
    size: str = typer.Option("224", "--size", callback=_size_option,
                             help="Record size: N for N x N, or HxW (height x width)."),
    fit: str = typer.Option("center-crop", "--fit", help=f"How to reach the size: {', '.join(FITS)}."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the record order."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle",
                                 help="Store records in a seeded random order (default) or in sorted order."),
    workers: int = typer.Option(None, "--workers", "-j", min=1, help="Worker processes [default: all cores]."),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first bad image instead of skipping it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing dataset at OUT."),
    records_per_shard: int = typer.Option(None, "--records-per-shard", min=1,
                                          help="Records per shard file [default: as many as fit in 1 GiB]."),
    max_pixels: int = typer.Option(DEFAULT_MAX_PIXELS, "--max-pixels", min=1,
                                   help="Skip images whose header declares more pixels (decompression bombs)."),
) -> None:
    """Compile an image folder into a dsc dataset of fixed-shape uint8 records."""
    if fit not in FITS:
        raise typer.BadParameter(f"{fit!r} is not one of {', '.join(FITS)}", param_hint="--fit")
    if turbojpeg_library() is None:
        typer.echo("note: libturbojpeg.so.0 not found, so JPEGs are decoded by Pillow's bundled libjpeg-turbo "
                   "(same pixels, slower). Install it with: apt-get install libturbojpeg0", err=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`, `docker stop`, schedulers: clean up as for Ctrl-C
    bar = tqdm(unit="img", desc="compiling", disable=None, file=sys.stderr, dynamic_ncols=True)

    def on_skip(source: str, reason: str) -> None:
        bar.write(f"skipped {source}: {reason}", file=sys.stderr)

    try:
        summary = compile_folder(src, out, size=size, fit=fit, seed=seed, shuffle=shuffle, workers=workers,
                                 strict=strict, force=force, records_per_shard=records_per_shard,
                                 max_pixels=max_pixels, progress=bar.update, on_skip=on_skip)
    except DscError as e:
        bar.close()
        _fail(str(e))
    except KeyboardInterrupt:
        bar.close()
        _fail(f"interrupted; {out} was not written", 130)
    bar.close()
    if not summary.labeled:
        typer.echo(f"note: {src} has no class sub-folders, so the dataset is unlabeled (label -1)", err=True)
    for name in summary.empty_classes:
        typer.echo(f"note: class folder {name!r} has no images (its label is kept)", err=True)
    h, w, c = summary.record_shape
    typer.echo(f"wrote {out}: {summary.kept} records of {h}x{w}x{c} uint8 in {summary.shards} shard(s), "
               f"{len(summary.classes)} classes, {len(summary.skipped)} skipped, "
               f"{_human_bytes(summary.bytes_on_disk)} on disk, {summary.seconds:.1f} s "
               f"({summary.images_per_second:.0f} images/s)")


if __name__ == "__main__":
    app()
