"""Streaming multipart reader for dataset uploads.

Starlette's form parser spools every file to a temporary file of its own before a route
runs; this reads the request body chunk by chunk instead and writes the ``file`` part
straight into a ``core.files.service.FileSink`` (under the data dir, hashed and counted as it
arrives), so an oversized upload is refused at the limit rather than after it is all on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anyio import to_thread
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from api.inputs import check_field
from core.errors import InvalidInput, TooLarge
from core.files.service import FileSink

MAX_FIELD_BYTES = 4096
MULTIPART_OVERHEAD = 64 * 1024
"""Allowance for part headers and small fields when judging Content-Length against the limit."""


@dataclass
class UploadForm:
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


class _Reader:
    def __init__(self, sink: FileSink) -> None:
        self.sink = sink
        self.form = UploadForm()
        self.pending: list[bytes] = []
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._is_file, self._value = b"", None, False, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name, self._header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        check_field(self._name, self._name)
        # `curl -F file=<data.jsonl` sends the file as a plain field: still the dataset.
        self._is_file = b"filename" in options or self._name == "file"
        if self._is_file:
            if self._name != "file":
                raise InvalidInput(
                    f"{self._name or 'a part'}: unexpected file part; send the dataset as the 'file' field",
                    param=self._name or None,
                )
            if self.form.filename is not None:
                raise InvalidInput("file: send one file per upload", param="file")
            self.form.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            check_field(self.form.filename, "file")  # the filename, stored with the file

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.pending.append(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise InvalidInput(f"{self._name}: field longer than {MAX_FIELD_BYTES} bytes", param=self._name)

    def on_part_end(self) -> None:
        if not self._is_file and self._name:
            self.form.fields[self._name] = self._value.decode("utf-8", "replace")
            check_field(self.form.fields[self._name], self._name)

    def flush(self) -> None:
        for chunk in self.pending:
            self.sink.write(chunk)
        self.pending.clear()


async def receive_upload(request: Request, sink: FileSink) -> UploadForm:
    """Read a ``multipart/form-data`` body, writing its ``file`` part into ``sink``.

    Raises:
        InvalidInput: not multipart, no ``file`` part, malformed body.
        TooLarge: Content-Length or the streamed bytes exceed the sink's limit.
    """
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidInput(
            "send the dataset as multipart/form-data with a 'file' part and a 'purpose' field "
            "(curl -F file=@data.jsonl -F purpose=train)",
            param="file",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > sink.max_bytes + MULTIPART_OVERHEAD:
        raise TooLarge(
            f"file: the request is {declared} bytes, over the limit of {sink.max_bytes} bytes "
            "(FTQ_MAX_UPLOAD_BYTES); split the dataset or raise the limit",
            param="file",
        )
    reader = _Reader(sink)
    callbacks = {
        "on_part_begin": reader.on_part_begin,
        "on_part_data": reader.on_part_data,
        "on_part_end": reader.on_part_end,
        "on_header_field": reader.on_header_field,
        "on_header_value": reader.on_header_value,
        "on_header_end": reader.on_header_end,
        "on_headers_finished": reader.on_headers_finished,
    }
    parser = MultipartParser(params[b"boundary"], callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if reader.pending:
                await to_thread.run_sync(reader.flush)
        parser.finalize()
    except FormParserError as exc:
        raise InvalidInput(f"file: malformed multipart body ({exc})", param="file") from None
    if reader.form.filename is None:
        raise InvalidInput(
            "file: no file part; send the dataset as the 'file' field (curl -F file=@data.jsonl)", param="file"
        )
    return reader.form
