"""Streaming response scan: undo every coding, redact a credential, bound what a response may cost.

Pure (no mitmproxy import), so it is tested alone:

    scan = BodyScanner(secret.needles(), codings("gzip, chunked", "br"), max_received=..., max_decoded=...)
    for chunk in body:                 # the bytes as they arrive (chunked framing already removed)
        send(scan.feed(chunk))         # decoded, redacted; ScanError(reason) on a cap or a bad coding
    send(scan.finish())                # the held-back tail; ScanError if a compressed stream is cut short

What it guarantees, whatever the chunking: the concatenation of everything `feed` and `finish`
returned is the decoded body with every occurrence of every needle replaced by `[REDACTED]`
(overlapping occurrences as one), and it contains no needle and no byte of an occurrence. To catch a
needle split across chunks the redactor holds back the last `longest needle - 1` bytes until more
arrive (or `finish`).

Costs are bounded: no whole-body buffer; a decoder never produces more than `STEP` bytes at a time,
one received chunk may not expand past `MAX_BURST` (a decompression bomb is refused before it is
materialised), and the totals are capped (`max_received` on the wire, `max_decoded` after decoding).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence

from egress_proxy.errors import EgressError

REDACTED = b"[REDACTED]"
STEP = 256 * 1024  # the most a decoder produces per call
MAX_BURST = 16 * 1024 * 1024  # the most one received chunk may decode to (a ratio >= 256 on a 64 KiB read)

# Codings we can undo, by the names HTTP uses (RFC 9110 §8.4.1, IANA content-coding registry).
KNOWN = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "identity"})


class ScanError(EgressError):
    """A response that cannot be passed on; `reason` is a denial reason code (egress_proxy.decision.reasons)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def codings(transfer_encoding: str | None, content_encoding: str | None) -> tuple[str, ...]:
    """The codings to undo, in the order to undo them (the last applied first).

    The body on the wire is the content codings applied in order, then the transfer codings; the
    HTTP layer has already removed a final `chunked`. Any other `chunked`, or a coding not in `KNOWN`,
    raises ScanError("response-coding-unsupported"): what cannot be decoded cannot be scanned.
    """
    transfer = _tokens(transfer_encoding)
    if transfer and transfer[-1] == "chunked":
        transfer = transfer[:-1]
    content = _tokens(content_encoding)
    for name in (*transfer, *content):
        if name not in KNOWN:
            raise ScanError("response-coding-unsupported")
    return tuple(n for n in reversed((*content, *transfer)) if n != "identity")


def _tokens(value: str | None) -> list[str]:
    return [t.strip().lower() for t in (value or "").split(",") if t.strip()]


# -- redaction ------------------------------------------------------------------------------------


class Needles:
    """A prepared needle set. Only the *minimal* needles (those containing no other) are searched for, each
    with one pass of `bytes.find`; the needles holding a hit are then checked in place. Every needle
    contains a minimal one, so this finds exactly the occurrences a search for every needle would."""

    def __init__(self, needles: Iterable[bytes]) -> None:
        unique = sorted({bytes(n) for n in needles if n}, key=len, reverse=True)
        self.needles = tuple(unique)
        self.longest = len(unique[0]) if unique else 0
        bases = [n for n in unique if not any(m != n and m in n for m in unique)]
        holders: list[tuple[bytes, tuple[tuple[bytes, int], ...]]] = []
        for base in bases:
            within = []
            for needle in unique:  # longest first
                at = needle.find(base)
                while at != -1:
                    within.append((needle, at))
                    at = needle.find(base, at + 1)
            holders.append((base, tuple(within)))
        self._bases = tuple(holders)

    def __bool__(self) -> bool:
        return bool(self.needles)

    def spans(self, data: bytes, limit: int) -> list[tuple[int, int]]:
        """The occurrences starting before `limit`, leftmost first, overlapping ones merged into one span: a needle
        whose start another occurrence covers is still covered whole (`<base64 ending in g>` + `hp_…` holds the
        plain value `ghp_…` too)."""
        found: set[tuple[int, int]] = set()
        for base, within in self._bases:
            at = data.find(base)
            while at != -1:
                for needle, offset in within:
                    start = at - offset
                    if 0 <= start < limit and data.startswith(needle, start):
                        found.add((start, start + len(needle)))
                at = data.find(base, at + 1)
        if not found:
            return []
        chosen: list[tuple[int, int]] = []
        for start, stop in sorted(found):
            if chosen and start < chosen[-1][1]:
                if stop > chosen[-1][1]:
                    chosen[-1] = (chosen[-1][0], stop)
            else:
                chosen.append((start, stop))
        return chosen


def _prepared(needles: Needles | Iterable[bytes]) -> Needles:
    return needles if isinstance(needles, Needles) else Needles(needles)


def _replace(data: bytes, spans: Iterable[tuple[int, int]], upto: int) -> bytes:
    out, at = [], 0
    for start, stop in spans:
        out.append(data[at:start])
        out.append(REDACTED)
        at = stop
    out.append(data[at:upto])
    return b"".join(out)


def redact(data: bytes, needles: Needles | Iterable[bytes]) -> tuple[bytes, int]:
    """`data` with every needle replaced by `[REDACTED]`, and the number of replacements (whole input)."""
    spans = _prepared(needles).spans(data, len(data))
    return (_replace(data, spans, len(data)), len(spans)) if spans else (data, 0)


class Redactor:
    """`redact` over a stream: the output never splits a needle across two calls, so none gets through."""

    def __init__(self, needles: Needles | Iterable[bytes]) -> None:
        self.needles = _prepared(needles)
        self.hold = max(self.needles.longest - 1, 0)
        self.hits = 0
        self._tail = b""
        self._covered = 0  # how many bytes at the start of `_tail` an emitted [REDACTED] already stands for

    def feed(self, data: bytes) -> bytes:
        """Redacted output for `data`; the last `hold` bytes wait for the next call."""
        if not self.needles:
            return data
        buf = self._tail + data if self._tail else data
        # INVARIANT: every needle starting before `safe` lies wholly inside `buf`, so it is found now; one starting
        # later is judged next time, also when an emitted span reaches past `safe` (it then continues that span).
        safe = len(buf) - self.hold
        if safe <= 0:
            self._tail = buf
            return b""
        if not self._covered:
            spans = self.needles.spans(buf, safe)
            if not spans:
                self._tail = buf[safe:]
                return buf[:safe]
        out, at = self._emit(buf, self.needles.spans(buf, safe) if self._covered else spans, safe)
        self._tail, self._covered = buf[safe:], max(at - safe, 0)
        return out

    def flush(self) -> bytes:
        """Everything still held back, redacted."""
        tail = self._tail
        out, _ = self._emit(tail, self.needles.spans(tail, len(tail)), len(tail))
        self._tail, self._covered = b"", 0
        return out

    def _emit(self, buf: bytes, spans: list[tuple[int, int]], upto: int) -> tuple[bytes, int]:
        """`buf` up to `upto` (or the end of the last span) with the spans replaced, skipping the covered start; a span
        starting inside what is already covered continues it (no second marker). Returns the output and its end."""
        out, at = [], self._covered
        for start, stop in spans:
            if start >= at:
                out.append(buf[at:start])
                out.append(REDACTED)
                self.hits += 1
            at = max(at, stop)
        if at < upto:
            out.append(buf[at:upto])
            at = upto
        return b"".join(out), at


# -- decoding -------------------------------------------------------------------------------------


class _Zlib:
    """gzip (`wbits` 31, several members allowed) or deflate (zlib-wrapped, or raw as some servers send it)."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self._d: zlib._Decompress | None = zlib.decompressobj(31) if gzip else None
        self._head = b""  # deflate: the first two bytes decide zlib-wrapped or raw
        self._started = gzip
        self._fed = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._fed = True
        if not self._started:
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return
            # RFC 9110 says `deflate` is zlib-wrapped; some servers send raw deflate, whose first bytes are no zlib header.
            wrapped = (data[0] & 0x0F) == 8 and ((data[0] << 8) | data[1]) % 31 == 0
            self._d = zlib.decompressobj(15 if wrapped else -15)
            self._started, self._head = True, b""
        while True:
            if self._d is None:
                if not data:
                    return
                if not self.gzip:
                    raise ScanError("response-decode-failed")  # bytes after the end of a deflate stream
                self._d = zlib.decompressobj(31)  # the next gzip member
            try:
                out = self._d.decompress(data, STEP)
            except zlib.error:
                raise ScanError("response-decode-failed") from None
            if out:
                yield out
            if self._d.eof:
                data, self._d = self._d.unused_data, None
                continue
            data = self._d.unconsumed_tail
            if not data and len(out) < STEP:
                return

    def finish(self) -> Iterator[bytes]:
        if not self._fed:
            return  # an empty body with a coding: nothing to decode
        if not self._started:
            raise ScanError("response-decode-failed")  # one byte of a deflate stream
        if self._d is not None:
            try:
                out = self._d.flush()
            except zlib.error:
                raise ScanError("response-decode-failed") from None
            if out:
                yield out
            if not self._d.eof:
                raise ScanError("response-decode-failed")  # a compressed stream cut short


class _Brotli:
    def __init__(self) -> None:
        import brotli

        self._error = brotli.error
        self._d = brotli.Decompressor()
        self._fed = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._fed = True
        if self._d.is_finished():
            raise ScanError("response-decode-failed")  # bytes after the end of the stream
        try:
            out = self._d.process(data, output_buffer_limit=STEP)
            while True:
                if out:
                    yield out
                if self._d.can_accept_more_data():
                    return
                out = self._d.process(b"", output_buffer_limit=STEP)
        except self._error:
            raise ScanError("response-decode-failed") from None

    def finish(self) -> Iterator[bytes]:
        if self._fed and not self._d.is_finished():
            raise ScanError("response-decode-failed")  # a compressed stream cut short
        return iter(())


class _Zstd:
    def __init__(self) -> None:
        try:
            from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
        except ImportError:
            from backports import zstd  # type: ignore[no-redef]  # a mitmproxy dependency below 3.14

        self._zstd = zstd
        self._d = zstd.ZstdDecompressor()
        self._fed = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._fed = True
        try:
            while True:
                if self._d.eof:
                    data = self._d.unused_data + data
                    if not data:
                        return
                    self._d = self._zstd.ZstdDecompressor()  # the next frame
                elif not data and self._d.needs_input:
                    return
                out = self._d.decompress(data, STEP)
                data = b""
                if out:
                    yield out
        except (self._zstd.ZstdError, EOFError):
            raise ScanError("response-decode-failed") from None

    def finish(self) -> Iterator[bytes]:
        if self._fed and not self._d.eof:
            raise ScanError("response-decode-failed")  # a compressed stream cut short
        return iter(())


def _decoder(name: str):
    if name in ("gzip", "x-gzip"):
        return _Zlib(gzip=True)
    if name == "deflate":
        return _Zlib(gzip=False)
    if name == "br":
        return _Brotli()
    if name == "zstd":
        return _Zstd()
    raise ScanError("response-coding-unsupported")


class BodyScanner:
    """Decode (`codings`, in undo order), cap and redact one response body, chunk by chunk."""

    def __init__(self, needles: Needles | Iterable[bytes], codings: Sequence[str] = (), *, max_received: int | None = None,
                 max_decoded: int | None = None) -> None:
        self._decoders = [_decoder(name) for name in codings]
        self._redactor = Redactor(needles)
        self.max_received = max_received
        self.max_decoded = max_decoded
        self.received = 0  # bytes in, as they came off the wire (minus chunked framing)
        self.decoded = 0  # bytes after every coding was undone
        self.delivered = 0  # bytes returned (redacted)

    @property
    def redactions(self) -> int:
        return self._redactor.hits

    def feed(self, chunk: bytes) -> bytes:
        """The redacted, decoded output for one received chunk (possibly empty)."""
        self.received += len(chunk)
        if self.max_received is not None and self.received > self.max_received:
            raise ScanError("response-too-large")
        out = self._emit(self._through(0, chunk), limit=self.decoded + MAX_BURST)
        self.delivered += len(out)
        return out

    def finish(self) -> bytes:
        """The tail: flush every decoder (ScanError if a stream was cut short), then the redactor."""
        parts = [self._emit(self._finishing(0), limit=None), self._redactor.flush()]
        out = b"".join(parts)
        self.delivered += len(out)
        return out

    def _through(self, i: int, data: bytes) -> Iterator[bytes]:
        if i == len(self._decoders):
            if data:
                yield data
            return
        for piece in self._decoders[i].feed(data):
            yield from self._through(i + 1, piece)

    def _finishing(self, i: int) -> Iterator[bytes]:
        if i == len(self._decoders):
            return
        for piece in self._decoders[i].finish():
            yield from self._through(i + 1, piece)
        yield from self._finishing(i + 1)

    def _emit(self, pieces: Iterator[bytes], limit: int | None) -> bytes:
        out = []
        for piece in pieces:
            self.decoded += len(piece)
            if self.max_decoded is not None and self.decoded > self.max_decoded:
                raise ScanError("decoded-too-large")
            if limit is not None and self.decoded > limit:
                raise ScanError("decoded-too-large")  # one chunk expanding past MAX_BURST: a bomb
            out.append(self._redactor.feed(piece))
        return b"".join(out)


def scan_whole(needles: Needles | Iterable[bytes], codings: Sequence[str], data: bytes, *, max_received: int | None = None,
               max_decoded: int | None = None) -> tuple[bytes, int]:
    """What a BodyScanner gives for `data` fed whole and finished, and its redaction count (ScanError alike): with no
    coding to undo (a small JSON answer, the common case) that is one `redact` pass under the same caps."""
    if codings:
        scan = BodyScanner(needles, codings, max_received=max_received, max_decoded=max_decoded)
        body = scan.feed(data) + scan.finish()
        return body, scan.redactions
    if max_received is not None and len(data) > max_received:
        raise ScanError("response-too-large")
    if (max_decoded is not None and len(data) > max_decoded) or len(data) > MAX_BURST:
        raise ScanError("decoded-too-large")
    return redact(data, needles)
