"""What a writer thread does with one job: create the file, write its chunks, publish.

``WritePipeline`` runs ``write_sample`` on its writer threads; it keeps the counters
and the stage trace, this module only the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hidden_state_connector.engine.write.buffers import Slab
from hidden_state_connector.engine.write.gather import Chunk, Extractor
from hidden_state_connector.engine.write.job import END_OF_CHUNKS, SaveJob
from hidden_state_connector.engine.write.row_guard import RowCounter, ZeroRowCheck
from hidden_state_reader.files.publish import SampleFileWriter


@dataclass(frozen=True)
class FileOptions:
    """How each sample file is written.

    Attributes:
        checksum: Record CRC32s.
        check_nonfinite: Record NaN/inf flags.
        fsync: fsync each file before publishing.
        zero_rows: Fail samples holding an all-zero row (None: no check).
        writer_factory: What creates each file's writer, with ``SampleFileWriter``'s
            arguments (``WriteHooks.writer_factory``; ``benchmarks/write.py`` times stages).
    """

    checksum: bool
    check_nonfinite: bool
    fsync: bool
    zero_rows: ZeroRowCheck | None = None
    writer_factory: Callable[..., SampleFileWriter] = SampleFileWriter


SampleWriter = Callable[
    [SaveJob, Extractor, FileOptions, Callable[[Slab], None], Callable[[], None]], str | None
]
"""What a writer thread does with one job: ``write_sample``'s arguments and result."""


def write_sample(
    job: SaveJob,
    extractor: Extractor,
    options: FileOptions,
    return_slab: Callable[[Slab], None],
    copies_done: Callable[[], None],
) -> str | None:
    """Write one job's file from its chunk stream; publish it, or give up.

    Every slab that arrives is handed to ``return_slab``, also after a failure, so the
    copies of later jobs keep flowing. On failure the temporary file is removed and the
    lock released with the reason: no partial file is ever published.

    Args:
        job: The sample (its chunks arrive on ``job.ready``).
        extractor: What gathered the chunks (their layout and dtype).
        options: How the file is written.
        return_slab: Gives a slab back to the pool.
        copies_done: Called once the chunk stream has ended.

    Returns:
        None once the file is published, else why it failed.
    """
    writer = _open(job, extractor, options)
    rows = _write_chunks(job, writer, extractor, options, return_slab)
    copies_done()
    if job.failure is None and (short := rows.missing()) is not None:
        job.fail(short)
    if job.failure is None and writer is not None:
        try:
            writer.publish()
            return None
        except Exception as exc:
            job.fail(f"publish failed: {exc}")
    reason = job.failure or "unknown failure"
    if writer is not None:
        writer.abort(reason)
    else:
        if job.lock is not None:
            job.lock.fail(reason)
    return reason


def _open(job: SaveJob, extractor: Extractor, options: FileOptions) -> SampleFileWriter | None:
    """Create the temp file with its header and token ids (None, and the job failed, if not)."""
    try:
        return options.writer_factory(
            job.path,
            token_ids=job.token_ids,
            hidden_shape=(
                job.token_ids.shape[0],
                extractor.layout.num_layers,
                extractor.layout.hidden_size,
            ),
            hidden_dtype=extractor.dtype,
            metadata=job.metadata,
            lock=job.lock,
            checksum=options.checksum,
            record_nonfinite=options.check_nonfinite,
            fsync=options.fsync,
            dir_fd=job.dir_fd,
            loss_mask=job.loss_mask,
            storage=extractor.storage,
        )
    except (OSError, ValueError) as exc:  # ValueError: a mask that does not fit
        job.fail(f"cannot create file: {exc}")
        return None


def _write_chunks(
    job: SaveJob,
    writer: SampleFileWriter | None,
    extractor: Extractor,
    options: FileOptions,
    return_slab: Callable[[Slab], None],
) -> RowCounter:
    """Write chunks as they arrive until the stream ends; after a failure, only drain.

    Each chunk is checked before it is written: its rows must follow the rows before
    it, and none may be all zero (``row_guard``); a chunk that fails either fails the
    sample. Returns the row count, to compare with the token ids at the end.
    """
    rows = RowCounter(int(job.token_ids.shape[0]))
    while True:
        item = job.ready.get()
        if item is END_OF_CHUNKS:
            return rows
        chunk, slab = item
        try:
            if slab.event is not None:
                slab.event.synchronize()
            if writer is not None and job.failure is None:
                wrong = _check_rows(rows, options.zero_rows, extractor, slab, chunk)
                if wrong is not None:
                    job.fail(wrong)
                    continue
                if options.check_nonfinite:
                    writer.note_nonfinite(extractor.chunk_nonfinite(slab, chunk))
                data, scales = extractor.chunk_payload(slab, chunk)
                if scales is not None:
                    writer.write_scales(scales)
                writer.write_hidden(data)
        except Exception as exc:
            job.fail(f"write failed: {exc}")
        finally:
            return_slab(slab)


def _check_rows(
    rows: RowCounter, zero_rows: ZeroRowCheck | None, extractor: Extractor, slab: Slab, chunk: Chunk
) -> str | None:
    """Why a chunk's rows must not be published (out of order, too many, all zero), or None."""
    wrong = rows.add(chunk.start, chunk.stop)
    if wrong is None and zero_rows is not None:
        found = zero_rows.first_zero_row(extractor.chunk_rows(slab, chunk), chunk.start)
        wrong = None if found is None else found.reason()
    return wrong


@dataclass(frozen=True)
class WriteHooks:
    """Seams for benchmarks and profilers into the write path (``WritePipeline``'s ``hooks``).

    Attributes:
        write_sample: What the writer threads do with each job (``SampleWriter``):
            ``benchmarks/null_sink.py`` drains the chunks and writes nothing.
        writer_factory: What creates each file's writer (``FileOptions.writer_factory``).
    """

    write_sample: SampleWriter = write_sample
    writer_factory: Callable[..., SampleFileWriter] = SampleFileWriter


PRODUCTION_HOOKS = WriteHooks()
