"""Arrow Flight plumbing shared by predict() and the data source: clients, auth headers,
which errors are worth another endpoint, one DoExchange, and Flight SQL's statement command.

Only pyarrow.flight: no protobuf package, no ADBC (the one protobuf message needed,
CommandStatementQuery wrapped in google.protobuf.Any, is two length-delimited fields).
"""
from __future__ import annotations

import json
import threading

import pyarrow as pa
import pyarrow.flight as flight

STATEMENT_QUERY_TYPE = "type.googleapis.com/arrow.flight.protocol.sql.CommandStatementQuery"


class IncompleteReply(Exception):
    """A worker's stream ended without an error but with fewer rows than were sent."""


# Errors after which the same request may succeed elsewhere or later: the worker is down,
# restarting, overloaded, timed out, or the stream broke (a killed worker shows up as
# UNAVAILABLE or as INTERNAL "stream reset"/"broken pipe", depending on the moment).
RETRYABLE = (
    flight.FlightUnavailableError,
    flight.FlightTimedOutError,
    flight.FlightCancelledError,
    flight.FlightInternalError,
    ConnectionError,
    IncompleteReply,
)
# Errors that another endpoint would give as well: wrong token, refused request.
FATAL = (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError)


def is_refusal(e: BaseException) -> bool:
    """The worker looked at the request and refused it (INVALID_ARGUMENT and the like):
    the same rows would be refused by every worker."""
    if isinstance(e, FATAL) or isinstance(e, RETRYABLE):
        return False
    return isinstance(e, (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError,
                          flight.FlightServerError, pa.ArrowKeyError))


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_delimited(field: int, payload: bytes) -> bytes:
    """A protobuf field of wire type 2 (string, bytes, message)."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def statement_query(query: str) -> bytes:
    """google.protobuf.Any{type_url, value: CommandStatementQuery{query = 1}}."""
    command = length_delimited(1, query.encode("utf-8"))
    return length_delimited(1, STATEMENT_QUERY_TYPE.encode()) + length_delimited(2, command)


def headers(token: str | None) -> list[tuple[bytes, bytes]]:
    if not token:
        return []
    value = token if token.lower().startswith(("bearer ", "basic ")) else "Bearer " + token
    return [(b"authorization", value.encode())]


_clients: dict[str, flight.FlightClient] = {}
_clients_lock = threading.Lock()


def client(uri: str) -> flight.FlightClient:
    """One client per URI per Python process (Spark reuses its Python workers)."""
    with _clients_lock:
        c = _clients.get(uri)
        if c is None:
            c = flight.FlightClient(uri)
            _clients[uri] = c
        return c


def forget(uri: str) -> None:
    """Drops a client after a transport error, so the next call opens a fresh channel."""
    with _clients_lock:
        c = _clients.pop(uri, None)
    if c is not None:
        try:
            c.close()
        except Exception:  # noqa: BLE001 - it is broken already
            pass


def login(uri: str, user: str, password: str, timeout: float) -> str:
    """Basic handshake; returns the `authorization` header value the server gave back."""
    options = flight.FlightCallOptions(timeout=timeout)
    key, value = client(uri).authenticate_basic_token(user, password, options)
    return value.decode() if isinstance(value, bytes) else value


# Calls whose writer thread outlived the exchange (kept alive, never closed under it).
_LINGERING: list = []


def exchange(uri: str, command: dict, table: pa.Table, batch_rows: int, token: str | None,
             timeout: float) -> pa.Table:
    """One DoExchange: `table` out in batches of `batch_rows` (a writer thread), every reply
    read on this thread (so neither side can stall the other on flow control). The server's
    status, if it failed, comes from the read side. Raises IncompleteReply if the stream ends
    short."""
    options = flight.FlightCallOptions(timeout=timeout, headers=headers(token))
    descriptor = flight.FlightDescriptor.for_command(json.dumps(command).encode())
    writer, reader = client(uri).do_exchange(descriptor, options)
    write_error: list[BaseException] = []

    def write() -> None:
        try:
            writer.begin(table.schema)
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
            writer.done_writing()
        except BaseException as e:  # noqa: BLE001 - the read side carries the server's status
            write_error.append(e)

    thread = threading.Thread(target=write, name="lakeml-exchange-writer", daemon=True)
    thread.start()
    failed = True
    try:
        out = reader.read_all()
        failed = False
    finally:
        if failed:
            # Cancel the call, so that a write blocked on flow control fails now.
            try:
                reader.cancel()
            except Exception:  # noqa: BLE001 - the read error says more
                pass
        thread.join(30.0 if failed else timeout)
        if thread.is_alive():
            # Never let the call be destroyed (its writer closed) while the thread is still
            # in a write: gRPC aborts the process on two operations at once on one call.
            _LINGERING.append((writer, reader, thread))
        else:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the read error (or the write error) says more
                pass
    if write_error:
        raise write_error[0]
    if out.num_rows != table.num_rows:
        raise IncompleteReply(f"{uri} returned {out.num_rows} rows for {table.num_rows}")
    return out
