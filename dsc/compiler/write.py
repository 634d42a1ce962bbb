"""Write: decode + resize sources straight into their record slots of the shard files.

Record slot `i` belongs to source `order[i]`, fixed before any work starts, so the bytes
do not depend on which engine runs the work, how many workers it has or which finishes first.
A `SlotWriter` lives wherever the work runs (a local worker process, a Ray task) and hands
each record to the build's sink: in a folder build, its shard file at its offset (`ShardSlots`);
in a bucket build, the chunk's object (`bucket_chunks.ChunkObjects`). No pixel ever crosses a
pipe: only (slot, size or reason, CRC) goes back. Slots of skipped sources are closed up later,
when the build is finished (`finish.compact`, or the bucket build's shard assembly).
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from dsc import format as fmt
from dsc.compiler import sources
from dsc.compiler.decode import DecoderWarning, decode, probe
from dsc.compiler.jobs import Chunk, SlotResult, WriteJob
from dsc.compiler.resize import resize_into
from dsc.compiler.sources import bucket_folder
from dsc.compiler.target import Target, needed_size
from dsc.errors import ImageError
from dsc.files import RefusedFile, TooLarge, read_regular
from dsc.storage.object_file import is_url

# Errors that belong to a source file itself, so it is skipped. Any other OSError (too many open
# files, an I/O error) stops the compile instead, to be resumed: never a good image lost.
SOURCE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP,
                           errno.ENAMETOOLONG, errno.ENXIO, errno.ENODEV})


def compile_image(path: str, target: Target, out: np.ndarray, max_pixels: int,
                  decode_mode: str = "faithful", alpha: str = "black") -> tuple[int, int]:
    """Decode one file into `out`; return its upright (height, width) or raise ImageError."""
    try:
        data = read_regular(path, max_file_bytes(max_pixels))
    except TooLarge as e:
        raise too_large_file(e.size, max_pixels) from None
    except RefusedFile as e:
        raise ImageError(str(e)) from None
    except OSError as e:
        if e.errno not in SOURCE_ERRNOS:  # EMFILE, EIO, ENOMEM...: the machine's trouble, not the file's
            raise
        raise ImageError(f"cannot read file: {e.strerror or e}") from e
    return compile_data(data, target, out, max_pixels, decode_mode, alpha)


def too_large_file(size: int, max_pixels: int) -> ImageError:
    """Why a file (or an object) of `size` bytes is skipped unread."""
    return ImageError(f"file is {size} bytes, more than any image within --max-pixels ({max_pixels}) can need; "
                      "not read")


def compile_data(data: bytes, target: Target, out: np.ndarray, max_pixels: int,
                 decode_mode: str = "faithful", alpha: str = "black") -> tuple[int, int]:
    """Decode one encoded image (a file's or an archive member's bytes) into `out`; return its upright
    (height, width) or raise ImageError."""
    try:
        p = probe(data, max_pixels)
        height, width = p.oriented_size
        rgb = decode(data, p, *needed_size(height, width, target), decode_mode, alpha)
        resize_into(rgb, target, out, (height, width))
    except ImageError:
        raise
    except MemoryError as e:
        raise ImageError("out of memory while decoding") from e
    except Exception as e:  # one odd file must not end a compile of millions; report it instead
        raise ImageError(f"cannot decode ({type(e).__name__}: {e})") from e
    return height, width


def max_file_bytes(max_pixels: int) -> int:
    """The largest file worth reading: uncompressed 16-bit RGBA (8 bytes a pixel) plus 16 MiB of metadata."""
    return max_pixels * 8 + (16 << 20)


class ShardSlots:
    """Where a folder build's records go: each straight into its slot of the shard files, with one
    `pwrite` (measured here, writing through a map of a freshly allocated shard costs 0.3-0.5 ms of page
    faults per 150 KB record, `pwrite` 0.07 ms)."""

    def __init__(self, job: WriteJob) -> None:
        self.job = job
        self.files: dict[int, int] = {}

    def store(self, slot: int, record: memoryview) -> None:
        shard, offset = fmt.record_offset(slot, self.job.records_per_shard, len(record))
        if shard not in self.files:
            self.release()  # a folder chunk's slots are consecutive: one shard file open at a time
            self.files[shard] = os.open(Path(self.job.stage) / fmt.shard_file(shard), os.O_WRONLY)
        while record:
            written = os.pwrite(self.files[shard], record, offset)
            record, offset = record[written:], offset + written

    def done(self, results: list[SlotResult]) -> None:
        """The chunk is filled: every record is in place already."""

    def release(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


def sink_for(job: WriteJob):
    """Where this job's records go: shard files of a folder build, or chunk objects of a bucket build
    (`dsc.compiler.bucket_chunks`, imported only for an s3:// build)."""
    if is_url(job.stage):
        from dsc.compiler.bucket_chunks import ChunkObjects

        return ChunkObjects(job)
    return ShardSlots(job)


class SlotWriter:
    """Fills slots of one build; one per worker process.

    Each record is resized into one reused buffer and handed to the build's sink (`sink_for`)."""

    def __init__(self, job: WriteJob):
        import torch

        torch.set_num_threads(1)  # parallelism comes from the workers, not from inside a resize
        self.job = job
        self.buffer = np.empty((job.target.height, job.target.width, fmt.CHANNELS), np.uint8)
        self.sink = sink_for(job)
        # probe() refuses images over --max-pixels from the header; Pillow's own, lower limit
        # would otherwise overrule a larger --max-pixels. Restored by close().
        self._pillow_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None

    def write(self, tasks: Chunk, on_result: Callable[[SlotResult], None] | None = None) -> list[SlotResult]:
        """Fill these slots (consecutive ones, or an archive unit's), closing the shard file after; `on_result`
        hears of each slot as it is done (a worker's sign of progress)."""
        results = []
        try:
            for slot, source in self._inputs(tasks):
                try:
                    with warnings.catch_warnings(record=True) as caught:  # they travel back in the result
                        warnings.simplefilter("always", DecoderWarning)
                        h, w = self._compile(source)
                    self.sink.store(slot, memoryview(self.buffer).cast("B"))
                    notes = [str(c.message) for c in caught if issubclass(c.category, DecoderWarning)]
                    results.append(SlotResult(slot, h, w, crc=fmt.record_crc(self.buffer), warning="; ".join(notes),
                                              warnings=len(notes)))
                except ImageError as e:
                    results.append(SlotResult(slot, reason=str(e)))
                if on_result is not None:
                    on_result(results[-1])
            self.sink.done(results)
        finally:
            self.sink.release()
        return results

    def _inputs(self, tasks: Chunk | sources.ArchiveChunk | bucket_folder.ObjectChunk
                ) -> Iterator[tuple[int, str | bytes | ImageError]]:
        """(slot, a file's path) for a folder's chunk; (slot, bytes or why not) streamed from an archive's or a
        bucket's."""
        if isinstance(tasks, sources.ArchiveChunk):
            return sources.read_chunk(tasks, max_file_bytes(self.job.max_pixels))
        if isinstance(tasks, bucket_folder.ObjectChunk):  # an image folder in a bucket: the worker GETs each
            pixels = self.job.max_pixels
            return bucket_folder.read_chunk(tasks, max_file_bytes(pixels), lambda size: too_large_file(size, pixels))
        return ((slot, os.path.join(self.job.src_root, source)) for slot, source in tasks)

    def _compile(self, source: str | bytes | ImageError) -> tuple[int, int]:
        if isinstance(source, ImageError):
            raise source
        job = self.job
        compile_source = compile_data if isinstance(source, bytes) else compile_image
        return compile_source(source, job.target, self.buffer, job.max_pixels, job.decode_mode, job.alpha)

    def close(self) -> None:
        self.sink.release()
        Image.MAX_IMAGE_PIXELS = self._pillow_limit


def writer_for(job):
    """What fills a job's chunks where it runs: a `SlotWriter` decodes sources; a job of another kind (a bucket
    build's shard assembly, `bucket_chunks.AssembleJob`) makes its own with `job.writer()`."""
    make = getattr(job, "writer", None)
    return make() if make is not None else SlotWriter(job)


def write_chunk(job: WriteJob, chunk: Chunk) -> list[SlotResult]:
    """Fill one chunk's slots with a writer of its own (a Ray task, a single-process compile)."""
    writer = writer_for(job)
    try:
        return writer.write(chunk)
    finally:
        writer.close()
