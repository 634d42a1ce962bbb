"""The `dsc` command line. The only module that prints or draws progress bars.

What is imported here is light (no torch, no tensordict), so `dsc --help`, `info`, `verify` and
`show` start at once and `compile` starts its workers before it has imported much; the two
commands that need the reader or the decoders import them in their bodies: `bench` and
`verify --decode`.

Exit codes: 0 success, 1 a data or runtime error (one line on stderr), 2 a usage error,
130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import typer
from tqdm import tqdm

from dsc.compiler.decode import DEFAULT_MAX_PIXELS
from dsc.compiler.engines import ENGINES, MAX_WORKERS
from dsc.compiler.engines.supervisor import MAX_STALL_S
from dsc.compiler.labels import parse_column_kinds
from dsc.compiler.pipeline import compile_folder
from dsc.compiler.publish import pending_publish, staging_path
from dsc.compiler.sources import archive_sources
from dsc.compiler.target import FITS, Target, parse_size
from dsc.errors import CompileError, DscError, Interrupted
from dsc.format import ALPHA, MANIFEST_FILE, MAX_RECORDS, minor_version
from dsc.storage import check_skip_list, is_url, open_dataset, parse_manifest, verify_checksums
from dsc.storage.object_file import is_url as is_object_url
from dsc.tools.inspect_dataset import COUNTED_UNASKED
from dsc.tools.inspect_dataset import summary as inspect_summary
from dsc.tools.sheet import MAX_TILES, pick_records, save_sheet
from dsc.version import __version__

SHOW_SKIPPED = 20  # skipped files listed by `dsc info` before "... and N more"
SHOW_CLASSES = 20  # classes (of the label, of a field) listed with their counts before "..."
DECODE_MEAN_LIMIT = 1.0  # `verify --decode`: the same pipeline gives identical pixels; allow other builds' rounding
# Bounds of options that would otherwise run without end or ask for what no machine has:
MAX_BENCH_SECONDS = 3600.0  # `bench --seconds`: per measurement, and there are up to ten (`--seconds inf`: never)
MAX_THREADS = 256  # `bench --threads`: copy threads; more only contend for the same memory bandwidth
MAX_PIXELS_LIMIT = 1 << 40  # `compile --max-pixels`: a terapixel; a larger header is a lie, never an image

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="dsc: compile image folders into memory-mappable uint8 shards, and read them fast.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dsc {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print dsc's version and exit.")) -> None:
    """dsc: compile image folders into memory-mappable uint8 shards, and read them fast."""


def _clean(text: object) -> str:
    """Text from files (names, reasons) as one printable line: control characters escaped."""
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape", "backslashreplace").decode("ascii")


def _fail(*problems: str, code: int = 1) -> None:
    """One `error:` line per problem on stderr, then exit with `code`."""
    for problem in problems:
        typer.echo(f"error: {_clean(problem)}", err=True)
    raise typer.Exit(code)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _size_option(value: str) -> str:
    try:
        Target(*parse_size(value))
    except CompileError as e:
        raise typer.BadParameter(str(e)) from e
    return value


def _count(n: int, one: str, many: str | None = None) -> str:
    """'1 record', '2 records'."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def _human_bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def _path(value: str) -> Path:
    """A path argument, refusing an empty one: Path("") is ".", so `dsc compile $SRC out` with $SRC
    unset would otherwise compile the current folder."""
    if not value:
        raise typer.BadParameter("is empty (an unset shell variable?)")
    return Path(value)


def _names_archives(src: Path | str) -> bool:
    """SRC names archive sources (or may: a pattern, URL or name that fails to list is the compile's to report)."""
    try:
        return archive_sources(src) is not None
    except (DscError, OSError):  # (OSError: a name too long for the file system)
        return True


def _source(value: str) -> Path | str:
    """SRC: a path, or an `s3://` URL kept as written (a Path would fold its '//')."""
    return value if is_object_url(value) else _path(value)


@app.command("compile")
def compile_command(
    src: Path = typer.Argument(..., metavar="SRC", parser=_source,
                               help="Image folder: one sub-folder per class (or images directly); or archives: "
                               "WebDataset tar shards (a file, a folder, a glob or a {000..099} pattern), "
                               "Parquet files (a file or a folder), a zip of an image folder; any of these "
                               "as s3:// URLs."),
    out: Path = typer.Argument(..., metavar="OUT", parser=_source,
                               help="Dataset folder to create (built aside, then renamed into place), or an "
                               "s3://bucket/prefix to compile into (committed there as a new version)."),
    size: str = typer.Option("224", "--size", callback=_size_option, metavar="N|HxW",
                             help="Record size: N for N x N, or HxW (height x width)."),
    fit: str = typer.Option("center-crop", "--fit", metavar="FIT", help=f"How to reach the size: {', '.join(FITS)}."),
    seed: int = typer.Option(0, "--seed", min=0, metavar="N", help="Seed of the record order."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle",
                                 help="Store records in a seeded random order (default) or in sorted order."),
    workers: int = typer.Option(None, "--workers", "-j", min=1, max=MAX_WORKERS, metavar="N",
                                help="Worker processes [default: all cores]."),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first bad image instead of skipping it."),
    force: bool = typer.Option(False, "--force",
                               help="Replace an existing dataset at OUT (and discard a partial build)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the partial build an interrupted compile left "
                                "(with --force: one that was to replace the dataset at OUT)."),
    engine: str = typer.Option("local", "--engine", metavar="local|ray",
                               help="Where to decode: local (processes here) or ray."),
    stall_seconds: float = typer.Option(None, "--stall-seconds", min=1, max=MAX_STALL_S, metavar="S",
                                        help="A worker that finishes no image for S seconds is stopped and its "
                                        "work retried by another; an image two workers stalled on is skipped "
                                        "(Ray: the task is cancelled and retried; local: 2+ workers) [default: 300]."),
    address: str = typer.Option(None, "--address", metavar="ADDRESS",
                                help="Ray cluster address for --engine ray [default: start "
                                "a local one]."),
    records_per_shard: int = typer.Option(None, "--records-per-shard", min=1, max=MAX_RECORDS, metavar="N",
                                          help="Records per shard file [default: as many as fit in 1 GiB]."),
    max_pixels: int = typer.Option(DEFAULT_MAX_PIXELS, "--max-pixels", min=1, max=MAX_PIXELS_LIMIT, metavar="N",
                                   help="Skip images whose header declares more pixels (decompression bombs)."),
    fast_decode: bool = typer.Option(False, "--fast-decode",
                                     help="Scale JPEGs down in the DCT domain to just the needed size: faster, "
                                     "less faithful (mean |diff| per record up to ~6-10 of 255 at sizes 64-224, "
                                     "~20 at 32) [default: full decode]."),
    alpha: str = typer.Option("black", "--alpha", metavar="black|white|drop",
                              help="Transparent pixels: composited onto black, onto white, or dropped (the "
                              "stored RGB, as Pillow's convert('RGB') and torchvision's ImageFolder keep it)."),
    classes: str = typer.Option(None, "--classes", metavar="NAMES|FILE",
                                help="Fix the class vocabulary: comma-separated names, or a file of names "
                                "(one per line); label k is the k-th name."),
    classes_from: Path = typer.Option(None, "--classes-from", metavar="DATASET",
                                      help="Take the class vocabulary from another dsc dataset (e.g. the "
                                      "training split), so that every split gives a class the same label."),
    skip_unknown_classes: bool = typer.Option(False, "--skip-unknown-classes",
                                              help="Skip images of classes outside --classes/--classes-from "
                                              "instead of failing."),
    labels: Path = typer.Option(None, "--labels", metavar="TABLE",
                                help="Labels from a CSV (header; path first) or JSONL (\"path\" key) table: only "
                                "listed images are compiled; the 'label' column is the class label, other "
                                "columns become fields."),
    column: list[str] = typer.Option(None, "--column", metavar="NAME:KIND",
                                     help="The kind of a --labels column: class, multilabel, float or int "
                                     "[default: inferred]; label:none for a table without labels. Archives: "
                                     "a Parquet column, a tar member suffix (txt) or json:FIELD made a field of "
                                     "that kind. Repeatable."),
    label_key: str = typer.Option(None, "--label-key", metavar="KEY",
                                  help="Archives: the label's tar member (cls: an integer, txt: a class name, "
                                  "json:FIELD) or Parquet column [default: .cls; the ClassLabel column, else "
                                  "'label']."),
    image_column: str = typer.Option(None, "--image-column", metavar="NAME",
                                     help="Parquet: the column of the images (an Image struct or bytes) "
                                     "[default: the Image feature, else the only such column]."),
) -> None:
    """Compile an image folder into a dsc dataset of fixed-shape uint8 records."""
    if fit not in FITS:
        raise typer.BadParameter(f"{fit!r} is not one of {', '.join(FITS)}", param_hint="--fit")
    if alpha not in ALPHA:
        raise typer.BadParameter(f"{alpha!r} is not one of {', '.join(ALPHA)}", param_hint="--alpha")
    if engine not in ENGINES:
        raise typer.BadParameter(f"{engine!r} is not one of {', '.join(ENGINES)}", param_hint="--engine")
    if address is not None and engine != "ray":
        raise typer.BadParameter("only with --engine ray", param_hint="--address")
    if column and labels is None and not _names_archives(src):
        raise typer.BadParameter("only with --labels (it gives a label table column its kind), or with archive "
                                 "sources (a Parquet column or tar member as a field)", param_hint="--column")
    if classes is not None and classes_from is not None:
        raise typer.BadParameter("give --classes or --classes-from, not both", param_hint="--classes")
    if skip_unknown_classes and classes is None and classes_from is None:
        raise typer.BadParameter("only with --classes or --classes-from (without, every class is known)",
                                 param_hint="--skip-unknown-classes")
    try:
        if classes_from is not None and not (classes_from / MANIFEST_FILE).is_file():
            raise typer.BadParameter(f"{classes_from} does not exist" if not classes_from.exists() else
                                     f"{classes_from} is not a dsc dataset (no {MANIFEST_FILE}); for a file of class "
                                     "names use --classes FILE", param_hint="--classes-from")
    except OSError as e:  # a name too long
        raise typer.BadParameter(f"{classes_from}: {e.strerror or e}", param_hint="--classes-from") from None
    vocabulary = classes_from if classes_from is not None else classes  # names or a path: classes.classes_option
    try:
        kinds = parse_column_kinds(column or [])
    except DscError as e:
        raise typer.BadParameter(str(e), param_hint="--column") from None
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`, `docker stop`, schedulers: clean up as for Ctrl-C
    bar = _CompileProgress()
    try:
        with _log_lines(lambda line: bar.write(f"warning: {_clean(line)}")):
            summary = compile_folder(src, out, size=size, fit=fit, seed=seed, shuffle=shuffle, workers=workers,
                                     strict=strict, force=force, records_per_shard=records_per_shard,
                                     max_pixels=max_pixels, resume=resume, engine=engine, address=address,
                                     stall_seconds=stall_seconds,
                                     fast_decode=fast_decode, alpha=alpha, classes=vocabulary,
                                     skip_unknown_classes=skip_unknown_classes, labels=labels, columns=kinds or None,
                                     label_key=label_key, image_column=image_column,
                                     on_found=bar.advance, on_total=bar.total, progress=bar.advance,
                                     on_skip=lambda source, reason: bar.write(f"skipped {_clean(source)}: "
                                                                              f"{_clean(reason)}"))
    except DscError as e:
        bar.close()
        _fail(str(e))
    except KeyboardInterrupt as e:
        bar.close()
        _fail(str(e) if isinstance(e, Interrupted) else _interrupted(out.absolute()) if isinstance(out, Path) else
              f"interrupted; {out} holds what it held before or the new dataset, never a mix: add --resume "
              "to continue", code=130)
    bar.close()
    if summary.reused:
        typer.echo(f"note: resumed: {summary.reused} of {summary.built} sources were done already", err=True)
    if not summary.labeled and labels is None:
        typer.echo(f"note: {src} has no class sub-folders, so the dataset is unlabeled (label -1)"
                   if archive_sources(src) is None else
                   f"note: the samples of {src} have no labels, so the dataset is unlabeled (label -1)", err=True)
    if summary.ignored:
        typer.echo(f"note: {summary.ignored} image(s) in {src} are not listed in {labels} and were not compiled",
                   err=True)
    for f in inspect_summary(out, every_skip=False)["fields"] if summary.fields else []:
        typer.echo(f"field {f['name']}: {_describe_field(f)}", err=True)
    for name in summary.empty_classes:  # a vocabulary's class may have no folder at all (--classes, --classes-from)
        typer.echo(f"note: class folder {name!r} has no images (its label is kept)"
                   if labels is None and isinstance(src, Path) and (src / name).is_dir() else
                   f"note: class {name!r} has no images (its label index is kept)", err=True)
    h, w, c = summary.record_shape
    typer.echo(f"wrote {out}: {_count(summary.kept, 'record')} of {h}x{w}x{c} uint8 in {summary.shards} shard(s), "
               f"{_count(len(summary.classes), 'class', 'classes')}, {len(summary.skipped)} skipped, "
               f"{_human_bytes(summary.bytes_on_disk)} {'on disk' if isinstance(out, Path) else 'in the bucket'}, "
               f"{summary.seconds:.1f} s "
               f"({summary.images_per_second:.0f} images/s)")


class _CompileProgress:
    """The compile's two bars on stderr (only on a terminal): a running count of the images
    discovery finds, left on screen once it is done, then n/total with rate and ETA."""

    def __init__(self) -> None:
        self._bar = tqdm(unit="img", desc="discovering", disable=None, file=sys.stderr, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        """n more images found (discovery) or done (compiling)."""
        self._bar.update(n)

    def total(self, n: int) -> None:  # discovery is done: from here on, n/total, rate and ETA
        self._bar.close()
        self._bar = tqdm(total=n, unit="img", desc="compiling", disable=None, file=sys.stderr, dynamic_ncols=True)

    def write(self, line: str) -> None:
        """A line above the bar (a skip, a warning), which keeps drawing below it."""
        self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def _describe_field(f: dict) -> str:
    """One line about a field (`inspect_dataset.field_summary`): kind, dtype, shape, vocabulary, values."""
    shape = f"[{', '.join(map(str, f['shape']))}]" if f["shape"] else "scalar"
    line = f"{f['kind']}, {f['dtype']} {shape}"
    if f["classes"]:
        line += f", {len(f['classes'])} classes"
        if "counts" in f:
            shown = list(zip(f["classes"], f["counts"]))[:SHOW_CLASSES]
            line += ": " + _clean(", ".join(f"{k} ({n})" for k, n in shown))
            line += ", ..." if len(f["classes"]) > SHOW_CLASSES else ""
    if "min" in f:
        line += f", values {f['min']:g} to {f['max']:g}"
    return line


@contextlib.contextmanager
def _log_lines(write: Callable[[str], None]):
    """Show what the library logs on the "dsc" logger (a kept source's oddity, splits that disagree) as
    one line each through `write`, instead of Python's default stderr handler."""
    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            write(record.getMessage())

    logger, handler = logging.getLogger("dsc"), Lines(logging.WARNING)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _interrupted(out: Path) -> str:
    """Say truly where an interrupted compile stopped (it may have published already)."""
    partial = staging_path(out)
    if pending_publish(out) is not None:
        return (f"interrupted while publishing {out}; it holds the previous dataset or the new one, never a mix: "
                "add --resume to finish")
    if partial.exists():
        return f"interrupted; {out} was not written; the work so far is kept in {partial}: add --resume to continue"
    return f"interrupted; {out} was not written"


def _dataset_argument(urls: bool = False) -> Path:
    return typer.Argument(..., metavar="DATASET", help="A compiled dsc dataset folder" + (
        ", or an s3://bucket/prefix URL (its files are cached in $DSC_CACHE_DIR, else ~/.cache/dsc)." if urls else "."))


def _fail_dataset(location: str | Path, e: DscError) -> None:
    """A dataset that cannot be opened; where it is missing because a compile was interrupted, say so."""
    problems = [*(getattr(e, "problems", None) or [str(e)])]
    if not is_url(location) and _left_partial(Path(location)):
        dataset = Path(location)
        problems.append(f"an interrupted compile left its work in {staging_path(dataset.absolute())}: run that "
                        "compile again with --resume to finish it")
    _fail(*problems)


def _left_partial(dataset: Path) -> bool:
    """Whether an interrupted compile of `dataset` left its work beside it; False where the name cannot be
    looked up at all (a name too long for its staging name, a folder that cannot be searched)."""
    try:
        return not dataset.exists() and staging_path(dataset.absolute()).is_dir()
    except OSError:
        return False


def _versioned_command(run: Callable[[], object], dataset: Path) -> object:
    """Run an append or a prune, reporting a refusal as one line (exit 1) and an interruption truly."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run()
    except DscError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail(f"interrupted; {dataset} was left at its previous version (what was written before its commit is "
              "cleared by the next append or prune; in a bucket, by a prune a day later)", code=130)


@app.command("append")
def append_command(
    dataset: Path = typer.Argument(..., metavar="DATASET", parser=_source,
                                   help="A compiled dsc dataset folder, or an s3://bucket/prefix URL."),
    src: Path = typer.Argument(..., metavar="SRC", parser=_source, help="Image folder with the images to add."),
    labels: Path = typer.Option(None, "--labels", metavar="TABLE",
                                help="Labels and fields of the new images from a label table, as for compile."),
    column: list[str] = typer.Option(None, "--column", metavar="NAME:KIND",
                                     help="The kind of a --labels column [default: the dataset's]. Repeatable."),
    new_classes: bool = typer.Option(False, "--new-classes",
                                     help="Allow classes the dataset lacks (added at the end; existing indices "
                                     "never change) [default: refuse them]."),
    workers: int = typer.Option(None, "--workers", "-j", min=1, max=MAX_WORKERS, metavar="N",
                                help="Worker processes [default: all cores]."),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first bad image instead of skipping it."),
    again: bool = typer.Option(False, "--again", help="Append even when the dataset's last append added the same "
                               "images of SRC [default: refuse, as a re-run after a kill that hid the commit would "
                               "add them twice]."),
) -> None:
    """Add the images of SRC to a dataset as its next version, decoding only SRC, with the dataset's options."""
    from dsc.compiler.append import append

    if column and labels is None:
        raise typer.BadParameter("only with --labels (it gives a label table column its kind)", param_hint="--column")
    try:
        kinds = parse_column_kinds(column or [])
    except DscError as e:
        raise typer.BadParameter(str(e), param_hint="--column") from None
    bar = _CompileProgress()
    with _log_lines(lambda line: bar.write(f"warning: {_clean(line)}")):
        s = _versioned_command(lambda: append(
            dataset, src, labels=labels, columns=kinds or None, new_classes=new_classes, workers=workers,
            strict=strict, on_total=bar.total, progress=bar.advance, again=again,
            on_skip=lambda source, reason: bar.write(f"skipped {_clean(source)}: {_clean(reason)}")), dataset)
    bar.close()
    if s.new_classes:
        typer.echo(f"note: new classes, added at the end: {_clean(', '.join(s.new_classes))}", err=True)
    typer.echo(f"appended to {s.dataset}: version {s.version}, {_count(s.added, 'new record')} "
               f"({s.count:,} in all), {s.skipped} skipped, {s.seconds:.1f} s")


@app.command("merge")
def merge_command(
    datasets: list[Path] = typer.Argument(..., metavar="A B [C ...] OUT", parser=_source,
                                          help="Datasets to join (their latest versions), then the dataset to create."),
    force: bool = typer.Option(False, "--force", help="Replace an existing dataset at OUT."),
) -> None:
    """Join datasets of one record shape into a new one without decoding: classes matched by name."""
    from dsc.compiler.merge import merge

    if len(datasets) < 3:
        raise typer.BadParameter("give at least two datasets and the output", param_hint="A B [C ...] OUT")
    *inputs, out = datasets
    try:
        with _log_lines(lambda line: typer.echo(f"warning: {_clean(line)}", err=True)):
            s = merge(inputs, out, force=force)
    except DscError as e:
        _fail(str(e))
    reused = sum(h != "copy" for h in s.shard_files)
    typer.echo(f"wrote {s.out}: {_count(s.count, 'record')} from {len(inputs)} datasets, "
               f"{_count(len(s.classes), 'class', 'classes')}, {len(s.shard_files)} shard(s) ({reused} reused by "
               f"{'/'.join(sorted({h for h in s.shard_files if h != 'copy'})) or 'link'}, "
               f"{len(s.shard_files) - reused} copied), {s.seconds:.1f} s")


@app.command("prune")
def prune_command(
    dataset: Path = typer.Argument(..., metavar="DATASET", parser=_source,
                                   help="A compiled dsc dataset folder, or an s3://bucket/prefix URL."),
    keep: int = typer.Option(..., "--keep", min=1, metavar="N", help="How many of the newest versions to keep."),
) -> None:
    """Delete the old versions of a dataset and the files no kept version uses (only files dsc made)."""
    from dsc.compiler.versions import prune

    with _log_lines(lambda line: typer.echo(f"warning: {_clean(line)}", err=True)):
        s = _versioned_command(lambda: prune(dataset, keep), dataset)
    kept = (f"kept version(s) {s.kept[0]}" + (f" to {s.kept[-1]}" if len(s.kept) > 1 else "") if s.kept
            else "no dataset yet (only partial builds)")
    aborted = f"; aborted {_count(len(s.aborted_uploads), 'unfinished upload')}" if s.aborted_uploads else ""
    typer.echo(f"{kept} of {dataset}; removed {_count(len(s.removed_versions), 'version')} and "
               f"{_count(len(s.removed_files), 'file')} ({_human_bytes(s.bytes_freed)}){aborted}")


@app.command("info")
def info_command(
    dataset: str = _dataset_argument(urls=True),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    version: int = typer.Option(None, "--version", min=1, metavar="N",
                                help="Which version of a dataset grown by dsc append [default: the latest]."),
    counts: bool = typer.Option(False, "--counts",
                                help=f"Read every record's label, fields and warnings to count them (done unasked "
                                     f"up to {COUNTED_UNASKED:,} records, and by --json); format 1.5 stores its "
                                     "records per class, so those are not read again (dsc verify checks them)."),
) -> None:
    """Summarise a dataset: records, shape, classes, skipped files, size, shards, compile options."""
    try:
        # the text shows SHOW_SKIPPED: no need to read them all; nor every label of a large dataset unasked
        s = inspect_summary(dataset, every_skip=as_json, version=version, counts=True if counts or as_json else None)
    except DscError as e:
        _fail_dataset(dataset, e)
    if as_json:
        typer.echo(json.dumps(s, indent=1))
        return
    h, w, c = s["record_shape"]
    typer.echo(f"{s['path']}: dsc format {s['format_version']}, {s['records']} records of {h}x{w}x{c} uint8, "
               f"{s['shards']} shard(s) of up to {s['records_per_shard']}, {_human_bytes(s['bytes_on_disk'])} "
               f"{'in the bucket' if is_url(dataset) else 'on disk'}")
    several = len(s["parts"]) > 1  # grown by appends, or merged: each part has its own sources and options
    made = [p["compile"] for p in s["parts"]]
    common = {k: v for k, v in made[0].items() if all(m.get(k) == v for m in made[1:])} if several else s["compile"]
    if s["versions"] != [1] or several:
        kept = f"version {s['version']} (kept: {', '.join(map(str, s['versions']))}); " if s["versions"] != [1] else ""
        typer.echo(kept + "records from " + _clean("; ".join(_part(p, common) for p in s["parts"])))
    if s["labeled"]:
        shown = list(s["classes"].items())[:SHOW_CLASSES]
        more = len(s["classes"]) - len(shown)
        typer.echo(f"{len(s['classes'])} classes: "
                   + ", ".join(_clean(k) + ("" if n is None else f" ({n})") for k, n in shown)
                   + (f", ... and {more} more (dsc info --json lists them all)" if more else "")
                   + (f"; {s['unlabeled']} record(s) without a label (-1)" if s["unlabeled"] else ""))
    else:
        typer.echo("unlabeled (every label is -1)")
    for f in s["fields"]:
        typer.echo(f"field {f['name']}: {_describe_field(f)}")
    options = {k: v for k, v in common.items() if k not in PART_KEYS[several]}
    typer.echo(("compiled with: " if not several else "every part compiled with: ")
               + _clean(", ".join(f"{k}={v}" for k, v in options.items())))
    typer.echo(_clean(f"from: {'the parts above' if several else s['compile'].get('source_root')}; JPEG decoder: "
                      f"{s['jpeg_decoder']}"))
    uncounted = [] if s["counted"] else [what for what, there in (
        ("records per class", s["labeled"] and s["unlabeled"] is None),  # 1.5 stores them: shown uncounted too
        ("field values", s["fields"]), ("decoder warnings", s["has_warnings"])) if there]
    if uncounted:
        typer.echo(f"not counted: {', '.join(uncounted)} (dsc info --counts reads every one of the {s['records']:,} "
                   "records' values)")
    if s["stored_counts_problem"]:
        typer.echo(_clean(f"stored class counts not used: {s['stored_counts_problem']} (dsc verify checks the rest)"))
    if s["warned"]:
        typer.echo(f"{len(s['warned'])} record(s) kept despite decoder warnings "
                   f"({sum(w['warnings'] for w in s['warned'])} in all; see the compile's log for what they said):")
        for item in s["warned"][:SHOW_SKIPPED]:
            typer.echo(f"  record {item['record']} {_clean(item['source'])}: {item['warnings']} warning(s)")
        if len(s["warned"]) > SHOW_SKIPPED:
            typer.echo(f"  ... and {len(s['warned']) - SHOW_SKIPPED} more (dsc info --json lists them all)")
    typer.echo(f"{s['skipped_count']} skipped" + (":" if s["skipped"] else ""))
    for item in s["skipped"][:SHOW_SKIPPED]:
        typer.echo(f"  {_clean(item['source'])}: {_clean(item['reason'])}")
    if s["skipped_count"] > SHOW_SKIPPED:
        typer.echo(f"  ... and {s['skipped_count'] - SHOW_SKIPPED} more (dsc info --json lists them all)")


PART_KEYS = {False: ("source_root", "jpeg_decoder", "source_order"),  # said on lines of their own
             True: ("source_root", "jpeg_decoder", "source_order", "sources_found", "dsc_version")}  # said per part


def _part(part: dict, common: dict) -> str:
    """A part of a grown or merged dataset for `dsc info`: its records, where they came from, how many sources
    its compile found, and its options that not every part shares (`common`: those every part does)."""
    differ = {k: v for k, v in part["compile"].items() if k not in PART_KEYS[True] and common.get(k) != v}
    found = part["compile"].get("sources_found")
    return (f"{part['first']}-{part['first'] + part['count'] - 1}: {part['source_root']}"
            + (f" ({found} sources found)" if found is not None else "")
            + "".join(f", {k}={v}" for k, v in differ.items()))


@app.command("verify")
def verify_command(
    dataset: str = _dataset_argument(urls=True),
    decode: int = typer.Option(0, "--decode", min=0, metavar="N",
                               help="Also re-decode N random records from their source files and compare."),
    seed: int = typer.Option(0, "--seed", min=0, metavar="N", help="Seed of the records --decode picks."),
    version: int = typer.Option(None, "--version", min=1, metavar="N",
                                help="Which version of a dataset grown by dsc append [default: the latest]."),
) -> None:
    """Check a dataset: the manifest, every file size and checksum, and optionally records against sources."""
    try:
        opened = open_dataset(dataset, version=version)
        manifest = opened.manifest
        total = sum(e.bytes for e in manifest.files)
        with tqdm(total=total, unit="B", unit_scale=True, desc="checksums", disable=None, file=sys.stderr) as bar:
            verify_checksums(dataset, manifest, progress=bar.update)
        check_skip_list(opened)
    except DscError as e:
        _fail_dataset(dataset, e)
    fields = f", {len(manifest.fields)} field file(s)" if manifest.fields else ""
    unsealed = "" if minor_version(manifest.version) >= 2 else f" (format {manifest.version}: no checksum of its own)"
    which = f" of version {manifest.dataset_version}" if manifest.dataset_version > 1 or version else ""
    typer.echo(f"ok: manifest{which}{unsealed}, {len(manifest.shards)} shard(s){fields} and index files match "
               f"({_human_bytes(opened.stored_bytes)}); the skip list names no stored source")
    if decode:
        from dsc.tools.recheck import check_against_sources  # the decoders and torch: only for --decode

        try:
            check = check_against_sources(dataset, decode, seed)
        except DscError as e:
            _fail(str(e))
        for line in check.missing:
            typer.echo(f"not checked: {_clean(line)}", err=True)
        if check.worst_record is None:
            _fail(f"none of the {decode} records could be checked: their sources are gone or unreadable")
        typer.echo(f"decoded {check.checked} record(s) again: worst difference record {check.worst_record} "
                   f"({check.worst_source}): max {check.worst_max_abs}, mean {check.worst_mean_abs:.3f}")
        if check.worst_mean_abs > DECODE_MEAN_LIMIT:
            _fail(f"record {check.worst_record} differs from its source {check.worst_source} "
                  f"(mean abs difference {check.worst_mean_abs:.2f} > {DECODE_MEAN_LIMIT})")


@app.command("show")
def show_command(
    dataset: str = _dataset_argument(urls=True),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE", help="Image file to write (PNG, JPEG, ...)."),
    n: int = typer.Option(36, "--n", min=1, max=MAX_TILES, metavar="N", help="How many random records to show."),
    indices: str = typer.Option(None, "--indices", metavar="I,J,...",
                                help="Comma-separated record indices instead (e.g. 0,5,9)."),
    class_name: str = typer.Option(None, "--class", metavar="NAME", help="Only records of this class."),
    seed: int = typer.Option(0, "--seed", min=0, metavar="N", help="Seed of the random pick."),
    columns: int = typer.Option(None, "--columns", min=1, max=MAX_TILES, metavar="N",
                                help="Tiles per row [default: a square grid]."),
) -> None:
    """Draw a contact sheet of records with their index and label, to check a compile by eye."""
    if indices is not None and class_name is not None:
        raise typer.BadParameter("give --class or --indices, not both", param_hint="--class")
    try:
        picked = [int(v) for v in indices.split(",") if v.strip()] if indices else None
    except ValueError:
        raise typer.BadParameter(f"{indices!r} is not a comma-separated list of integers",
                                 param_hint="--indices") from None
    try:
        records = pick_records(open_dataset(dataset), n, picked, class_name, seed)
        width, height = save_sheet(dataset, output, records, columns)
    except DscError as e:
        _fail_dataset(dataset, e)
    typer.echo(f"wrote {output}: {len(records)} records, {width}x{height} pixels")


@app.command("bench")
def bench_command(
    dataset: str = _dataset_argument(urls=True),
    batch_size: int = typer.Option(256, "--batch-size", "-b", min=1, metavar="N", help="Records per batch."),
    seconds: float = typer.Option(5.0, "--seconds", min=0.1, max=MAX_BENCH_SECONDS, metavar="S",
                                  help="Time budget per measurement."),
    threads: int = typer.Option(None, "--threads", min=1, max=MAX_THREADS, metavar="N",
                                help="Copy threads [default: up to 4 cores]."),
    cold: bool = typer.Option(True, "--cold/--no-cold", help="Also measure from a cold page cache."),
    device: str = typer.Option(None, "--device", metavar="DEVICE",
                               help="Add the host→device path, e.g. cuda (if present)."),
) -> None:
    """Measure read throughput of this dataset here, next to this machine's copy limit; name the bottleneck."""
    from dsc.reader.settings import resolve_device  # the reader (torch): only the command that reads with it
    from dsc.tools.bench import batch_problem, memory_bytes
    from dsc.tools.bench import run as run_bench

    try:
        with tempfile.TemporaryDirectory() as scratch:  # a URL: the bench's files go only in folders of its own
            record_shape = parse_manifest(dataset, scratch if is_url(dataset) else None).record_shape
    except DscError as e:
        _fail_dataset(dataset, e)
    if (problem := batch_problem(batch_size, record_shape, memory_bytes())) is not None:
        raise typer.BadParameter(problem, param_hint="--batch-size")
    try:
        on_host = device is not None and resolve_device(device) is None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--device") from None
    if on_host:
        typer.echo(f"note: --device {device} is the host path the other rows already measure", err=True)
        device = None
    if device is not None and is_url(dataset):
        raise typer.BadParameter("a dataset in object storage is measured on the host only", param_hint="--device")

    def log(line: str) -> None:
        typer.echo(f"measuring: {line}", err=True)
    try:
        if is_url(dataset):  # the network's limit, a cold and warm epochs through a cache of its own
            from dsc.tools.bench_s3 import run as run_remote

            report = run_remote(dataset, batch_size, threads, seconds, cold, log=log)
        else:
            report = run_bench(dataset, batch_size, threads, seconds, cold, device, log=log)
    except DscError as e:
        _fail_dataset(dataset, e)
    typer.echo(f"{'row':<44} {'samples/s':>10} {'GB/s':>7} {'x limit':>8}")
    for rate, ratio in report.rows():
        typer.echo(f"{rate.name:<44} {rate.samples_per_s:>10,.0f} {rate.gb_per_s:>7.2f} {ratio:>8.2f}")
    for rate, _ in report.rows():  # not the stats' wait share: bench takes batches as fast as they come,
        if rate.stats is not None:  # so it always waits, and that would read as a bottleneck
            typer.echo(f"{rate.name}: producer: {rate.stats.batches} batches; per batch {rate.stats.costs()}")
    for note in report.notes:
        typer.echo(f"- {note}")
