"""How a request's tensor bytes travel between this gateway and the workers.

On one host (``shm_same_host``, and every live worker of the model version advertising
this gateway's host: the request is *local*) no large tensor crosses Redis: inputs and
outputs in a client's registered region are read and written by the worker itself, and
other tensors larger than ``shm_threshold_bytes`` go through a segment (:mod:`sluice.core.shm`)
that the gateway creates for a request's inputs and a worker creates for a reply's
outputs. The gateway removes both: its own when the request ends, however it ends;
a worker's as soon as it has read it. Across hosts every byte goes in the entry, and
the gateway reads and writes client regions itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sluice.core.errors import InferenceFailed, InvalidInput
from sluice.core.hosts import host_id
from sluice.core.settings import GatewaySettings
from sluice.core.shm import (
    close_quietly,
    map_segment,
    new_segment_name,
    segment_prefix,
    unlink,
    write_segment,
)
from sluice.core.wire import ReplyMessage, ShmRef, TensorHeader
from sluice.gateway.control.catalog_view import CatalogView
from sluice.gateway.inference.request import InputTensor, RequestedOutput
from sluice.gateway.inference.response import OutputTensor
from sluice.gateway.shm.registry import RegionRegistry

log = logging.getLogger(__name__)


@dataclass
class TensorTransfer:
    regions: RegionRegistry
    prefix: str
    """``sluice-<namespace>-``: names of this deployment's segments."""
    same_host: bool
    threshold: int
    host: str = ""
    """This gateway's host id (:mod:`sluice.core.hosts`)."""
    message_prefix: str = field(init=False)
    """The segment prefix workers get: only on one host may they use segments."""
    segment_min_bytes: int = field(init=False)
    """Outputs from this size on come back through a worker's segment (0: never)."""

    def __post_init__(self) -> None:
        self.message_prefix = self.prefix if self.same_host else ""
        self.segment_min_bytes = self.threshold + 1 if self.same_host and self.threshold else 0

    @classmethod
    def from_settings(cls, settings: GatewaySettings, regions: RegionRegistry) -> TensorTransfer:
        return cls(
            regions,
            segment_prefix(settings.namespace),
            settings.shm_same_host,
            settings.shm_threshold_bytes,
            host_id(settings.host_id),
        )

    def output_regions(self, outputs: list[RequestedOutput], local: bool) -> dict[str, ShmRef]:
        """Outputs the worker writes into client regions itself (local requests only)."""
        if not local:
            return {}
        return {o.name: o.shm for o in outputs if o.shm is not None}

    def local(self, view: CatalogView, model: str, version: int) -> bool:
        """Whether a request to the version may use shared memory: one host by
        configuration, and every live worker of it advertising this gateway's host."""
        return self.same_host and view.only_on(model, version, self.host)

    # -- inputs ----------------------------------------------------------------------------

    def pack(
        self, inputs: list[InputTensor], *, local: bool, inline: bool = False
    ) -> tuple[list[TensorHeader], bytes, str | None]:
        """The entry's tensor headers and payload, and the segment made for the large
        inputs (None if none): the caller removes it with :func:`sluice.core.shm.unlink` once
        the request ended, however it ended. Writing the segment costs what joining the
        bytes into the entry would have cost, on the event loop as that would have been.
        ``local``: the workers share this host (:meth:`local`); ``inline``: every byte in
        the entry (a job's entry outlives its request)."""
        headers: list[TensorHeader] = []
        parts: list[bytes | memoryview | None] = []  # bytes in the entry; None: by reference
        large: list[int] = []
        limit = self.threshold if local and self.threshold and not inline else -1
        for tensor in inputs:
            header = TensorHeader(tensor.name, tensor.datatype, tensor.shape, len(tensor.data))
            data: bytes | memoryview | None = tensor.data
            if tensor.shm is not None:
                if local:
                    header.nbytes, header.shm, data = tensor.shm.byte_size, tensor.shm, None
                else:
                    data = self._read_region(tensor)
                    header.nbytes = len(data)
            elif header.nbytes > limit >= 0:
                large.append(len(headers))
            headers.append(header)
            parts.append(data)
        segment = None
        if large:
            segment = self._write_segment([p for i in large if (p := parts[i]) is not None])
        if segment is not None:
            offset = 0
            for index in large:
                headers[index].shm = ShmRef(segment, offset, headers[index].nbytes)
                offset += headers[index].nbytes
                parts[index] = None
        if len(parts) == 1 and isinstance(parts[0], bytes):
            return headers, parts[0], segment
        return headers, b"".join([part for part in parts if part is not None]), segment

    def _read_region(self, tensor: InputTensor) -> memoryview:
        assert tensor.shm is not None
        return self.regions.read(f"input '{tensor.name}'", tensor.region, tensor.shm)

    def _write_segment(self, buffers: list[bytes | memoryview]) -> str | None:
        """A new segment holding ``buffers``; None if /dev/shm refuses it (then the bytes
        go inline)."""
        name = new_segment_name(self.prefix, "in")
        try:
            write_segment(name, buffers)
        except OSError as exc:
            log.warning("cannot create shared memory segment %s, sending inline: %s", name, exc)
            return None
        return name

    # -- outputs ----------------------------------------------------------------------------

    def unpack(
        self, headers: list[TensorHeader], payload: memoryview, requested: list[RequestedOutput]
    ) -> list[OutputTensor]:
        """The reply's outputs, ready to encode. The caller removes the worker's segments
        afterwards with :meth:`discard`, whatever happened."""
        in_regions = {o.name: o for o in requested if o.shm is not None}
        outputs: list[OutputTensor] = []
        offset = 0
        for header in headers:
            chunk: memoryview | None = None
            if header.shm is None:
                chunk = payload[offset : offset + header.nbytes]
                offset += header.nbytes
            target = in_regions.get(header.name)
            if target is not None:
                if header.shm is not None and header.shm != target.shm:
                    chunk = self._segment_view(header, header.shm)
                outputs.append(self._to_region(header, target, chunk))
                continue
            if header.shm is not None:
                chunk = self._segment_view(header, header.shm)
            assert chunk is not None
            outputs.append(OutputTensor(header.name, header.datatype, header.shape, chunk))
        return outputs

    def bytes_to_handle(self, headers: list[TensorHeader]) -> int:
        """Output bytes the gateway copies to answer (not those a worker wrote into a
        client's region itself)."""
        return sum(
            header.nbytes
            for header in headers
            if header.shm is None or header.shm.key.startswith(self.prefix)
        )

    def _segment_view(self, header: TensorHeader, ref: ShmRef) -> memoryview:
        if not ref.key.startswith(self.prefix) or ref.byte_size != header.nbytes:
            raise InferenceFailed(
                f"output '{header.name}': the reply references unexpected shared memory '{ref.key}'"
            )
        try:
            mapping = map_segment(ref.key)
        except (OSError, ValueError) as exc:
            raise InferenceFailed(
                f"output '{header.name}': cannot read the worker's segment: {exc}"
            ) from None
        end = ref.offset + ref.byte_size
        if end > len(mapping):
            close_quietly(mapping)
            raise InferenceFailed(f"output '{header.name}': the worker's segment is too short")
        return memoryview(mapping)[ref.offset : end]  # unmapped once the views are gone

    def _to_region(
        self, header: TensorHeader, target: RequestedOutput, chunk: memoryview | None
    ) -> OutputTensor:
        """An output the client wants in its region: written there by the worker, or here."""
        assert target.shm is not None
        capacity = target.shm.byte_size
        if header.nbytes > capacity:
            raise InvalidInput(
                f"output '{header.name}' needs {header.nbytes} bytes, "
                f"region '{target.region}' holds {capacity}"
            )
        if chunk is not None:
            label = f"output '{header.name}'"
            self.regions.write(label, target.region, target.shm, chunk[: header.nbytes])
        return OutputTensor(
            header.name,
            header.datatype,
            header.shape,
            b"",
            region=target.region,
            region_bytes=header.nbytes,
        )

    def discard(self, headers: list[TensorHeader]) -> None:
        """Remove the worker segments a reply references (read, or never to be read)."""
        for header in headers:
            if header.shm is not None and header.shm.key.startswith(self.prefix):
                unlink(header.shm.key)

    def discard_reply(self, reply: ReplyMessage) -> None:
        """For replies nobody waits for any more (the request timed out, a duplicate)."""
        self.discard(reply.outputs)
