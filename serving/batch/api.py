"""The Files and Batches routes of the ingress: HTTP in OpenAI's shape, the runner's answers out.

The ingress only checks and forwards; the batch runner deployment owns the
state. Creating a batch needs the caller to be allowed the tier its lines run at.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.batch.schemas import BatchCreate, FileDeleted
from serving.config import BatchJobsConfig
from serving.http.errors import ApiError, bad_request, payload_too_large, replica_unavailable
from serving.http.gateway import Gateway
from serving.http.request_body import decode_json_object, read_body
from serving.http.routes import Call, Route

MAX_PAGE = 100
"""Most batches one `GET /v1/batches` answers (OpenAI's bound)."""

MAX_CREATE_BODY_BYTES = 64 * 1024
"""A batch-create body is a few ids and some metadata."""


class BatchApi:
    """Handlers for /v1/files and /v1/batches, forwarding to the batch runner."""

    def __init__(
        self, runner: DeploymentHandle, config: BatchJobsConfig, gateway: Gateway, max_depth: int
    ) -> None:
        self._runner = runner
        self._config = config
        self._gateway = gateway
        self._max_depth = max_depth

    def routes(self) -> dict[tuple[str, str], Route]:
        """Method and path template of each route."""
        return {
            ("POST", "/v1/files"): Route(self._upload),
            ("GET", "/v1/files/{file_id}"): Route(self._file),
            ("GET", "/v1/files/{file_id}/content"): Route(self._file_content),
            ("DELETE", "/v1/files/{file_id}"): Route(self._delete_file),
            ("POST", "/v1/batches"): Route(self._create_batch),
            ("GET", "/v1/batches"): Route(self._list_batches),
            ("GET", "/v1/batches/{batch_id}"): Route(self._batch),
            ("POST", "/v1/batches/{batch_id}/cancel"): Route(self._cancel),
        }

    async def _upload(self, request: Request, call: Call) -> Response:
        """`POST /v1/files`, multipart: a JSONL `file` with `purpose` "batch"."""
        limit = self._config.max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + 64 * 1024:  # room for the form parts
            raise payload_too_large(limit)
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as error:  # Starlette's parser raises its own kinds on bad forms
            raise bad_request(f"The body is not a valid multipart form: {error}") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise bad_request('purpose must be "batch"', param="purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("A file part named 'file' is required.", param="file")
            content = await upload.read(limit + 1)
            filename = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        if len(content) > limit:
            raise payload_too_large(limit)
        return JSONResponse(await _ask(self._runner.add_file, "batch", filename, content))

    async def _file(self, request: Request, call: Call) -> Response:
        return JSONResponse(await self._found(request, "file", self._runner.file))

    async def _file_content(self, request: Request, call: Call) -> Response:
        content = await self._found(request, "file", self._runner.file_content)
        return Response(content, media_type="application/jsonl")

    async def _delete_file(self, request: Request, call: Call) -> Response:
        file_id = request.path_params["file_id"]
        if not await _ask(self._runner.delete_file, file_id):
            raise _not_found("file", file_id)
        return JSONResponse(FileDeleted(id=file_id, deleted=True).model_dump(mode="json"))

    async def _create_batch(self, request: Request, call: Call) -> Response:
        """`POST /v1/batches`; the input file must exist and be a batch input."""
        self._gateway.authorize_tier(call.caller, self._config.tier)
        raw = await read_body(request, MAX_CREATE_BODY_BYTES)
        try:
            create = BatchCreate.model_validate(decode_json_object(raw, self._max_depth))
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            raise bad_request(f"{param}: {first['msg']}", param=param) from None
        stored = await _ask(self._runner.file, create.input_file_id)
        if stored is None:
            raise _not_found("file", create.input_file_id)
        if stored["purpose"] != "batch":
            raise bad_request("The input file's purpose must be 'batch'.", param="input_file_id")
        return JSONResponse(await _ask(self._runner.add_batch, create))

    async def _list_batches(self, request: Request, call: Call) -> Response:
        """`GET /v1/batches?after=ID&limit=N`, newest first."""
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_PAGE:
            raise bad_request(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
        after = request.query_params.get("after")
        return JSONResponse(await _ask(self._runner.batches, after, int(limit_text)))

    async def _batch(self, request: Request, call: Call) -> Response:
        return JSONResponse(await self._found(request, "batch", self._runner.batch))

    async def _cancel(self, request: Request, call: Call) -> Response:
        return JSONResponse(await self._found(request, "batch", self._runner.cancel))

    async def _found(self, request: Request, kind: str, method: Any) -> Any:
        """The runner's answer for the id in the path; 404 when it has none."""
        object_id = request.path_params[f"{kind}_id"]
        answer = await _ask(method, object_id)
        if answer is None:
            raise _not_found(kind, object_id)
        return answer


async def _ask(method: Any, *args: Any) -> Any:
    """Call the runner; while Serve replaces a dead runner replica, a 503 with Retry-After."""
    try:
        return await method.remote(*args)
    except RayActorError:
        raise replica_unavailable() from None


def _not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {kind} with id {object_id!r}.", code="not_found", param=f"{kind}_id")
