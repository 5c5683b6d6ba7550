"""The Files and Batches APIs' bodies, in OpenAI's shape (the `openai` client parses them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip

COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""Windows a batch may ask for, in seconds (OpenAI offers only 24h)."""

Metadata = dict[
    Annotated[str, StringConstraints(max_length=64)],
    Annotated[str, StringConstraints(max_length=512)],
]
"""OpenAI's metadata: up to 16 string pairs, keys to 64 characters, values to 512."""


class FileObject(BaseModel):
    """A stored file."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class FileDeleted(BaseModel):
    """The answer to `DELETE /v1/files/{id}`."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreate(BaseModel):
    """`POST /v1/batches`: which file, which endpoint, how long it may take."""

    model_config = ConfigDict(strict=True, extra="ignore")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = Field(default=None, max_length=16)


class BatchError(BaseModel):
    """One problem with the input, naming its line where it has one."""

    code: str | None = None
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    """The list a failed batch carries."""

    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    """Lines in the batch, and how many have ended each way."""

    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    """A batch, its status and the timestamps of each status it reached."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: Metadata | None = None


class BatchList(BaseModel):
    """A page of batches, newest first; `after=last_id` asks for the next page."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
